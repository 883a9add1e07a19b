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

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvdepot.server.core.page_chains import PageChains
from kvdepot.server.core.planner import CopyPlan, compiled, stride_period
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
    takes about a microsecond each to queue. A chain that crosses a multiple of
    `host_split` (a block's row straddling two page-locked pieces: most 16-block
    jobs have one) goes as descriptors beside the others' 2-D copies. Otherwise,
    and without `strided`, descriptor batches of at most `max_batch` copies, in the
    runs' order (one descriptor per run, cut at `host_split`).

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
    if strided and plan.chains is not None:
        found = _chain_copies(
            direction, plan.chains, region_addresses, pool_address, max_batch, host_split
        )
        if found is not None:
            return found
    dev, host, n = plan.address_columns(region_addresses, pool_address, host_split)
    srcs, dsts = (dev, host) if direction == STORE else (host, dev)
    if strided:
        strided_found = _strided(dsts, srcs, n, dev, host, pool_address, host_split, plan.nbytes)
        if strided_found is not None:
            copies, rest = strided_found
            if rest is None:
                return DmaPlan([], copies)
            left = n[rest]
            return DmaPlan(
                _batches(dsts[rest], srcs[rest], left, max_batch, plan.nbytes - copies.nbytes),
                copies,
            )
    return DmaPlan(_batches(dsts, srcs, n, max_batch, plan.nbytes))


def _chain_copies(
    direction: int,
    chains: PageChains,
    region_addresses: Sequence[int],
    pool_address: int,
    max_batch: int,
    host_split: int,
) -> DmaPlan | None:
    """A plan of chains (vLLM's layout, planned per block) as 2-D copies, one per
    chain, straight from the chains in one C call (`_plan.chain_dma`): no per-page
    columns, no period to search. A chain that crosses a multiple of `host_split`
    goes as its runs' descriptors (cut at the boundary), as in `_strided`. None when
    the chains make no 2-D copies the driver takes (too few rows, a pitch over
    MAX_PITCH): the caller plans per page."""
    c = chains
    if c.rows < MIN_STRIDED_ROWS or max(c.region_pitch, c.pool_pitch) > MAX_PITCH:
        return None  # (the planner made every pitch at least the widest run)
    if not 0 <= c.region < len(region_addresses):
        raise ValueError(f"run names region {c.region}; {len(region_addresses)} mapped")
    count = len(c)
    s_dev, s_host, s_width = (array("Q", bytes(8 * count)) for _ in range(3))
    call = functools.partial(
        compiled.chain_dma, c.region_starts, c.pool_starts, c.widths, s_dev, s_host, s_width
    )  # the rest: the descriptors' columns, then the shape and the addresses
    shape = (c.rows, c.region_pitch, c.pool_pitch)
    where = (region_addresses[c.region], pool_address, host_split)
    kept, cut = call(None, None, None, *shape, *where)  # counts the descriptors
    moved = c.nbytes
    if kept < count:  # some chains go as descriptors
        s_dev, s_host, s_width = s_dev[:kept], s_host[:kept], s_width[:kept]
        moved = sum(s_width) * c.rows
    rest: list[DmaBatch] = []
    if cut:  # some chains cross a boundary: their runs, cut there, as descriptors
        dev, host, n = (array("Q", bytes(8 * cut)) for _ in range(3))
        call(dev, host, n, *shape, *where)
        srcs, dsts = (dev, host) if direction == STORE else (host, dev)
        if cut <= max_batch:  # the usual case: one batch, the columns as they are
            rest = [DmaBatch(dsts, srcs, n, c.nbytes - moved)]
        else:
            d, s, m = (np.frombuffer(a, np.uint64) for a in (dsts, srcs, n))
            rest = _batches(d, s, m, max_batch, c.nbytes - moved)
    if not kept:
        return DmaPlan(rest)
    store = direction == STORE
    copies = StridedCopies(
        s_host if store else s_dev,
        s_dev if store else s_host,
        s_width,
        c.rows,
        c.pool_pitch if store else c.region_pitch,
        c.region_pitch if store else c.pool_pitch,
        moved,
    )
    return DmaPlan(rest, copies)


