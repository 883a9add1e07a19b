"""Worker side: `KVDepotOffloadingWorker`, vLLM's OffloadingWorker backed by the daemon.

Contract with vLLM's worker (one per rank, called from the model-runner thread):
- `submit_store` / `submit_load` never block and always return True: a job that
  cannot run (daemon down, not registered yet) gets a failed result instead.
- `get_finished` returns every result that arrived, failures included
  (`success=False`); KVDepotConnector turns failed loads into load errors.
- `wait(job_ids)` blocks until those jobs are done (the daemon answers a job only
  after its copy finished), or until `kvdepot_job_timeout_s`, after which the jobs
  are abandoned and reported failed.
- Expedited loads are flagged so the daemon serves them before queued jobs.

Memory paths, chosen once at start (DESIGN §4):
- shm: the canonical KV tensors live in one memfd (`SharedKVBuffer`); it is passed
  to the daemon and the daemon copies pages itself.
- cuda_ipc: CUDA tensors are exported with `kvdepot.client.cuda_ipc` (one IPC
  handle per allocation, an inter-process event recorded before every job so the
  daemon's copy waits for the forward pass). Falls back to inline when the memory
  cannot be exported (expandable segments, sleep mode).
- inline: pages are carried in Put/Get messages by a background thread (slow; a
  warning says so). Used when the tensors are in ordinary memory.

Registrations die with the daemon: after every (re)connect a background thread
registers again, for every namespace this worker has been asked to use.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvdepot.client import DepotClient, DepotUnavailable, SharedKVBuffer
from kvdepot.client.fdpass import FdPassError
from kvdepot.client.vllm.transfer_specs import KVDepotLoadStoreSpec
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.worker")

# Registration errors that retrying cannot fix (the layout or memory is wrong).
_PERMANENT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
}

@dataclass
class MemoryPlan:
    """How this rank's KV memory is described to the daemon."""

    path: str  # "shm", "cuda_ipc" or "inline"
    reason: str
    shm: SharedKVBuffer | None = None
    # The CUDA IPC export (kvdepot.client.cuda_ipc.CudaKVExport), kept alive while
    # registered: it owns the inter-process event.
    cuda_export: Any = None
    regions: list[depot_pb2.MemoryRegion] = field(default_factory=list)
    tensors: list[depot_pb2.KVTensor] = field(default_factory=list)
    groups: list[depot_pb2.GroupRefs] = field(default_factory=list)


def _span(t: torch.Tensor) -> int:
    """Bytes from the first to the end of the last page of a (blocks, page) view."""
    elem = t.element_size()
    return ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * elem


