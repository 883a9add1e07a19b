"""Worker side: `KVDepotOffloadingWorker`, vLLM's OffloadingWorker backed by the daemon.

Contract with vLLM's worker (one per rank, called from the model-runner thread):
- `submit_store` / `submit_load` never block and always return True: a job that
  cannot run (daemon down, namespace refused) gets a failed result instead.
- A job for a namespace that is not registered yet (the first jobs after start-up,
  or after a connector `reset_cache()` moved the scheduler to a new namespace) is
  HELD while the registration runs, then submitted; one still held after
  `kvdepot_job_timeout_s` fails. Jobs fail at once while the daemon is away.
- `get_finished` returns every result that arrived, failures included
  (`success=False`); KVDepotConnector turns failed loads into load errors.
- `wait(job_ids)` blocks until those jobs are done (the daemon answers a job only
  after its copy finished): up to `kvdepot_job_timeout_s` for held jobs to be
  submitted, then up to `kvdepot_job_timeout_s` for the daemon's answer, after
  which the jobs in flight are abandoned and reported failed.
- Expedited loads are flagged so the daemon serves them before queued jobs.

The pieces: `memory_paths` chooses how the daemon reaches the KV memory,
`registration.Registrar` keeps the rank registered (a background thread),
`inline.InlineTransport` carries pages when the daemon cannot reach them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvdepot.client import DepotClient
from kvdepot.client.vllm.inline import InlineTransport
from kvdepot.client.vllm.memory_paths import MemoryPath, MemoryPlan, describe_memory, log_choice
from kvdepot.client.vllm.registration import Registrar
from kvdepot.client.vllm.transfer_specs import KVDepotLoadStoreSpec
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.worker")

__all__ = ["KVDepotOffloadingWorker", "MemoryPath", "MemoryPlan", "describe_memory"]


@dataclass
class _Job:
    job_id: int
    is_load: bool
    namespace_id: str
    keys: list[bytes]
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]
    expedited: bool
    submitted: float
    cuda_event: torch.cuda.Event | None = None


class KVDepotOffloadingWorker(OffloadingWorker):
    """One rank's transfers to and from the daemon."""

    def __init__(
        self,
        client: DepotClient,
        kv_caches: CanonicalKVCaches,
        *,
        namespace_id: str,
        make_layout: Callable[[str, list[list[int]]], depot_pb2.NamespaceLayout],
        rank: int,
        blocks_per_chunk: int,
        memory_path: str = "auto",
        job_timeout_s: float = 15.0,
    ) -> None:
        self._client = client
        self._kv_caches = kv_caches
        self._rank = rank
        self._bpc = blocks_per_chunk
        self._job_timeout = job_timeout_s
        self.layer_pages = [
            [ref.page_size_bytes for ref in refs] for refs in kv_caches.group_data_refs
        ]
        plan = describe_memory(kv_caches, memory_path)
        log_choice(plan, rank)

        self._lock = threading.Condition()
        self._stream = client.transfer_stream()
        self._next_overdue_check = 0.0
        self._closed = False
        self._jobs: dict[int, _Job] = {}
        self._on_stream: set[int] = set()
        self._held: dict[int, _Job] = {}  # waiting for their namespace's registration
        self._local_results: list[TransferResult] = []
        self._local_pending: set[int] = set()
        # Figures for tests, benchmarks and the connector.
        self.failed_load_keys: set[bytes] = set()
        self.stats = {
            "stores": 0,
            "loads": 0,
            "failed_stores": 0,
            "failed_loads": 0,
            "dropped_keys": 0,
            "registrations": 0,
            "abandoned": 0,
            "held": 0,
        }
        self._inline: InlineTransport | None = None
        if plan.path is MemoryPath.INLINE:
            self._start_inline()
        self._registrar = Registrar(
            client,
            plan,
            rank=rank,
            namespace_id=namespace_id,
            make_layout=make_layout,
            layer_pages=self.layer_pages,
            on_registered=self._release_held,
            on_refused=self._fail_held,
            on_memory_changed=self._memory_changed,
        )
        client.add_disconnect_listener(self._on_disconnect)
        self._registrar.start()

    # -- registration ---------------------------------------------------------------------

    @property
    def memory(self) -> MemoryPlan:
        """The memory path in use (it turns inline if the daemon refused pvm)."""
        return self._registrar.memory

    @property
    def registered(self) -> bool:
        """Whether the current namespace is registered in the current session."""
        return self._registrar.registered

    def wait_registered(self, timeout: float) -> bool:
        return self._registrar.wait_registered(timeout)

    def _start_inline(self) -> None:
        self._inline = InlineTransport(
            self._client,
            self._kv_caches,
            rank=self._rank,
            blocks_per_chunk=self._bpc,
            finish=self._inline_finished,
            on_dropped=self._count_dropped,
        )

    def _memory_changed(self, plan: MemoryPlan) -> None:
        if plan.path is MemoryPath.INLINE and self._inline is None:
            self._start_inline()

    def _release_held(self, namespace_id: str) -> None:
        """Registration thread: `namespace_id` is usable; submit its held jobs."""
        self.stats["registrations"] += 1
        registration = self._registrar.registration(namespace_id)
        with self._lock:
            jobs = [j for j in self._held.values() if j.namespace_id == namespace_id]
            for job in jobs:
                del self._held[job.job_id]
                if registration is not None:
                    self._claim(job)  # before waking wait(): it must find them in flight
            self._lock.notify_all()
        for job in sorted(jobs, key=lambda j: (not j.expedited, j.submitted)):
            if registration is None:  # the session ended again meanwhile
                self._finish_local(job, False, "the kvdepot daemon went away")
            else:
                self._send(job, registration)

    def _fail_held(self, namespace_id: str, reason: str) -> None:
        with self._lock:
            jobs = [j for j in self._held.values() if j.namespace_id == namespace_id]
            for job in jobs:
                del self._held[job.job_id]
        for job in jobs:
            self._finish_local(job, False, f"the daemon refused namespace {namespace_id}: {reason}")

    def _on_disconnect(self) -> None:
        with self._lock:
            jobs, self._held = list(self._held.values()), {}
        for job in jobs:
            self._finish_local(job, False, "lost the kvdepot daemon before the job was sent")

    # -- submission ---------------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._submit(job_id, False, dst_spec, src_spec, expedited=False)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self._submit(job_id, True, src_spec, dst_spec, expedited=expedited)
        return True

    def _submit(
        self,
        job_id: int,
        is_load: bool,
        depot_spec: LoadStoreSpec,
        gpu_spec: GPULoadStoreSpec,
        expedited: bool,
    ) -> None:
        if not isinstance(depot_spec, KVDepotLoadStoreSpec):
            self._fail_at_once(
                job_id, is_load, [], f"not a kvdepot spec: {type(depot_spec).__name__}"
            )
            return
        job = _Job(
            job_id=job_id,
            is_load=is_load,
            namespace_id=depot_spec.namespace_id,
            keys=depot_spec.keys,
            block_ids=gpu_spec.block_ids.tolist(),
            group_sizes=[int(n) for n in gpu_spec.group_sizes],
            block_indices=[int(i) for i in gpu_spec.block_indices],
            expedited=expedited,
            submitted=time.monotonic(),
        )
        if not job.keys:
            self._finish_local(job, True, "")
            return
        if self._registrar.suspended:
            self._finish_local(
                job, False, "the kvdepot daemon stopped answering; waiting for it to respond again"
            )
            return
        refused = self._registrar.refused(job.namespace_id)
        if refused is not None:
            self._finish_local(job, False, f"the daemon refused this namespace: {refused}")
            return
        if not self._client.connected:
            self._finish_local(job, False, "the kvdepot daemon is unavailable")
            return
        # Order a store after the forward that wrote its blocks (and a load after the
        # reads of the blocks it overwrites) now, on the model-runner's thread.
        self._record_cuda(job)
        with self._lock:
            registration = self._registrar.registration(job.namespace_id)
            if registration is None:
                self._held[job_id] = job
                self.stats["held"] += 1
        if registration is None:
            self._registrar.want(job.namespace_id)
            return
        self._dispatch(job, registration)

    def _record_cuda(self, job: _Job) -> None:
        plan = self.memory
        if plan.cuda_export is not None:
            # The daemon's copy waits for everything enqueued so far on this stream.
            plan.cuda_export.record()
        elif self._kv_caches.tensors and self._kv_caches.tensors[0].tensor.is_cuda:
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record()

    def _dispatch(self, job: _Job, registration: int) -> None:
        """Sends a job of a registered namespace to the daemon (or the inline thread)."""
        with self._lock:
            self._claim(job)
        self._send(job, registration)

    def _claim(self, job: _Job) -> None:
        """Records a job as in flight on its path (call with the lock held)."""
        self._jobs[job.job_id] = job
        if self.memory.path is MemoryPath.INLINE:
            self._local_pending.add(job.job_id)
        else:
            self._on_stream.add(job.job_id)

    def _send(self, job: _Job, registration: int) -> None:
        if self.memory.path is MemoryPath.INLINE:
            assert self._inline is not None
            self._inline.submit(job)
            return
        self._stream.submit(
            depot_pb2.TransferJob(
                job_id=job.job_id,
                direction=depot_pb2.LOAD if job.is_load else depot_pb2.STORE,
                registration_id=registration,
                keys=job.keys,
                block_ids=job.block_ids,
                group_sizes=job.group_sizes,
                block_indices=job.block_indices,
                expedited=job.expedited,
            )
        )

    def _fail_at_once(self, job_id: int, is_load: bool, keys: list[bytes], error: str) -> None:
        self._finish_local(
            _Job(job_id, is_load, "", keys, [], [], [], False, time.monotonic()), False, error
        )

    def _inline_finished(
        self, job: _Job, success: bool, error: str, nbytes: int, seconds: float
    ) -> None:
        self._finish_local(job, success, error, nbytes, seconds)

    def _count_dropped(self, n: int) -> None:
        self.stats["dropped_keys"] += n

    def _finish_local(
        self,
        job: _Job,
        success: bool,
        error: str,
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        if not success:
            self._count_failure(job.is_load, job.keys, error)
        elif job.keys:
            self.stats["loads" if job.is_load else "stores"] += 1
        with self._lock:
            self._jobs.pop(job.job_id, None)
            self._local_pending.discard(job.job_id)
            self._local_results.append(
                TransferResult(
                    job_id=job.job_id,
                    success=success,
                    transfer_size=nbytes if success else None,
                    transfer_time=seconds if success else None,
                )
            )
            self._lock.notify_all()

    def _count_failure(self, is_load: bool, keys: list[bytes], error: str) -> None:
        if is_load:
            with self._lock:
                self.stats["failed_loads"] += 1
                self.failed_load_keys.update(keys)
            log.warning(
                "kvdepot load of %d keys failed (%s); vLLM recomputes them", len(keys), error
            )
        else:
            self.stats["failed_stores"] += 1
            log.debug("kvdepot store of %d keys failed: %s", len(keys), error)

    # -- completion ---------------------------------------------------------------------------

    def take_failed_load_keys(self) -> set[bytes]:
        """Keys of loads that failed since the last call."""
        with self._lock:
            keys, self.failed_load_keys = self.failed_load_keys, set()
        return keys

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for r in self._stream.poll():
            with self._lock:
                self._on_stream.discard(r.job_id)
                job = self._jobs.pop(r.job_id, None)
            if job is None:
                continue  # abandoned after a timeout; its result came late
            if r.success:
                if job.is_load:
                    self.stats["loads"] += 1
                else:
                    self.stats["stores"] += 1
                    self.stats["dropped_keys"] += r.dropped_keys
                out.append(
                    TransferResult(
                        job_id=r.job_id,
                        success=True,
                        transfer_size=int(r.bytes),
                        transfer_time=float(r.copy_seconds or r.total_seconds),
                    )
                )
            else:
                self._count_failure(job.is_load, job.keys, f"{r.error_code or 'FAILED'}: {r.error}")
                out.append(TransferResult(job_id=r.job_id, success=False))
        self._check_overdue()
        with self._lock:
            if self._local_results:
                out.extend(self._local_results)
                self._local_results = []
        return out

    def _check_overdue(self) -> None:
        """Async loads are never waited on: a daemon that stops answering would
        leave their requests waiting forever. Give up on them like wait() does."""
        now = time.monotonic()
        if now < self._next_overdue_check:
            return
        self._next_overdue_check = now + 0.25
        self._expire_held(now)
        with self._lock:
            overdue = {
                j
                for j in self._on_stream
                if (job := self._jobs.get(j)) is not None
                and now - job.submitted > self._job_timeout
            }
        if overdue:
            self._abandon(overdue)

    def _expire_held(self, now: float, only: set[int] | None = None) -> None:
        """Fails held jobs whose namespace did not register within the job timeout."""
        with self._lock:
            expired = [
                j
                for j in self._held.values()
                if (only is None or j.job_id in only) and now - j.submitted >= self._job_timeout
            ]
            for job in expired:
                del self._held[job.job_id]
        for job in expired:
            self._finish_local(
                job,
                False,
                f"namespace {job.namespace_id} was not registered within "
                f"{self._job_timeout:.1f}s (kvdepot_job_timeout_s)",
            )

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until every job in `job_ids` has finished (results stay for
        `get_finished`). Unknown or already collected ids are ignored."""
        ids = set(job_ids)
        with self._lock:
            while ids & self._held.keys():
                oldest = min(self._held[j].submitted for j in ids & self._held.keys())
                remaining = oldest + self._job_timeout - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
        self._expire_held(time.monotonic(), ids)
        deadline = time.monotonic() + self._job_timeout
        with self._lock:
            on_stream = ids & self._on_stream
        if on_stream and not self._stream.wait(on_stream, timeout=self._job_timeout):
            self._abandon(on_stream)
        with self._lock:
            while ids & self._local_pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)

    def _abandon(self, waited: set[int]) -> None:
        """The daemon did not answer in time: give up on every job on the stream,
        report them failed, and start a new stream."""
        with self._lock:
            stale = set(self._on_stream)
            # The daemon may be frozen: the new stream's lane opens in the background.
            old, self._stream = self._stream, self._client.transfer_stream(open_lane_now=False)
        self._registrar.suspend()
        log.error(
            "kvdepot: %d transfer job(s) got no answer within %.1fs; abandoning %d job(s) "
            "in flight, reopening the Transfer stream, and failing new jobs until the daemon "
            "answers again",
            len(waited),
            self._job_timeout,
            len(stale),
        )
        # Cancelling the stream tells the daemon to drop what it has not started.
        abort = getattr(old, "abort", None)
        if callable(abort):
            abort("the client gave up waiting")
        else:
            old.close()
        for job_id in stale:
            with self._lock:
                self._on_stream.discard(job_id)
                job = self._jobs.get(job_id)
            self.stats["abandoned"] += 1
            if job is not None:
                self._finish_local(job, False, "no answer in time")

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._registrar.close()
        if self._inline is not None:
            self._inline.close()
        self._stream.close()
        # Ending the session makes the daemon unmap our memory and drop everything.
        self._client.close()
