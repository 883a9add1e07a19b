"""Copy engines: execute a CopyPlan between registered memory and the pool arena.

One small interface, so that the CPU engine (shared-memory path), the CUDA
engine (IPC path) and the process-memory engine share the planner and its tests.
`copy` blocks until the bytes have moved; the daemon calls it on worker threads,
never on its event loop.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from kvdepot.common.kinds import Direction
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.regions import MappedRegion

STORE = Direction.STORE  # registered memory -> pool (kvdepot.v1.Direction.STORE)
LOAD = Direction.LOAD  # pool -> registered memory (kvdepot.v1.Direction.LOAD)

__all__ = ["LOAD", "STORE", "CopyEngine", "CpuCopyEngine", "MappedRegion"]


class CopyEngine(ABC):
    """Moves the bytes of a plan. Thread-safe: several copies may run at once."""

    # Plans of at least this many bytes may be cut into parts copied on several
    # threads at once (0: never; the CUDA engine's DMA needs no threads for speed).
    parallel_min_bytes = 0

    @abstractmethod
    def copy(
        self, direction: int, regions: Sequence[MappedRegion], pool_address: int, plan: CopyPlan
    ) -> None:
        """Copies every run of `plan` and returns when the bytes have landed.

        STORE reads `regions[r].address + region_offset` and writes
        `pool_address + pool_offset`; LOAD the reverse. Raises on failure; a
        failed LOAD leaves the destination pages undefined (the caller reports
        the job failed, and vLLM recomputes them).
        """


_memmove = ctypes.memmove


class CpuCopyEngine(CopyEngine):
    """memmove per run (ctypes releases the GIL, so copies use every core).

    Plans of at least `parallel_min_bytes` may be split by the caller across
    copy threads (CopyPlan.split): one thread's memmove does not reach the
    machine's copy bandwidth.
    """

    parallel_min_bytes = 4 << 20

    def copy(
        self, direction: int, regions: Sequence[MappedRegion], pool_address: int, plan: CopyPlan
    ) -> None:
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        region, region_off, pool_off, sizes = plan.columns
        if not len(sizes):
            return
        # Addresses column-wise (numpy), then one memmove per run.
        bases = np.array([r.address for r in regions], dtype=np.int64)
        mem = (bases[region] + region_off).tolist()
        pool = (pool_off + pool_address).tolist()
        dsts, srcs = (pool, mem) if direction == STORE else (mem, pool)
        for dst, src, n in zip(dsts, srcs, sizes.tolist(), strict=True):
            _memmove(dst, src, n)
