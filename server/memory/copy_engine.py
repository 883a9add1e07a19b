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

from kvdepot.common.kinds import Direction
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.regions import MappedRegion

STORE = Direction.STORE  # registered memory -> pool (kvdepot.v1.Direction.STORE)
LOAD = Direction.LOAD  # pool -> registered memory (kvdepot.v1.Direction.LOAD)

__all__ = ["LOAD", "STORE", "CopyEngine", "CpuCopyEngine", "MappedRegion"]


class CopyEngine(ABC):
    """Moves the bytes of a plan. Thread-safe: several copies may run at once."""

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
    """memmove per run (ctypes releases the GIL, so copies use every core)."""

    def copy(
        self, direction: int, regions: Sequence[MappedRegion], pool_address: int, plan: CopyPlan
    ) -> None:
        bases = [r.address for r in regions]
        if direction == STORE:
            for region, region_off, pool_off, n in plan.runs:
                _memmove(pool_address + pool_off, bases[region] + region_off, n)
        elif direction == LOAD:
            for region, region_off, pool_off, n in plan.runs:
                _memmove(bases[region] + region_off, pool_address + pool_off, n)
        else:
            raise ValueError(f"unknown direction {direction}")
