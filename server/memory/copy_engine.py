"""Copy engines: execute a CopyPlan between registered memory and the pool arena.

One small interface, so that the CPU engine (shared-memory path), the CUDA
engine (IPC path) and the process-memory engine share the planner and its tests.
A copy is made in two steps: `prepare` runs on the daemon's event loop and does
the CPU work (checks, addresses, DMA descriptors); the callable it returns runs
on a copy thread and blocks until the bytes have moved. Keeping the Python work
on the loop leaves the copy threads almost nothing to take the GIL for: when a
copy thread had to plan too, the two threads traded the GIL back and forth for
every job, and that cost more than the planning itself.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from kvdepot.common.kinds import Direction
from kvdepot.server import errors
from kvdepot.server.core import planner
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.regions import MappedRegion
from kvdepot.server.memory.strided import copy_ops, run_ops

try:  # built from _runcopy.c when the install had a C compiler (pyproject.toml)
    from kvdepot.server.memory._runcopy import copy_chains, copy_runs
except ImportError:
    copy_runs = copy_chains = None

STORE = Direction.STORE  # registered memory -> pool (kvdepot.v1.Direction.STORE)
LOAD = Direction.LOAD  # pool -> registered memory (kvdepot.v1.Direction.LOAD)

__all__ = [
    "LOAD",
    "STORE",
    "CopyEngine",
    "CpuCopyEngine",
    "MappedRegion",
    "PreparedCopy",
    "check_runs",
    "no_copy",
]

# A copy ready to run: called once, on a copy thread; returns when the bytes have landed.
PreparedCopy = Callable[[], None]


def no_copy() -> None:
    """The prepared copy of a plan with no runs."""


def check_runs(regions: Sequence[MappedRegion], plan: CopyPlan, pool_size: int | None) -> None:
    """Defence in depth: every run lies inside its region and (with `pool_size`)
    inside the pool, so no copier is ever handed an address outside them, whatever
    the planner or a layout let through. Raises DepotError (INVALID_ARGUMENT: the
    job fails, nothing has moved).

    A plan of chains is bounded by its chains' ends (PageChains.inside). Else one
    loop over the plan's (4, n) columns in the compiled planner, which keeps the GIL
    (about a microsecond for 512 runs); numpy's reductions over as many runs each
    released it, and on the event loop every release handed the GIL to
    a copy thread (a job paid milliseconds of thread switches for them). Without
    the compiled planner: three numpy reductions, minima (no negative offset, no
    empty run, known regions), maxima (no value near 2**63, so the sums below
    cannot overflow), and the largest end on each side."""
    chains = plan.chains
    if chains is not None:  # a plan of chains: bounds per chain, no per-page columns
        if chains.inside([r.size for r in regions], pool_size):
            return
        raise errors.invalid(
            f"a copy chain names region {chains.region} of {len(regions)} or lies outside "
            f"it (bytes [{chains.region_low}, {chains.region_end})) or the pool (bytes "
            f"[{chains.pool_low}, {chains.pool_end}) of {pool_size}): the job is refused"
        )
    cols = plan.columns
    if not cols.shape[1]:
        return
    compiled = planner.compiled
    if compiled is not None:
        sizes = array("q", [r.size for r in regions])
        if compiled.run_bounds(cols, sizes, -1 if pool_size is None else pool_size):
            return
        raise errors.invalid(
            f"a copy run has a bad region, offset or size, or lies outside its region "
            f"({max((r.size for r in regions), default=0)} bytes at most) or the pool ({pool_size} "
            f"bytes): the job is refused"
        )
    low = cols.min(axis=1).tolist()
    high = cols.max(axis=1).tolist()
    if low[3] <= 0 or min(low[:3]) < 0 or high[0] >= len(regions) or max(high[1:]) >= _HUGE:
        raise errors.invalid("a copy run has a bad region, offset or size: the job is refused")
    region_end, pool_end = (cols[1:3] + cols[3]).max(axis=1).tolist()
    if len(regions) == 1:
        inside = region_end <= regions[0].size
    else:  # each run against its own region's size
        region_sizes = np.array([r.size for r in regions], dtype=np.int64)
        inside = bool((cols[1] + cols[3] <= region_sizes[cols[0]]).all())
    if inside and (pool_size is None or pool_end <= pool_size):
        return
    raise errors.invalid(
        f"a copy run lies outside its region ({max(r.size for r in regions)} bytes at most; "
        f"runs end at {region_end}) or the pool ({pool_size} bytes; runs end at "
        f"{pool_end}): the job is refused"
    )


_HUGE = 1 << 62  # no region or pool comes near; below it offset + size fits int64


class CopyEngine(ABC):
    """Moves the bytes of a plan. Thread-safe: several copies may run at once."""

    # Plans of at least this many bytes may be cut into parts copied on several
    # threads at once (0: never; the CUDA engine's DMA needs no threads for speed).
    parallel_min_bytes = 0

    def copy_device(self, regions: Sequence[MappedRegion]) -> tuple[str, str] | None:
        """Which device makes the copies of a registration over `regions`: None for an
        engine whose copies the CPUs make (they share the daemon's copy threads), else
        the device's key and PCI address ("" if unknown): its copies get threads of
        their own, on its NUMA node (kvdepot.server.copy_queue.CopyQueues). Asked once,
        when the registration is made."""
        return None

    @abstractmethod
    def prepare(
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> PreparedCopy:
        """Checks and plans the copy of every run of `plan`; returns the copy itself.

        Runs on the event loop: CPU work only, it never blocks and never touches
        the memory. Raises (ValueError, DepotError) on a plan or region it cannot
        copy; nothing has moved then: every engine first calls `check_runs`, so no
        run outside its region or the pool (`pool_size` bytes; None: unchecked,
        tests) reaches a copier. The caller keeps `regions` open until the
        returned callable has returned.

        The returned callable runs once, on a copy thread, and returns when the
        bytes have landed. STORE reads `regions[r].address + region_offset` and
        writes `pool_address + pool_offset`; LOAD the reverse. It raises on
        failure; a failed LOAD leaves the destination pages undefined (the caller
        reports the job failed, and vLLM recomputes them).
        """

    def copy(
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> None:
        """`prepare`, then the copy, both on the calling thread (tests, benchmarks)."""
        self.prepare(direction, regions, pool_address, plan, pool_size)()


def copier() -> str:
    """Which copier CpuCopyEngine uses, in words (the daemon logs it at start)."""
    if copy_runs is not None:
        return "compiled run copier (one call per copy, without the GIL)"
    return (
        "numpy progressions (kvdepot.server.memory._runcopy was not built: "
        "reinstall kvdepot where a C compiler is available for faster copies)"
    )


class CpuCopyEngine(CopyEngine):
    """Copies between two mappings of this process, with the GIL released.

    With the compiled run copier (`_runcopy.c`), a copy is one call that holds the
    GIL only to start and end; `prepare` computes the address columns and nothing
    else. Without it, memmove per run or one numpy copyto per progression of runs
    (kvdepot.server.memory.strided), which plans more on the loop and takes the GIL
    back between progressions. `compiled=False` picks that path (tests, benchmarks).

    Plans of at least `parallel_min_bytes` may be split by the caller across
    copy threads (CopyPlan.split): one thread's memmove does not reach the
    machine's copy bandwidth.
    """

    parallel_min_bytes = 4 << 20

    def __init__(self, compiled: bool = True) -> None:
        if compiled and copy_runs is None:
            compiled = False
        self.compiled = compiled

    def prepare(
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> PreparedCopy:
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        check_runs(regions, plan, pool_size)
        chains = plan.chains
        if self.compiled and chains is not None:
            # vLLM's layout: one call over the chains, no run table built.
            mem_base = regions[chains.region].address
            if direction == STORE:
                ends = (pool_address, mem_base, chains.pool_starts, chains.region_starts)
                pitches = (chains.pool_pitch, chains.region_pitch)
            else:
                ends = (mem_base, pool_address, chains.region_starts, chains.pool_starts)
                pitches = (chains.region_pitch, chains.pool_pitch)
            return functools.partial(copy_chains, *ends, chains.widths, chains.rows, *pitches)
        # Addresses column-wise (numpy), and any progressions' views, here: the copy
        # thread only runs the copy.
        mem, pool, sizes = plan.addresses([r.address for r in regions], pool_address)
        dst, src = (pool, mem) if direction == STORE else (mem, pool)
        if self.compiled:
            return functools.partial(copy_runs, dst, src, sizes)
        return functools.partial(run_ops, copy_ops(dst, src, sizes, pool))
