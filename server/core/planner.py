"""Copy planning: a job (keys + vLLM's GPULoadStoreSpec) becomes a list of byte runs.

The planner knows nothing of sockets, CUDA or mmap. A rank's registered memory is a
`MemoryMap` (kvdepot.server.core.memory_map), checked against its namespace layout
once; a job is checked against
both by `kvdepot.server.core.job_check.check_job`, and `plan_copy` turns the
checked job (its `JobShape`) and its slot offsets into
`(region, region_offset, pool_offset, nbytes)` runs, merging runs that are
contiguous on both sides. Every copy engine (CPU, CUDA, process memory) executes
the same plans.

A one-group job over vLLM's layout (every layer one pitch after the one before, on
the GPU and in the pool row) is planned per block, not per page: a plan of
`PageChains` (kvdepot.server.core.page_chains), one chain of a run per layer for each
block (or for a chunk's blocks that follow one another on both sides), built by one C
loop over the blocks (`_plan.chain_starts`). The CUDA engine turns the chains into its
2-D copies directly (`kvdepot.server.cuda.dma_plan`), the compiled CPU engine copies
them in one C call, and the bounds check reads their ends; the per-page runs are
planned only for an engine that asks for them (process memory, the CPU engine without
its extension), and are then the same runs as a per-page plan's.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvdepot.server.core.job_check import JobShape, check_job
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import MemoryMap
from kvdepot.server.core.page_chains import PageChains, equal_cuts

try:  # built from _plan.c when the install had a C compiler (pyproject.toml)
    import kvdepot.server.core._plan as compiled
except ImportError:
    compiled = None


class CopyPlan:
    """Runs of (region, region_offset, pool_offset, nbytes); direction-free.

    Held as four int64 columns (`columns`, shape (4, n)) when the planner built
    it, so that engines can turn it into addresses without a per-run Python
    loop; `runs` gives the same as a list of tuples (built on first use). A plan
    of `chains` (PageChains) builds its columns only when an engine asks for them:
    the CUDA engine plans its 2-D copies from the chains alone.
    """

    __slots__ = ("_build", "_cols", "_runs", "chains", "nbytes")

    def __init__(
        self, runs: Sequence[tuple[int, int, int, int]] | None = None, nbytes: int | None = None
    ) -> None:
        self._runs: list[tuple[int, int, int, int]] | None = list(runs or [])
        self._cols: np.ndarray | None = None
        self._build: Callable[[], CopyPlan] | None = None
        self.chains: PageChains | None = None
        self.nbytes = sum(r[3] for r in self._runs) if nbytes is None else nbytes

    @classmethod
    def from_pages(
        cls, region: np.ndarray, ro: np.ndarray, po: np.ndarray, n: np.ndarray
    ) -> CopyPlan:
        """A plan from per-page columns in copy order, merging pages that are
        contiguous on both sides (what `add` does one run at a time)."""
        plan = cls._empty()
        plan.nbytes = int(n.sum())
        if len(n) > 1:
            cont = (
                (region[1:] == region[:-1])
                & (ro[1:] == ro[:-1] + n[:-1])
                & (po[1:] == po[:-1] + n[:-1])
            )
            if cont.any():
                starts = np.flatnonzero(np.concatenate(([True], ~cont)))
                region, ro, po = region[starts], ro[starts], po[starts]
                n = np.add.reduceat(n, starts)
        plan._cols = np.stack((region, ro, po, n))
        return plan

    @property
    def columns(self) -> np.ndarray:
        """(4, n) int64, rows contiguous: region, region offset, pool offset, bytes of
        each run."""
        if self._cols is None:
            if self._build is not None:  # a plan of chains: its pages, planned now
                self._cols, self._build = self._build().columns, None
            else:
                runs = self._runs or []
                self._cols = np.array(runs, dtype=np.int64).reshape(len(runs), 4).T.copy()
        return self._cols

    @classmethod
    def _empty(cls) -> CopyPlan:
        plan = cls.__new__(cls)
        plan._runs, plan._cols, plan._build, plan.chains, plan.nbytes = None, None, None, None, 0
        return plan

    @classmethod
    def from_columns(cls, cols: np.ndarray, nbytes: int) -> CopyPlan:
        """A plan holding `cols` ((4, n) int64, rows contiguous) as its runs."""
        plan = cls._empty()
        plan._cols, plan.nbytes = cols, nbytes
        return plan

    @classmethod
    def from_chains(cls, chains: PageChains, build: Callable[[], CopyPlan]) -> CopyPlan:
        """A plan of `chains`, whose runs `build` plans when they are first asked for:
        a chain's run per layer, layer-major (`len(chains) * chains.rows` of them)."""
        plan = cls._empty()
        plan.chains, plan._build, plan.nbytes = chains, build, chains.nbytes
        return plan

    def addresses(
        self, region_addresses: Sequence[int], pool_address: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(memory address, pool address, bytes) of each run, as int64 columns:
        the offsets plus the base address of the run's region and of the pool."""
        mem, pool, sizes = self.address_columns(region_addresses, pool_address).view(np.int64)
        return mem, pool, sizes

    def address_columns(
        self, region_addresses: Sequence[int], pool_address: int, split: int = 0
    ) -> np.ndarray:
        """The runs as a (3, m) uint64 array: region address + offset, pool address
        + offset, bytes. With `split` > 0 a run whose pool bytes cross a multiple of
        `split` is cut there (m >= len(self)). Raises ValueError on a run that moves
        no bytes, has a negative offset, or names a region `region_addresses` lacks.

        uint64 because device and host addresses may use the top bit. Compiled
        (`_plan.c`) where it was built, so that the event loop keeps the GIL; the
        numpy path (`_address_columns_numpy`) computes the same.
        """
        if split < 0:
            raise ValueError("split must not be negative")
        cols, n = self.columns, len(self)
        if compiled is None:
            return _address_columns_numpy(cols, region_addresses, pool_address, split)
        # Each run is cut at most (bytes // split + 1) times.
        cap = 2 * n + (max(0, self.nbytes) // split if split else 0)
        out = np.empty((3, cap), dtype=np.uint64)
        m = compiled.address_runs(
            cols, array("Q", region_addresses), pool_address, split, out[0], out[1], out[2]
        )
        return out[:, :m]

    @property
    def runs(self) -> list[tuple[int, int, int, int]]:
        if self._runs is None:
            self._runs = list(zip(*self.columns.tolist(), strict=True))
        return self._runs

    def __len__(self) -> int:
        if self._cols is not None:
            return self._cols.shape[1]
        if self._runs is None and self.chains is not None:
            return len(self.chains) * self.chains.rows  # a run per chain and layer
        return len(self._runs or ())

    def add(self, region: int, region_off: int, pool_off: int, n: int) -> None:
        runs = self.runs
        self._cols, self.chains = None, None
        if runs:
            r, ro, po, pn = runs[-1]
            if r == region and ro + pn == region_off and po + pn == pool_off:
                runs[-1] = (r, ro, po, pn + n)
                self.nbytes += n
                return
        runs.append((region, region_off, pool_off, n))
        self.nbytes += n

    def split(self, parts: int, min_bytes: int) -> list[CopyPlan]:
        """This plan cut into at most `parts` plans of about equal bytes, each of
        at least `min_bytes` (so that copy threads can share a large job); runs
        (and a plan of chains' chains) are not cut, and the plans together hold
        every byte's copy once."""
        total = self.nbytes
        chains = self.chains if self._cols is None else None
        parts = min(parts, total // max(min_bytes, 1), len(chains or self))
        if parts <= 1:
            return [self]
        if chains is not None:  # cut between chains: each part stays a plan of chains
            return [
                CopyPlan.from_chains(c, functools.partial(_chain_runs, c))
                for c in chains.split(parts)
            ]
        cols = self.columns
        return [
            CopyPlan.from_columns(piece, int(piece[3].sum()))
            for piece in np.split(cols, equal_cuts(cols[3], parts), axis=1)
            if piece.shape[1]
        ]


def _chain_runs(chains: PageChains) -> CopyPlan:
    """A piece of a plan of chains, as runs (CopyPlan.split's parts build them so)."""
    return CopyPlan.from_columns(chains.run_columns(), chains.nbytes)


def _address_columns_numpy(
    cols: np.ndarray, region_addresses: Sequence[int], pool_address: int, split: int
) -> np.ndarray:
    """CopyPlan.address_columns without the compiled planner."""
    n = cols.shape[1]
    if n == 0:
        return np.empty((3, 0), dtype=np.uint64)
    regions, region_offs, pool_offs, sizes = cols
    low = cols.min(axis=1).tolist()  # one reduction for the four columns' minima
    if low[3] <= 0 or low[1] < 0 or low[2] < 0:
        i = int(np.flatnonzero((sizes <= 0) | (region_offs < 0) | (pool_offs < 0))[0])
        raise ValueError(f"bad run {tuple(cols[:, i].tolist())}")
    if low[0] < 0 or regions.max() >= len(region_addresses):
        i = int(np.flatnonzero((regions < 0) | (regions >= len(region_addresses)))[0])
        raise ValueError(f"run names region {int(regions[i])}; {len(region_addresses)} mapped")
    bases = np.array(region_addresses, dtype=np.uint64)
    dev = bases[regions] + region_offs.astype(np.uint64)
    host = np.uint64(pool_address) + pool_offs.astype(np.uint64)
    if split:
        return np.stack(_split_runs(dev, host, pool_offs, sizes, split))
    return np.stack((dev, host, sizes.astype(np.uint64)))


def _split_runs(
    dev: np.ndarray, host: np.ndarray, pool_offs: np.ndarray, sizes: np.ndarray, split: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cuts runs where their pool bytes cross a multiple of `split`."""
    into = pool_offs % split  # where each run starts inside its `split`-sized piece
    if (into + sizes <= split).all():  # the common case: no run crosses a boundary
        return dev, host, sizes.astype(np.uint64)
    first = split - into  # bytes before the run's first boundary
    pieces = np.where(sizes > first, 1 + (sizes - first + split - 1) // split, 1)
    run = np.repeat(np.arange(len(sizes)), pieces)
    k = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece in run
    start = np.where(k == 0, 0, first[run] + (k - 1) * split)
    size = np.minimum(sizes[run] - start, np.where(k == 0, first[run], split))
    step = start.astype(np.uint64)
    return dev[run] + step, host[run] + step, size.astype(np.uint64)


def stride_period(
    dev: np.ndarray,
    host: np.ndarray,
    size: np.ndarray,
    min_rows: int,
    base: int = 0,
    split: int = 0,
) -> int:
    """The strided shape of address columns, for 2-D copies: the smallest period p
    (dividing their length m, m // p >= min_rows) such that every entry k + p lies
    the same distances after entry k on the two sides (positive, and at least the
    entry's size) with the same size, and, with `split` > 0, each chain's host bytes
    lie in one `split`-sized piece of offsets from `base`. Entries k, k + p, k + 2p,
    ... are then one 2-D copy. 0 when no period fits (`_plan.c` says which layouts
    have one).
    """
    m = len(size)
    if compiled is not None:
        return compiled.stride_period(dev, host, size, m, min_rows, base, split)
    for p in range(1, m // max(min_rows, 2) + 1):
        if m % p:
            continue
        d, h = dev[p:] - dev[:-p], host[p:] - host[:-p]
        if not (
            (size[p:] == size[:-p]).all()
            and (d == d[0]).all()
            and (h == h[0]).all()
            and 0 < int(d[0]) < 1 << 63
            and 0 < int(h[0]) < 1 << 63
            and min(int(d[0]), int(h[0])) >= size[:-p].max()
        ):
            continue
        if split:
            first = host[:p] - np.uint64(base)
            last = first + np.uint64((m // p - 1) * int(h[0])) + size[:p] - np.uint64(1)
            if (first // np.uint64(split) != last // np.uint64(split)).any():
                continue
        return p
    return 0


@dataclass(slots=True)
class _GroupGeometry:
    """Per-layer constants of one group on one rank, as arrays (see `_geometry`)."""

    layout: NamespaceLayout
    region: np.ndarray  # (layers,) region index of each layer's tensor
    base: np.ndarray  # region offset of block 0's page of each layer
    stride: np.ndarray  # block stride of each layer's tensor
    page: np.ndarray  # page bytes of each layer
    slot_base: np.ndarray  # offset of each layer's page (sub-block 0) inside a slot
    # (region, base, stride, page, slot_base, region_pitch, pool_pitch) when every
    # layer is the one before it moved by one pitch on each side (`_chained`), else None
    chain: tuple[int, int, int, int, int, int, int] | None


def _geometry(layout: NamespaceLayout, rank: int, memory: MemoryMap, g: int) -> _GroupGeometry:
    """The layer constants of group `g`, computed once per (memory map, layout, rank)."""
    cache: dict[tuple[int, int, int], _GroupGeometry] = memory.__dict__.setdefault(
        "_plan_cache", {}
    )
    key = (id(layout), rank, g)
    geo = cache.get(key)
    if geo is not None and geo.layout is layout:
        return geo
    refs = memory.groups[g]
    tensors = [memory.tensors[r.tensor_index] for r in refs]
    geo = _GroupGeometry(
        layout,
        np.array([t.region_index for t in tensors], dtype=np.int64),
        np.array(
            [t.region_offset + r.page_offset for t, r in zip(tensors, refs, strict=True)],
            dtype=np.int64,
        ),
        np.array([t.block_stride for t in tensors], dtype=np.int64),
        np.array(layout.groups[g], dtype=np.int64),
        _slot_bases(layout, rank, g),
        None,
    )
    geo.chain = _chained(geo)
    cache[key] = geo
    return geo


def _chained(geo: _GroupGeometry) -> tuple[int, int, int, int, int, int, int] | None:
    """The group's pages as chains (PageChains), when its layers allow: at least two,
    in one region, of one page size and block stride, each layer one pitch after the
    one before on both sides, the pitches at least a page (vLLM's layout; checked
    once per memory map, layout and rank)."""
    region, base, stride = geo.region.tolist(), geo.base.tolist(), geo.stride.tolist()
    page, slot_base = geo.page.tolist(), geo.slot_base.tolist()
    if len(page) < 2:
        return None
    region_pitch, pool_pitch = base[1] - base[0], slot_base[1] - slot_base[0]
    same = all(
        region[i] == region[0]
        and stride[i] == stride[0]
        and page[i] == page[0]
        and base[i] == base[0] + i * region_pitch
        and slot_base[i] == slot_base[0] + i * pool_pitch
        for i in range(len(page))
    )
    if not same or min(region_pitch, pool_pitch) < page[0]:
        return None
    return (region[0], base[0], stride[0], page[0], slot_base[0], region_pitch, pool_pitch)


def _slot_bases(layout: NamespaceLayout, rank: int, g: int) -> np.ndarray:
    """layout.page_offset(g, rank, layer, 0) of every layer, in one pass (a call per
    layer sums the layers before it: quadratic, 19 ms for 1024 layers)."""
    pages = np.array(layout.groups[g], dtype=np.int64)
    before = np.cumsum(pages) - pages  # bytes of one block of the layers before each
    return rank * layout.section_bytes(g) + layout.blocks_per_chunk * before


def planning() -> str:
    """Which planner plan_copy and address_columns use, in words (the daemon logs it)."""
    if compiled is not None:
        return "compiled (kvdepot.server.core._plan: per-page loops that keep the GIL)"
    return (
        "numpy (kvdepot.server.core._plan was not built: reinstall kvdepot where a C "
        "compiler is available for cheaper jobs)"
    )


# One group's pages to plan: its geometry, block ids, slot offset per block (-1:
# skip the block) and sub-block per block (None when a chunk is one block).
_GroupPages = tuple[_GroupGeometry, np.ndarray, np.ndarray, np.ndarray | None]


def plan_copy(
    layout: NamespaceLayout,
    rank: int,
    memory: MemoryMap,
    shape: JobShape,
    slot_offsets: Sequence[int | None],
) -> CopyPlan:
    """Plans the copy of a checked job for one rank.

    `slot_offsets` holds the pool offset of each key's slot, in the job's key
    order (group-major, chunks ascending); None skips that key's pages (a store
    of a key that is already present, or dropped). Runs come out group by group,
    layer by layer, blocks in job order, merged where contiguous on both sides.
    """
    if len(slot_offsets) != shape.num_keys:
        raise ValueError(f"{len(slot_offsets)} slot offsets for {shape.num_keys} keys")
    # A list, not a generator, into numpy: a job's keys are few, and fromiter's
    # per-item generator cost the loop more than the list.
    slots_all = np.array([-1 if s is None else s for s in slot_offsets], dtype=np.int64)
    groups: list[_GroupPages] = []
    for g, ids, key_of, subs in shape.groups:
        if isinstance(key_of, range):  # one block per key: a slice, not a gather
            slots = slots_all[key_of.start : key_of.stop]
        else:
            slots = slots_all[np.asarray(key_of, dtype=np.int64)]
        groups.append(
            (
                _geometry(layout, rank, memory, g),
                np.asarray(ids, dtype=np.int64),
                slots,
                None if subs is None else np.asarray(subs, dtype=np.int64),
            )
        )
    if compiled is None:
        return _plan_pages_numpy(groups)
    if len(groups) == 1 and groups[0][0].chain is not None:
        plan = _plan_chains(groups[0])
        if plan is not None:
            return plan
    return _plan_pages(groups)


def _plan_chains(group: _GroupPages) -> CopyPlan | None:
    """A one-group job of a chained group as a plan of chains (C, per block); None
    when the per-page plan would merge a layer's last run with the next layer's first,
    or a chain's runs would overlap from one layer to the next (the caller then plans
    it page by page)."""
    geo, blocks, slots, sub = group
    assert geo.chain is not None
    region, base, stride, page, slot_base, region_pitch, pool_pitch = geo.chain
    region_starts = np.empty(len(blocks), np.int64)
    pool_starts = np.empty(len(blocks), np.int64)
    widths = np.empty(len(blocks), np.int64)
    found = compiled.chain_starts(
        blocks, slots, sub, region_starts, pool_starts, widths,
        base, stride, slot_base, page, region_pitch, pool_pitch,
    )  # fmt: skip
    if found is None:
        return None
    count, r_lo, r_end, p_lo, p_end, widest, layer_bytes = found
    if not count:
        return CopyPlan()
    if widest > min(region_pitch, pool_pitch):
        return None
    rows = len(geo.page)
    chains = PageChains(
        region,
        region_starts[:count],
        pool_starts[:count],
        widths[:count],
        rows,
        region_pitch,
        pool_pitch,
        r_lo,
        r_end + (rows - 1) * region_pitch,
        p_lo,
        p_end + (rows - 1) * pool_pitch,
        widest,
        layer_bytes * rows,
    )
    return CopyPlan.from_chains(chains, functools.partial(_plan_pages, [group]))


def _plan_pages(groups: Sequence[_GroupPages]) -> CopyPlan:
    """plan_copy's runs, page by page with the compiled planner."""
    # One C loop per group over the (layers, blocks) pages: numpy's dozen array
    # operations per job each released the GIL on the event loop (see _plan.c).
    table = np.empty((4, sum(len(geo.page) * len(b) for geo, b, _, _ in groups)), np.int64)
    count = nbytes = 0
    for geo, blocks, slots, sub in groups:
        count, added = compiled.plan_group(
            table,
            count,
            geo.region,
            geo.base,
            geo.stride,
            geo.page,
            geo.slot_base,
            blocks,
            slots,
            sub,
        )
        nbytes += added
    return CopyPlan.from_columns(table[:, :count], nbytes) if count else CopyPlan()


def _plan_pages_numpy(groups: Sequence[_GroupPages]) -> CopyPlan:
    """plan_copy's runs without the compiled planner: column-wise with numpy (a
    64-chunk Llama-8B job is 2048 pages, and a per-page Python loop on the event
    loop cost more than the PCIe copy)."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for geo, blocks, slots, sub in groups:
        keep = slots >= 0
        kept = np.count_nonzero(keep)
        if not kept:
            continue
        if kept < len(keep):
            blocks, slots = blocks[keep], slots[keep]
            sub = None if sub is None else sub[keep]
        n_blocks = len(blocks)
        # (layers, blocks) grids, flattened layer-major: the order of the runs.
        ro = geo.base[:, None] + blocks[None, :] * geo.stride[:, None]
        po = geo.slot_base[:, None] + slots[None, :]
        if sub is not None:
            po = po + sub[None, :] * geo.page[:, None]
        parts.append(
            (
                np.repeat(geo.region, n_blocks),
                ro.reshape(-1),
                po.reshape(-1),
                np.repeat(geo.page, n_blocks),
            )
        )
    if not parts:
        return CopyPlan()
    if len(parts) == 1:
        region, ro, po, n = parts[0]
    else:
        region, ro, po, n = (np.concatenate(c) for c in zip(*parts, strict=True))
    return CopyPlan.from_pages(region, ro, po, n)


def plan_job(
    layout: NamespaceLayout,
    rank: int,
    memory: MemoryMap,
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_offsets: Sequence[int | None],
) -> CopyPlan:
    """`check_job` then `plan_copy` in one call (tests and benchmarks; the daemon's
    job runner keeps the two apart so that it checks before it reserves slots).

    Every block id is validated against its tensor's block count, skipped or
    not; raises LayoutError with what to fix.
    """
    shape = check_job(
        layout, memory, block_ids, group_sizes, block_indices, num_keys=len(slot_offsets)
    )
    return plan_copy(layout, rank, memory, shape, slot_offsets)
