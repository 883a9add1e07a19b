"""Shareable KV memory: memfd-backed buffers the daemon can map.

A CPU engine (and every test on a machine without a GPU) keeps its KV tensors in
a `SharedKVBuffer`; the worker passes the memfd to the daemon once and from then
on the daemon copies pages straight out of, and into, the same physical memory.

    buf = SharedKVBuffer.allocate(num_blocks * page_bytes)
    kv = buf.tensor().view(num_blocks, page_bytes)   # torch.uint8, shares the memfd

`SharedKVBuffer.containing(address)` finds the buffer that holds an address, so a
connector handed plain tensors can tell whether they live in shareable memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_registry_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[int, SharedKVBuffer] = weakref.WeakValueDictionary()


class SharedKVBuffer:
    """An anonymous shared-memory file, mapped read-write in this process.

    The buffer owns its fd and mapping; both are released by `close()` or when
    the object is collected. Tensors made by `tensor()` keep the mapping alive.
    """

    def __init__(self, fd: int, size: int, name: str = "kvdepot-kv") -> None:
        self.fd = fd
        self.size = size
        self.name = name
        self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        import ctypes

        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        with _registry_lock:
            _registry[self.address] = self

    @classmethod
    def allocate(cls, size: int, name: str = "kvdepot-kv") -> SharedKVBuffer:
        """A zero-filled memfd of `size` bytes (not inherited by child processes)."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        # Sealable, and sealed against shrinking: the daemon maps this file and
        # refuses one that could shrink under it (its copies would fault).
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            return cls(fd, size, name)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def containing(cls, address: int, nbytes: int = 1) -> tuple[SharedKVBuffer, int] | None:
        """The live buffer holding [address, address+nbytes), with the offset in it."""
        with _registry_lock:
            buffers = list(_registry.values())
        for buf in buffers:
            if buf.address <= address and address + nbytes <= buf.address + buf.size:
                return buf, address - buf.address
        return None

    def memoryview(self) -> memoryview:
        return memoryview(self._mmap)

    def tensor(self) -> torch.Tensor:
        """A 1-D torch.uint8 tensor over the whole buffer (shares memory)."""
        import torch

        return torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.size)

    def close(self) -> None:
        """Closes the fd. The mapping lives on while tensors reference it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
