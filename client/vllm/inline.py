"""The inline transport: pages carried in Put/Get messages by one background thread.

Used when the daemon cannot reach the KV memory itself (no memfd, no CUDA IPC, no
ptrace access). Slow: protobuf copies every byte, one key per call. A job's
chunks are cut by the daemon's own arithmetic (kvdepot.common.chunks), so an
inline store and a shared-memory load of the same key agree byte for byte.

Contract: `submit(job, cuda_event)` never blocks; the job (kvdepot.common.jobs.Job,
the same description the daemon gets) ends in `finish(job, result)`, a JobResult,
called on the transport's thread. Expedited jobs go first. A CUDA job waits for
its `cuda_event` (recorded by the submitter after the work it depends on) before
touching the tensors.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.common.chunks import job_chunks
from kvdepot.common.jobs import Job, JobResult

log = logging.getLogger("kvdepot.vllm.worker")


class InlineTransport:
    """One rank's Put/Get thread."""

    def __init__(
        self,
        client: DepotClient,
        kv_caches: CanonicalKVCaches,
        *,
        rank: int,
        blocks_per_chunk: int,
        finish: Callable[[Job, JobResult], None],
        on_dropped: Callable[[int], None],
    ) -> None:
        self._client = client
        self._kv_caches = kv_caches
        self._rank = rank
        self._bpc = blocks_per_chunk
        self._finish = finish
        self._on_dropped = on_dropped
        # The groups this rank holds layers of, as its jobs and namespace number them (a
        # pipeline stage may hold no layer of a group: left out of both).
        self._refs = [refs for refs in kv_caches.group_data_refs if refs]
        self._pages = [[ref.page_size_bytes for ref in refs] for refs in self._refs]
        # (priority, sequence, job, the CUDA event to wait for): None ends the thread.
        self._queue: queue.PriorityQueue[tuple[int, int, Job | None, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(
            target=self._loop, name=f"kvdepot-inline-r{rank}", daemon=True
        )
        self._thread.start()

    @property
    def on_cuda(self) -> bool:
        tensors = self._kv_caches.tensors
        return bool(tensors) and tensors[0].tensor.is_cuda

    def submit(self, job: Job, cuda_event: torch.cuda.Event | None = None) -> None:
        self._queue.put((0 if job.expedited else 1, next(self._seq), job, cuda_event))

    def close(self) -> None:
        self._queue.put((-1, -1, None, None))

    def _loop(self) -> None:
        while True:
            _, _, job, cuda_event = self._queue.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                if cuda_event is not None:
                    cuda_event.synchronize()
                nbytes = self._load(job) if job.is_load else self._store(job)
            except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                self._finish(job, JobResult(job.job_id, False, error=str(detail)))
            except Exception as exc:  # never let the thread die: fail the job
                log.exception("kvdepot inline transfer failed")
                self._finish(job, JobResult(job.job_id, False, error=repr(exc)))
            else:
                seconds = time.perf_counter() - start
                self._finish(job, JobResult(job.job_id, True, bytes=nbytes, total_seconds=seconds))

    def _chunks(self, job: Job) -> Iterator[tuple[bytes, int, list[tuple[int, int]]]]:
        """(key, group, [(sub_block, block_id)]) per key, exactly as the daemon plans it."""
        return job_chunks(job.keys, job.block_ids, job.group_sizes, job.block_indices, self._bpc)

    def _page(self, g: int, layer: int, block_id: int) -> torch.Tensor:
        ref = self._refs[g][layer]
        return self._kv_caches.tensors[ref.tensor_idx].tensor[block_id, : ref.page_size_bytes]

    def _store(self, job: Job) -> int:
        nbytes = 0
        for key, g, subs in self._chunks(job):
            if len(subs) != self._bpc:
                self._on_dropped(1)  # a partial chunk cannot be a whole section
                continue
            parts = []
            for layer in range(len(self._pages[g])):
                for _, block_id in subs:
                    parts.append(self._page(g, layer, block_id).cpu().numpy().tobytes())
            data = b"".join(parts)
            resp = self._client.put(job.namespace_id, key, self._rank, data)
            if resp.outcome == "dropped":
                self._on_dropped(1)
            nbytes += len(data)
        return nbytes

    def _load(self, job: Job) -> int:
        nbytes = 0
        pages = self._pages
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
                    self._page(g, layer, block_id).copy_(section[start : start + page])
                    nbytes += page
                offset += self._bpc * page
        if self.on_cuda:
            torch.cuda.current_stream().synchronize()
        return nbytes