def _batches(
    dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, max_batch: int, nbytes: int
) -> list[DmaBatch]:
    """Descriptor batches of at most `max_batch` copies, in the columns' order;
    `nbytes` is what all of them move."""
    batches = []
    for i in range(0, len(sizes), max_batch):
        part = sizes[i : i + max_batch]
        batches.append(
            DmaBatch(
                _words(dsts[i : i + max_batch]),
                _words(srcs[i : i + max_batch]),
                _words(part),
                # One batch holds all the bytes: no sum, whose numpy reduction
                # would release the GIL on the event loop.
                nbytes if len(part) == len(sizes) else int(part.sum()),
            )
        )
    return batches


def _strided(
    dsts: np.ndarray,
    srcs: np.ndarray,
    sizes: np.ndarray,
    dev: np.ndarray,
    host: np.ndarray,
    pool_address: int,
    host_split: int,
    nbytes: int,
) -> tuple[StridedCopies, np.ndarray | None] | None:
    """The columns as strided copies, when they have a period whose pitches the
    driver takes; else None. With the copies, the entries left to descriptors (None:
    none): the chains that cross a page-locking boundary of the pool. A block's row
    that straddles one (most 16-block jobs have one) costs its own pages as
    descriptors, not the whole job's."""
    keep: slice | list[int] = slice(None, None)
    rest, moved = None, nbytes
    p = stride_period(dev, host, sizes, MIN_STRIDED_ROWS, pool_address, host_split)
    if p:
        rows = len(sizes) // p
        keep = slice(None, p)
    elif host_split:
        # Some chain crosses a boundary (or there is no period): the period regardless
        # of the boundaries, then which chains cross, in Python ints (a handful of
        # chains cost less than numpy's calls).
        p = stride_period(dev, host, sizes, MIN_STRIDED_ROWS)
        if not p:
            return None
        rows = len(sizes) // p
        span = (rows - 1) * int(host[p] - host[0]) - 1
        starts = [a - pool_address for a in host[:p].tolist()]
        widths = sizes[:p].tolist()
        cross = [
            k
            for k in range(p)
            if starts[k] // host_split != (starts[k] + span + widths[k]) // host_split
        ]
        if len(cross) == p:
            return None
        crossing = set(cross)
        keep = [k for k in range(p) if k not in crossing]
        # Entry k + r*p is chain k's row r: the crossing chains' rows, chain by chain.
        # One numpy broadcast, not a Python int per page (20 us an 80-layer job); the
        # row offsets cached, as np.arange releases the GIL on the event loop.
        rest = (np.array(cross, dtype=np.intp)[:, None] + _row_offsets(rows, p)).reshape(-1)
        moved = sum(widths[k] for k in keep) * rows
    else:
        return None
    dst_pitch, src_pitch = int(dsts[p] - dsts[0]), int(srcs[p] - srcs[0])
    if max(dst_pitch, src_pitch) > MAX_PITCH:
        return None
    copies = StridedCopies(
        _words(dsts[keep]),
        _words(srcs[keep]),
        _words(sizes[keep]),
        rows,
        dst_pitch,
        src_pitch,
        moved,
    )
    return copies, rest


@functools.lru_cache(maxsize=64)  # a node's few (layers, period) pairs
def _row_offsets(rows: int, p: int) -> np.ndarray:
    """[0, p, 2p, ...] of `rows` entries, read-only (shared by every job)."""
    offsets = np.array(range(0, rows * p, p), dtype=np.intp)
    offsets.flags.writeable = False
    return offsets


def _words(values: np.ndarray) -> array:
    """A uint64 column as array('Q') (what the driver binding takes), by one memcpy."""
    out = array("Q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.uint64).tobytes())
    return out
