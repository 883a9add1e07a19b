"""The engine side of the GPU benchmark: one rank's KV cache on a CUDA device.

`CudaEngine` holds torch CUDA KV tensors in vLLM's canonical layout (LAYERS
layers of PAGE-byte pages, BLOCK bytes a block, each layer its own region of
one allocation), registers them with a daemon over CUDA IPC and submits
Transfer jobs on one stream. `kvdepot.bench.gpu_bench` measures with it; the
GPU tests' engine process (tests/gpu/gpu_engine.py) drives it too.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from kvdepot.common.jobs import Job, JobResult
from kvdepot.v1 import depot_pb2 as pb

LAYERS = 32
PAGE = 64 << 10
BLOCK = LAYERS * PAGE  # 2 MiB


def make_key(tag: bytes, i: int) -> bytes:
    """A vLLM-style OffloadKey of group 0: 32 hash bytes + 4 zero bytes."""
    return hashlib.sha256(tag + i.to_bytes(8, "big")).digest() + b"\x00\x00\x00\x00"


class CudaEngine:
    """One rank's KV cache in vLLM's layout on a CUDA device, registered over CUDA IPC.

    `kv` is one allocation of `layers * num_blocks * page` bytes; layer L is the
    int8 view `(num_blocks, page)` at offset `L * num_blocks * page` (block stride =
    page), as vLLM 0.33's canonical tensors are views of one backing allocation.
    """

    def __init__(
        self,
        client: Any,
        num_blocks: int,
        *,
        layers: int = LAYERS,
        page: int = PAGE,
        namespace: str | None = None,
        device: Any = None,
        with_event: bool = True,
    ) -> None:
        import torch

        from kvdepot.client.cuda_ipc import export_kv_tensors, register_cuda_kv

        self.torch = torch
        self.client = client
        self.num_blocks, self.layers, self.page = num_blocks, layers, page
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        self.kv = torch.zeros(layers * num_blocks * page, dtype=torch.int8, device=self.device)
        self.tensors = [
            self.kv[i * num_blocks * page : (i + 1) * num_blocks * page].view(num_blocks, page)
            for i in range(layers)
        ]
        self.namespace = namespace or f"gpu-{os.getpid()}-{time.monotonic_ns()}"
        self.layout = pb.NamespaceLayout(
            id=self.namespace,
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[page] * layers)],
            description=f"kvdepot GPU bench: {layers} layers x {page} B pages",
        )
        self.groups = [
            pb.GroupRefs(
                layers=[
                    pb.LayerRef(tensor_index=i, page_offset=0, page_bytes=page)
                    for i in range(layers)
                ]
            )
        ]
        torch.cuda.synchronize(self.device)
        self.export = export_kv_tensors(self.tensors, with_event=with_event)
        self.registration = register_cuda_kv(client, self.layout, 0, self.export, self.groups)
        self.stream = client.transfer_stream()
        self._ids = itertools.count(1)

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page

    def fill_random(self, blocks: Sequence[int], seed: int) -> None:
        """Random bytes into every layer's page of `blocks` (on the current stream)."""
        torch = self.torch
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        idx = torch.tensor(list(blocks), device=self.device)
        for t in self.tensors:
            t[idx] = torch.randint(
                -128,
                128,
                (len(blocks), self.page),
                dtype=torch.int8,
                device=self.device,
                generator=g,
            )

    def zero(self, blocks: Sequence[int]) -> None:
        idx = self.torch.tensor(list(blocks), device=self.device)
        for t in self.tensors:
            t[idx] = 0

    def pages(self, blocks: Sequence[int]) -> Any:
        """A copy of (layers, len(blocks), page) bytes, for comparisons."""
        idx = self.torch.tensor(list(blocks), device=self.device)
        return self.torch.stack([t[idx] for t in self.tensors])

    def submit(self, direction: int, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """Records the IPC event on the current stream, then sends the job (never blocks)."""
        job_id = next(self._ids)
        self.export.record()
        self.stream.submit(
            Job(
                job_id=job_id,
                direction=direction,
                registration_id=self.registration.registration_id,
                keys=list(keys),
                block_ids=list(blocks),
                group_sizes=[len(blocks)],
                block_indices=[0],
            )
        )
        return job_id

    def run(
        self,
        direction: int,
        keys: Sequence[bytes],
        blocks: Sequence[int],
        job_chunks: int,
        timeout: float = 300.0,
    ) -> tuple[list[JobResult], float]:
        """Submits all jobs of `job_chunks` keys at once; waits for all; (results, seconds).

        Without an inter-process event, the device is synchronised first instead (the
        daemon then has nothing to wait on)."""
        if self.export.event is None:
            self.torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        ids = [
            self.submit(direction, keys[i : i + job_chunks], blocks[i : i + job_chunks])
            for i in range(0, len(keys), job_chunks)
        ]
        if not self.stream.wait(ids, timeout):
            raise TimeoutError(f"{len(ids)} jobs did not finish within {timeout} s")
        elapsed = time.perf_counter() - t0
        wanted = set(ids)
        return [r for r in self.stream.poll() if r.job_id in wanted], elapsed

    def close(self) -> None:
        self.stream.close()