def describe_memory(kv_caches: CanonicalKVCaches, memory_path: str) -> MemoryPlan:
    """Finds the cheapest path the daemon can reach these tensors by.

    shm needs every tensor inside ONE live SharedKVBuffer (a memfd this process
    made); vLLM 0.33 gives views of a single backing allocation, so that holds
    whenever the KV allocation itself came from a SharedKVBuffer.
    """
    tensors = [t.tensor for t in kv_caches.tensors]
    groups = [
        depot_pb2.GroupRefs(
            layers=[
                depot_pb2.LayerRef(
                    tensor_index=ref.tensor_idx, page_offset=0, page_bytes=ref.page_size_bytes
                )
                for ref in refs
            ]
        )
        for refs in kv_caches.group_data_refs
    ]
    if memory_path == "inline":
        return MemoryPlan("inline", "kvdepot_memory_path is 'inline'")
    if not tensors:
        return MemoryPlan("inline", "no KV tensors to register")

    if all(t.is_cuda for t in tensors):
        try:
            from kvdepot.client.cuda_ipc import export_kv_tensors

            export = export_kv_tensors(tensors)
        except Exception as exc:  # UnexportableMemory, no driver, ...: still serve
            return MemoryPlan("inline", f"the CUDA KV memory cannot be exported: {exc}")
        return MemoryPlan(
            "cuda_ipc", "CUDA IPC", cuda_export=export, regions=list(export.regions),
            tensors=list(export.tensors), groups=groups,
        )

    if any(t.device.type != "cpu" for t in tensors):
        return MemoryPlan("inline", "the KV tensors are on a device kvdepot cannot map")

    buffer: SharedKVBuffer | None = None
    kv = []
    for t in tensors:
        found = SharedKVBuffer.containing(t.data_ptr(), _span(t))
        if found is None:
            return MemoryPlan(
                "inline",
                "the KV tensors are not in a memfd (allocate them with "
                "kvdepot.client.shm.SharedKVBuffer to use the shm path)",
            )
        buf, offset = found
        if buffer is None:
            buffer = buf
        elif buf is not buffer:
            return MemoryPlan("inline", "the KV tensors span several memfds; one is supported")
        kv.append(
            depot_pb2.KVTensor(
                region_index=0, region_offset=offset, num_blocks=t.shape[0],
                block_stride_bytes=t.stride(0) * t.element_size(),
                page_bytes=t.shape[1] * t.element_size(),
            )
        )
    return MemoryPlan("shm", "memfd-backed KV tensors", shm=buffer, tensors=kv, groups=groups)


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
        self._make_layout = make_layout
        self.layer_pages = [
            [ref.page_size_bytes for ref in refs] for refs in kv_caches.group_data_refs
        ]
        self.memory = describe_memory(kv_caches, memory_path)
        if self.memory.path == "inline":
            level = {"inline": logging.INFO, "shm": logging.ERROR}.get(memory_path, logging.WARNING)
            log.log(
                level,
                "kvdepot: rank %d moves KV pages inline through gRPC (slow): %s",
                rank, self.memory.reason,
            )
        else:
            log.info("kvdepot: rank %d uses the %s memory path", rank, self.memory.path)

        self._lock = threading.Condition()
        self._stream = client.transfer_stream()
        # namespace id -> registration id, valid for the current session only.
        self._registrations: dict[str, int] = {}
        self._wanted: list[str] = [namespace_id]
        self._refused: dict[str, str] = {}
        self._register_now = threading.Event()
        # Set when jobs were abandoned (the daemon stopped answering): new jobs
        # fail at once until a probe gets an answer, so no step waits again.
        self._suspended = False
        self._next_overdue_check = 0.0
        self._closed = threading.Event()
        self._jobs: dict[int, _Job] = {}
        self._on_stream: set[int] = set()
        self._local_results: list[TransferResult] = []
        self._local_pending: set[int] = set()
        self._inline_queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()
        # Figures for tests, benchmarks and the connector.
        self.failed_load_keys: set[bytes] = set()
        self.stats = {"stores": 0, "loads": 0, "failed_stores": 0, "failed_loads": 0,
                      "dropped_keys": 0, "registrations": 0, "abandoned": 0}
        self._registrar = threading.Thread(
            target=self._register_loop, name=f"kvdepot-register-r{rank}", daemon=True
        )
        self._registrar.start()
        if self.memory.path == "inline":
            self._inline_thread = threading.Thread(
                target=self._inline_loop, name=f"kvdepot-inline-r{rank}", daemon=True
            )
            self._inline_thread.start()
        client.add_disconnect_listener(self._on_disconnect)
        client.add_session_listener(self._on_session)

    # -- registration (background) ---------------------------------------------------------

    @property
    def registered(self) -> bool:
        """Whether the current namespace is registered in the current session."""
        with self._lock:
            return self._wanted[-1] in self._registrations

    def wait_registered(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.registered:
                return True
            time.sleep(0.01)
        return self.registered

    def _on_session(self, boot_id: str) -> None:
        with self._lock:
            self._registrations = {}
            self._refused = {}
        self._register_now.set()

    def _on_disconnect(self) -> None:
        with self._lock:
            self._registrations = {}

    def _want(self, namespace_id: str) -> None:
        with self._lock:
            if namespace_id not in self._wanted:
                self._wanted.append(namespace_id)
                # Keep the base namespace and the few most recent ones.
                del self._wanted[1:-4]
        self._register_now.set()

    def _register_loop(self) -> None:
        while not self._closed.is_set():
            self._register_now.wait(0.5 if self._suspended else 1.0)
            self._register_now.clear()
            if self._closed.is_set():
                return
            if not self._client.connected:
                continue
            if self._suspended:
                self._probe()
                continue
            with self._lock:
                todo = [
                    ns for ns in self._wanted
                    if ns not in self._registrations and ns not in self._refused
                ]
            for ns in todo:
                if not self._register(ns):
                    break

    def _register(self, namespace_id: str) -> bool:
        """Registers one namespace; False when the daemon went away meanwhile."""
        try:
            session = self._client.session_id
            layout = self._make_layout(namespace_id, self.layer_pages)
            if self.memory.path == "cuda_ipc":
                from kvdepot.client.cuda_ipc import register_cuda_kv

                resp = register_cuda_kv(
                    self._client, layout, self._rank, self.memory.cuda_export,
                    self.memory.groups, timeout=10.0,
                )
            else:
                resp = self._client.register_kv(
                    layout,
                    rank=self._rank,
                    shm=self.memory.shm,
                    tensors=self.memory.tensors,
                    groups=self.memory.groups if self.memory.tensors else [],
                    timeout=10.0,
                )
        except DepotUnavailable as exc:
            log.debug("kvdepot registration postponed: %s", exc)
            return False
        except FdPassError as exc:
            log.warning("kvdepot: passing the KV memfd failed (%s); retrying", exc)
            self._retry_later()
            return False
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code in _PERMANENT:
                with self._lock:
                    self._refused[namespace_id] = f"{code}: {details}"
                log.error(
                    "kvdepot refused rank %d's registration in namespace %s (%s: %s); this "
                    "rank offloads nothing until the daemon restarts",
                    self._rank, namespace_id, code, details,
                )
                return True
            log.warning("kvdepot registration failed (%s: %s); retrying", code, details)
            self._retry_later()
            return False
        with self._lock:
            current = self._client.hello.session_id if self._client.hello else None
            if current != session or not self._client.connected:
                self._register_now.set()  # a new session began meanwhile: redo
                return False
            self._registrations[namespace_id] = resp.registration_id
            self.stats["registrations"] += 1
        log.info(
            "kvdepot: rank %d registered in namespace %s (registration %d, %s)",
            self._rank, namespace_id, resp.registration_id, resp.memory_path or self.memory.path,
        )
        return True

    def _probe(self) -> None:
        """Lifts the suspension once the daemon answers a cheap call again."""
        try:
            self._client.lookup(self._wanted[0], [], timeout=1.0)
        except DepotUnavailable:
            return
        except grpc.RpcError as exc:
            # Any answer (NOT_FOUND for a namespace it does not know, say) proves
            # the daemon is serving again; silence or a broken channel does not.
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                              grpc.StatusCode.CANCELLED):
                return
        self._suspended = False
        log.warning("kvdepot daemon answers again; rank %d resumes transfers", self._rank)

    def _retry_later(self, delay: float = 0.5) -> None:
        timer = threading.Timer(delay, self._register_now.set)
        timer.daemon = True
        timer.start()

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
            self._finish_local(job_id, is_load, [], False,
                               f"not a kvdepot spec: {type(depot_spec).__name__}")
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
            self._finish_local(job_id, is_load, [], True, "")
            return
        with self._lock:
            registration = self._registrations.get(job.namespace_id)
        if self._suspended:
            self._finish_local(
                job_id, is_load, job.keys, False,
                "the kvdepot daemon stopped answering; waiting for it to respond again",
            )
            return
        if registration is None:
            self._want(job.namespace_id)
            self._finish_local(
                job_id, is_load, job.keys, False,
                "not registered with the kvdepot daemon (unavailable, or registering)",
            )
            return
        with self._lock:
            self._jobs[job_id] = job
        if self.memory.path == "inline":
            if self._kv_caches.tensors and self._kv_caches.tensors[0].tensor.is_cuda:
                # Read (store) only after the forward that wrote the blocks.
                job.cuda_event = torch.cuda.Event()
                job.cuda_event.record()
            with self._lock:
                self._local_pending.add(job_id)
            self._inline_queue.put((0 if expedited else 1, next(self._seq), job))
            return
        with self._lock:
            self._on_stream.add(job_id)
        if self.memory.cuda_export is not None:
            # The daemon's copy waits for everything enqueued so far on this stream
            # (the forward pass that wrote a store's blocks, reads of a load's).
            self.memory.cuda_export.record()
        self._stream.submit(
            depot_pb2.TransferJob(
                job_id=job_id,
                direction=depot_pb2.LOAD if is_load else depot_pb2.STORE,
                registration_id=registration,
                keys=job.keys,
                block_ids=job.block_ids,
                group_sizes=job.group_sizes,
                block_indices=job.block_indices,
                expedited=expedited,
            )
        )

    def _finish_local(
        self, job_id: int, is_load: bool, keys: list[bytes], success: bool, error: str,
        nbytes: int = 0, seconds: float = 0.0,
    ) -> None:
        if not success:
            self._count_failure(is_load, keys, error)
        elif keys:
            self.stats["loads" if is_load else "stores"] += 1
        with self._lock:
            self._jobs.pop(job_id, None)
            self._local_pending.discard(job_id)
            self._local_results.append(
                TransferResult(job_id=job_id, success=success,
                               transfer_size=nbytes if success else None,
                               transfer_time=seconds if success else None)
            )
            self._lock.notify_all()

    def _count_failure(self, is_load: bool, keys: list[bytes], error: str) -> None:
        if is_load:
            with self._lock:
                self.stats["failed_loads"] += 1
                self.failed_load_keys.update(keys)
            log.warning("kvdepot load of %d keys failed (%s); vLLM recomputes them",
                        len(keys), error)
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
                out.append(TransferResult(
                    job_id=r.job_id, success=True, transfer_size=int(r.bytes),
                    transfer_time=float(r.copy_seconds or r.total_seconds),
                ))
            else:
                self._count_failure(
                    job.is_load, job.keys, f"{r.error_code or 'FAILED'}: {r.error}"
                )
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
        with self._lock:
            overdue = {
                j for j in self._on_stream
                if (job := self._jobs.get(j)) is not None
                and now - job.submitted > self._job_timeout
            }
        if overdue:
            self._abandon(overdue)

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until every job in `job_ids` has finished (results stay for
        `get_finished`). Unknown or already collected ids are ignored."""
        deadline = time.monotonic() + self._job_timeout
        with self._lock:
            on_stream = set(job_ids) & self._on_stream
        if on_stream and not self._stream.wait(on_stream, timeout=self._job_timeout):
            self._abandon(on_stream)
        with self._lock:
            while set(job_ids) & self._local_pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)

    def _abandon(self, waited: set[int]) -> None:
        """The daemon did not answer in time: give up on every job on the stream,
        report them failed, and start a new stream."""
        with self._lock:
            stale = set(self._on_stream)
            old, self._stream = self._stream, self._client.transfer_stream()
            self._suspended = True
        log.error(
            "kvdepot: %d transfer job(s) got no answer within %.1fs; abandoning %d job(s) "
            "in flight, reopening the Transfer stream, and failing new jobs until the daemon "
            "answers again", len(waited), self._job_timeout, len(stale),
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
                self._finish_local(job_id, job.is_load, job.keys, False, "no answer in time")

    # -- the inline path -----------------------------------------------------------------------

    def _inline_loop(self) -> None:
        while True:
            _, _, job = self._inline_queue.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                if job.cuda_event is not None:
                    job.cuda_event.synchronize()
                nbytes = self._inline_load(job) if job.is_load else self._inline_store(job)
            except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self._finish_local(job.job_id, job.is_load, job.keys, False, str(detail))
            except Exception as exc:  # never let the thread die: fail the job
                log.exception("kvdepot inline transfer failed")
                self._finish_local(job.job_id, job.is_load, job.keys, False, repr(exc))
            else:
                self._finish_local(job.job_id, job.is_load, job.keys, True, "", nbytes,
                                   time.perf_counter() - start)

    def _chunks(self, job: _Job):
        """(key, group, [(sub_block, block_id)]) per key, exactly as the daemon plans it."""
        bpc = self._bpc
        pos = key_pos = 0
        for g, n in enumerate(job.group_sizes):
            ids = job.block_ids[pos : pos + n]
            pos += n
            if n == 0:
                continue
            skip = job.block_indices[g] % bpc
            per_chunk: dict[int, list[tuple[int, int]]] = {}
            for i, block_id in enumerate(ids):
                c, j = divmod(skip + i, bpc)
                per_chunk.setdefault(c, []).append((j, block_id))
            for c in sorted(per_chunk):
                yield job.keys[key_pos + c], g, per_chunk[c]
            key_pos += len(per_chunk)

    def _page(self, g: int, layer: int, block_id: int) -> torch.Tensor:
        ref = self._kv_caches.group_data_refs[g][layer]
        return self._kv_caches.tensors[ref.tensor_idx].tensor[block_id, : ref.page_size_bytes]

    def _inline_store(self, job: _Job) -> int:
        nbytes = 0
        for key, g, subs in self._chunks(job):
            if len(subs) != self._bpc:
                self.stats["dropped_keys"] += 1  # a partial chunk cannot be a whole section
                continue
            parts = []
            for layer in range(len(self.layer_pages[g])):
                for _, block_id in subs:
                    parts.append(self._page(g, layer, block_id).cpu().numpy().tobytes())
            data = b"".join(parts)
            resp = self._client.put(job.namespace_id, key, self._rank, data)
            if resp.outcome == "dropped":
                self.stats["dropped_keys"] += 1
            nbytes += len(data)
        return nbytes

    def _inline_load(self, job: _Job) -> int:
        nbytes = 0
        pages = self.layer_pages
        for key, g, subs in self._chunks(job):
            data = self._client.get(job.namespace_id, key, self._rank)
            expected = self._bpc * sum(pages[g])
            if len(data) != expected:
                raise ValueError(f"section of {len(data)} bytes, expected {expected}")
            section = torch.frombuffer(bytearray(data), dtype=torch.int8)
            offset = 0
            for layer, page in enumerate(pages[g]):
                for j, block_id in subs:
                    start = offset + j * page
                    dst = self._page(g, layer, block_id)
                    dst.copy_(section[start : start + page])
                    nbytes += page
                offset += self._bpc * page
        if self._kv_caches.tensors and self._kv_caches.tensors[0].tensor.is_cuda:
            torch.cuda.current_stream().synchronize()
        return nbytes

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._register_now.set()
        if self.memory.path == "inline":
            self._inline_queue.put((-1, -1, None))
        self._stream.close()
        # Ending the session makes the daemon unmap our memory and drop everything.
        self._client.close()
