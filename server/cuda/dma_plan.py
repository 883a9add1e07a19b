"""A CUDA job's DMA, planned: CopyPlan runs -> 2-D copies or descriptor batches.

Sans-I/O: `plan_dma` turns a plan's `(region, region_offset, pool_offset, nbytes)`
runs plus the regions' device addresses and the pool's host address into a job's
DMA: one 2-D copy per block where the pages form equal strided chains (vLLM's
layout), else descriptors (parallel `dst`/`src`/`size` arrays) cut into batches of
at most `max_batch` copies for `cuMemcpyBatchAsync`. Nothing spans a page-locking
chunk boundary of the pool (each chunk is its own `cuMemHostRegister` range, and
one DMA should not span two).

It calls no driver and needs no GPU (tests/cuda/test_cuda_descriptors.py runs it
on CPU). The CUDA copy engine (kvdepot.server.cuda.dma) calls it on the event loop
when it prepares a job, and its copy threads issue the result; a plan is owned by
the one job it was made for.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvdepot.server.core.planner import CopyPlan, stride_period
from kvdepot.server.memory.copy_engine import LOAD, STORE

DEFAULT_MAX_BATCH = 1024  # copies per cuMemcpyBatchAsync call


@dataclass(slots=True)
class DmaBatch:
    """Parallel arrays of one batched DMA call (typecode 'Q': 64-bit unsigned)."""

    dsts: array = field(default_factory=lambda: array("Q"))
    srcs: array = field(default_factory=lambda: array("Q"))
    sizes: array = field(default_factory=lambda: array("Q"))
    nbytes: int = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def descriptors(self) -> list[tuple[int, int, int]]:
        """(dst, src, size) triples, for tests and logs."""
        return list(zip(self.dsts, self.srcs, self.sizes, strict=True))


@dataclass(slots=True)
class StridedCopies:
    """2-D copies of one shape (cuMemcpy2DAsync): copy i moves `rows` rows of
    `widths[i]` bytes, row r from `srcs[i] + r * src_pitch` to `dsts[i] + r * dst_pitch`."""

    dsts: array
    srcs: array
    widths: array
    rows: int
    dst_pitch: int
    src_pitch: int
    nbytes: int

    def descriptors(self) -> list[tuple[int, int, int]]:
        """The rows as (dst, src, size) triples, for tests and the one-by-one fallback."""
        return [
            (d + r * self.dst_pitch, s + r * self.src_pitch, w)
            for d, s, w in zip(self.dsts, self.srcs, self.widths, strict=True)
            for r in range(self.rows)
        ]


@dataclass(slots=True)
class DmaPlan:
    """A job's DMA: descriptor batches, or one set of strided copies that covers it."""

    batches: list[DmaBatch]
    strided: StridedCopies | None = None


# A strided copy is one driver call; below this many rows its rows cost less as
# descriptors of a batch.
MIN_STRIDED_ROWS = 4
# cuMemcpy2DAsync refuses pitches over CU_DEVICE_ATTRIBUTE_MAX_PITCH (2^31 - 1 on
# current GPUs): a KV cache whose layers are more than 2 GiB apart goes as descriptors.
MAX_PITCH = (1 << 31) - 1


def plan_dma(
    direction: int,
    runs: CopyPlan | Sequence[tuple[int, int, int, int]],
    region_addresses: Sequence[int],
    pool_address: int,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    host_split: int = 0,
    strided: bool = True,
) -> DmaPlan:
    """Turns planner runs (a CopyPlan, or its `runs`) into a job's DMA.

    STORE copies `region_addresses[r] + region_offset` -> `pool_address + pool_offset`;
    LOAD the reverse. With `host_split` > 0 a run that crosses a multiple of
    `host_split` in pool offsets is cut there, and no copy spans such a boundary.
    Raises ValueError on a run that names no region or moves no bytes (the planner
    never makes one).

    With `strided`, a job whose pages form equal chains (vLLM's layout: layer l's
    page of block b at a constant layer stride on the GPU, and block b's pages one
    after another in its pool row) becomes one 2-D copy per chain: 16 driver calls
    for a 16-block job of 32 layers instead of 512 descriptors, which the driver
    takes about a microsecond each to queue. Otherwise, and without `strided`,
    descriptor batches of at most `max_batch` copies, in the runs' order (one
    descriptor per run, cut at `host_split`).

    Runs on the event loop for every job: `CopyPlan.address_columns` and
    `stride_period` do the per-run work in one call each.
    """
    if direction not in (STORE, LOAD):
        raise ValueError(f"unknown direction {direction}")
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    if host_split < 0:
        raise ValueError("host_split must not be negative")
    plan = runs if isinstance(runs, CopyPlan) else CopyPlan(runs)
    if not len(plan):
        return DmaPlan([])
    dev, host, n = plan.address_columns(region_addresses, pool_address, host_split)
    srcs, dsts = (dev, host) if direction == STORE else (host, dev)
    if strided:
        copies = _strided(dsts, srcs, n, dev, host, pool_address, host_split, plan.nbytes)
        if copies is not None:
            return DmaPlan([], copies)
    batches = []
    for i in range(0, len(n), max_batch):
        part = n[i : i + max_batch]
        batches.append(
            DmaBatch(
                _words(dsts[i : i + max_batch]),
                _words(srcs[i : i + max_batch]),
                _words(part),
                # One batch holds the plan's bytes (a cut keeps them): no sum, whose
                # numpy reduction would release the GIL on the event loop.
                plan.nbytes if len(part) == len(n) else int(part.sum()),
            )
        )
    return DmaPlan(batches)


def _strided(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    dev: np.ndarray,
    host: np.ndarray,
    pool_address: int,
    host_split: int,
    nbytes: int,
) -> StridedCopies | None:
    """The columns as strided copies, when they have a period whose chains each
    stay inside one page-locked piece of the pool and whose pitches the driver
    takes; else None."""
    p = stride_period(dev, host, sizes, MIN_STRIDED_ROWS, pool_address, host_split)
    if not p:
        return None
    dst_pitch, src_pitch = int(dsts[p] - dsts[0]), int(srcs[p] - srcs[0])
    if max(dst_pitch, src_pitch) > MAX_PITCH:
        return None
    return StridedCopies(
        _words(dsts[:p]),
        _words(srcs[:p]),
        _words(sizes[:p]),
        len(sizes) // p,
        dst_pitch,
        src_pitch,
        nbytes,
    )


def _words(values: np.ndarray) -> array:
    """A uint64 column as array('Q') (what the driver binding takes), by one memcpy."""
    out = array("Q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.uint64).tobytes())
    return out
