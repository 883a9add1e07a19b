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
`inline.InlineTransport` carries pages when the daemon cannot reach them,
`job_ledger.JobLedger` keeps the jobs between submit and get_finished.
A job is read from vLLM's specs once, into kvdepot.common.jobs.Job, which the
inline transport and the TransferStream take as it is (the stream puts it on the
wire); every result, the daemon's or one decided here, is a JobResult until it is
handed to vLLM as its TransferResult.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import compress

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvdepot.client import DepotClient
from kvdepot.client.vllm.canonical import UnitSpan
from kvdepot.client.vllm.inline import InlineTransport
from kvdepot.client.vllm.job_ledger import JobLedger, Submitted
from kvdepot.client.vllm.memory_paths import MemoryPath, MemoryPlan, describe_memory, log_choice
from kvdepot.client.vllm.registration import Registrar
from kvdepot.client.vllm.transfer_specs import KVDepotLoadStoreSpec, KVDepotStoreSpec
from kvdepot.common.chunks import chunks_per_group
from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.kinds import Direction
from kvdepot.common.shards import RankRoute
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.worker")

__all__ = ["KVDepotOffloadingWorker", "MemoryPath", "MemoryPlan", "describe_memory"]


def held_groups_only(job: Job, held: Sequence[bool], blocks_per_chunk: int) -> Job:
    """`job` without the keys and blocks of the groups not `held` (group-major, as
    vLLM's specs are): what a rank of a pipeline stage that holds no layer of a group
    copies, in a namespace part whose layout has the held groups alone."""
    per_group = chunks_per_group(job.group_sizes, job.block_indices, blocks_per_chunk)
    keys: list[bytes] = []
    events: list[bytes] = []
    block_ids: list[int] = []
    key_pos = block_pos = 0
    for n_keys, n_blocks, keep in zip(per_group, job.group_sizes, held, strict=True):
        if keep:
            keys += job.keys[key_pos : key_pos + n_keys]
            block_ids += job.block_ids[block_pos : block_pos + n_blocks]
            if job.key_events:
                events += job.key_events[key_pos : key_pos + n_keys]
        key_pos += n_keys
        block_pos += n_blocks
    return replace(
        job,
        keys=keys,
        block_ids=block_ids,
        group_sizes=list(compress(job.group_sizes, held)),
        block_indices=list(compress(job.block_indices, held)),
        key_events=events,
    )


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
        route: RankRoute | None = None,
        node_shards: int = 1,
        units: UnitSpan | None = None,
    ) -> None:
        """`rank`: the rank on the daemon; with shards or pipeline stages, `route` says
        which shard `client` reaches and which namespace part the rank is in (the rank
        is `route.rank` there), and the scheduler's namespaces are renamed for it
        (kvdepot.common.shards). `units`: in a canonical namespace, the KV-head units
        this rank's pages hold (client/vllm/canonical.py); `rank` is the first."""
        self._client = client
        self._route = route
        self._namespace_id = namespace_id  # as this rank computed it, before any shard
        self._namespace_said = False
        self._kv_caches = kv_caches
        self._rank = rank
        self._bpc = blocks_per_chunk
        self._job_timeout = job_timeout_s
        self.layer_pages = (
            [[ref.page_size_bytes for ref in refs] for refs in kv_caches.group_data_refs]
            if units is None
            else units.layer_pages
        )
        # Per offloaded group, whether this rank holds a layer of it: a pipeline stage
        # may hold none of a group's (vLLM keeps the group there with no layers). Its
        # keys are left out of this rank's jobs: nothing of theirs is here to copy.
        self._held_groups = [bool(pages) for pages in self.layer_pages]
        self._lacks_groups = not all(self._held_groups)
        plan = describe_memory(kv_caches, memory_path, None if units is None else units.layer_pages)
        log_choice(plan, rank)

        self._ledger = JobLedger(job_timeout_s)
        self._lock = self._ledger.lock  # also guards swapping the stream
        self.stats = self._ledger.stats  # figures for tests, benchmarks and the connector
        self._stream = client.transfer_stream()
        self._next_overdue_check = 0.0
        self._closed = False
        self._inline: InlineTransport | None = None
        if plan.path is MemoryPath.INLINE:
            self._start_inline()
        self._registrar = Registrar(
            client,
            plan,
            rank=rank,
            namespace_id=self._on_shard(namespace_id),
            make_layout=make_layout,
            layer_pages=self.layer_pages,
            on_registered=self._release_held,
            on_refused=self._fail_held,
            on_memory_changed=self._memory_changed,
            route=route,
            node_shards=node_shards,
            units=1 if units is None else units.count,
        )
        client.add_disconnect_listener(self._on_disconnect)
        self._registrar.start()

    def _on_shard(self, namespace_id: str) -> str:
        """The scheduler's namespace as this rank's part (its shard's, its pipeline
        stage's) names it."""
        route = self._route
        return namespace_id if route is None else route.namespace_id(namespace_id)

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
            finish=self._ledger.finish_local,
            on_dropped=self._count_dropped,
        )

    def _memory_changed(self, plan: MemoryPlan) -> None:
        if plan.path is MemoryPath.INLINE and self._inline is None:
            self._start_inline()

    def _release_held(self, namespace_id: str) -> None:
        """Registration thread: `namespace_id` is usable; submit its held jobs."""
        self.stats["registrations"] += 1
        registration = self._registrar.registration(namespace_id)
        inline = None if registration is None else self.memory.path is MemoryPath.INLINE
        for entry in self._ledger.release_held(namespace_id, inline):
            if registration is None:  # the session ended again meanwhile
                self._ledger.fail_local(entry.job, "the kvdepot daemon went away")
            else:
                self._send(entry, registration)

    def _fail_held(self, namespace_id: str, reason: str) -> None:
        for entry in self._ledger.release_held(namespace_id, None):
            self._ledger.fail_local(
                entry.job, f"the daemon refused namespace {namespace_id}: {reason}"
            )

    def _on_disconnect(self) -> None:
        for entry in self._ledger.take_all_held():
            self._ledger.fail_local(entry.job, "lost the kvdepot daemon before the job was sent")

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
        direction = Direction.LOAD if is_load else Direction.STORE
        if not isinstance(depot_spec, KVDepotLoadStoreSpec):
            self._ledger.fail_local(
                Job(job_id, direction, [], [], [], []),
                f"not a kvdepot spec: {type(depot_spec).__name__}",
            )
            return
        if not self._namespace_said:
            self._check_namespace(depot_spec.namespace_id)
        # Positional, in Job's field order: every job pays this, keywords cost more.
        job = Job(
            job_id,
            direction,
            depot_spec.keys,
            gpu_spec.block_ids.tolist(),  # block_ids
            [int(n) for n in gpu_spec.group_sizes],  # group_sizes
            [int(i) for i in gpu_spec.block_indices],  # block_indices
            expedited,
            0,  # registration_id: set when the job is sent
            self._on_shard(depot_spec.namespace_id),
            "",  # session_id: the stream's
            # What routers index, kept beside the rows: one rank's copy is enough.
            depot_spec.key_events
            if self._rank == 0 and type(depot_spec) is KVDepotStoreSpec
            else (),
        )
        if self._lacks_groups:
            job = held_groups_only(job, self._held_groups, self._bpc)
        if not job.keys:
            self._ledger.finish_local(job, JobResult(job_id, True))
            return
        if self._registrar.suspended:
            self._ledger.fail_local(
                job, "the kvdepot daemon stopped answering; waiting for it to respond again"
            )
            return
        refused = self._registrar.refused(job.namespace_id)
        if refused is not None:
            self._ledger.fail_local(job, f"the daemon refused this namespace: {refused}")
            return
        if not self._client.connected:
            self._ledger.fail_local(job, "the kvdepot daemon is unavailable")
            return
        entry = Submitted(job, time.monotonic())
        # Order a store after the forward that wrote its blocks (and a load after the
        # reads of the blocks it overwrites) now, on the model-runner's thread.
        self._record_cuda(entry)
        registration = self._ledger.hold_unless_registered(entry, self._registrar.registration)
        if registration is None:
            self._registrar.want(job.namespace_id)
            return
        with self._lock:
            self._ledger.claim(entry, self.memory.path is MemoryPath.INLINE)
        self._send(entry, registration)

    def _check_namespace(self, namespace_id: str) -> None:
        """Says so (once) when the scheduler's namespace is not the one this rank
        computed (nor one a connector reset moved it to): the rank registers where the
        jobs say, but with shards it picked its shard from its own id, and the
        scheduler may be watching others (docs/architecture.md §4)."""
        base = self._namespace_id
        if namespace_id == base or namespace_id.startswith(base + ".r"):
            return
        self._namespace_said = True
        log.error(
            "kvdepot: the scheduler's namespace %s is not the %s rank %d computed; the two "
            "read the model's configuration differently (a kvdepot bug: please report it "
            "with both ids). On a sharded daemon this rank's stores may never be seen",
            namespace_id,
            base,
            self._rank,
        )

    def _record_cuda(self, entry: Submitted) -> None:
        plan = self.memory
        if plan.cuda_export is not None:
            # The daemon's copy waits for everything enqueued so far on this stream.
            plan.cuda_export.record()
        elif self._kv_caches.tensors and self._kv_caches.tensors[0].tensor.is_cuda:
            entry.cuda_event = torch.cuda.Event()
            entry.cuda_event.record()

    def _send(self, entry: Submitted, registration: int) -> None:
        """Sends a claimed job to the daemon (or the inline thread)."""
        job = entry.job
        job.registration_id = registration
        if self.memory.path is MemoryPath.INLINE:
            assert self._inline is not None
            self._inline.submit(job, entry.cuda_event)
            return
        self._stream.submit(job)

    def _count_dropped(self, n: int) -> None:
        self.stats["dropped_keys"] += n

    # -- completion ---------------------------------------------------------------------------

    def take_failed_load_keys(self) -> set[bytes]:
        """Keys of loads that failed since the last call."""
        return self._ledger.take_failed_load_keys()

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        for job_result in self._stream.poll():
            result = self._ledger.settle(job_result)
            if result is not None:
                out.append(result)
        self._check_overdue()
        out.extend(self._ledger.take_local_results())
        return out

    def _check_overdue(self) -> None:
        """Async loads are never waited on: a daemon that stops answering would
        leave their requests waiting forever. Give up on them like wait() does."""
        now = time.monotonic()
        if now < self._next_overdue_check:
            return
        self._next_overdue_check = now + 0.25
        self._ledger.expire_held(now)
        overdue = self._ledger.overdue(now)
        if overdue:
            self._abandon(overdue)

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until every job in `job_ids` has finished (results stay for
        `get_finished`). Unknown or already collected ids are ignored."""
        ids = set(job_ids)
        self._ledger.wait_held(ids)
        self._ledger.expire_held(time.monotonic(), ids)
        deadline = time.monotonic() + self._job_timeout
        on_stream = self._ledger.on_stream(ids)
        if on_stream and not self._stream.wait(on_stream, timeout=self._job_timeout):
            self._abandon(on_stream)
        self._ledger.wait_local(ids, deadline)

    def _abandon(self, waited: set[int]) -> None:
        """The daemon did not answer in time: give up on every job on the stream,
        report them failed, and start a new stream."""
        with self._lock:
            stale = self._ledger.on_stream()
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
        self._ledger.abandon(stale)

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
