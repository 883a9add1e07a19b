"""Names shared by the daemon and its clients: transfer directions and memory
paths. Standard library only."""

from __future__ import annotations

import enum


class Direction(enum.IntEnum):
    """A transfer job's direction (the wire's kvdepot.v1.Direction values)."""

    STORE = 1  # registered memory -> pool
    LOAD = 2  # pool -> registered memory

    @property
    def label(self) -> str:
        """ "store" or "load" (metrics labels, log lines)."""
        return self.name.lower()


class MemoryPath(enum.StrEnum):
    """How a registration's bytes reach the pool (RegisterKVResponse.memory_path)."""

    SHM = "shm"  # a memfd the client passed over the fd socket, mapped by the daemon
    CUDA_IPC = "cuda_ipc"  # GPU memory opened with CUDA IPC, copied by DMA
    PVM = "pvm"  # another process's plain memory, copied with process_vm_readv/writev
    INLINE = "inline"  # no memory registered: bytes travel in Put/Get
