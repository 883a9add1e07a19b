"""Copy engines: execute a CopyPlan between registered memory and the pool arena.

One small interface, so that the CPU engine (shared-memory path) and the CUDA
engine (IPC path) share the planner and its tests. `copy` blocks until the bytes
have moved; the daemon calls it on worker threads, never on its event loop.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvdepot.server.core.arena import buffer_address
from kvdepot.server.core.planner import CopyPlan

STORE = 1  # registered memory -> pool (kvdepot.v1.Direction.STORE)
LOAD = 2  # pool -> registered memory (kvdepot.v1.Direction.LOAD)


class MappedRegion(ABC):
    """A client memory region mapped into the daemon.

    Owned by one registration: opened when it is registered, closed when the
    registration or its session ends (never while a copy uses it).
    """

    kind: str
    size: int
    address: int

    @abstractmethod
    def close(self) -> None:
        """Unmaps the region. Idempotent."""


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


class SharedMemoryRegion(MappedRegion):
    """A memfd (or file) the client passed over SCM_RIGHTS, mapped shared."""

    kind = "shm"

    def __init__(self, fd: int, size: int) -> None:
        st = os.fstat(fd)
        if size <= 0:
            raise ValueError("a shared-memory region needs a positive size")
        if st.st_size < size:
            raise ValueError(
                f"the passed file has {st.st_size} bytes, fewer than the {size} registered: "
                f"register the size of the memfd the KV tensors live in"
            )
        self._mmap: mmap.mmap | None = mmap.mmap(
            fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.size = size
        self.address = buffer_address(self._mmap)

    def close(self) -> None:
        # The exported address keeps the mmap alive until this object is
        # collected; dropping our reference lets the kernel unmap it then.
        self._mmap = None


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
