"""Shareable KV memory: memfd-backed buffers the daemon can map.

A CPU engine (and every test on a machine without a GPU) keeps its KV tensors in
a `SharedKVBuffer`; the worker passes the memfd to the daemon once and from then
on the daemon copies pages straight out of, and into, the same physical memory.

    buf = SharedKVBuffer.allocate(num_blocks * page_bytes)
    kv = buf.tensor().view(num_blocks, page_bytes)   # torch.uint8, shares the memfd

`SharedKVBuffer.containing(address)` finds the buffer that holds an address, so a
connector handed plain tensors can tell whether they live in shareable memory.

`SharedKVBuffer.adopt(address, size)` moves memory this process already has (a real
CPU engine's `torch.zeros` KV cache) into a memfd in place: same addresses, same
bytes, now backed by a file the daemon can map.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING

from kvdepot.common.libc import libc

if TYPE_CHECKING:
    import torch

_registry_lock = threading.Lock()
_registry: weakref.WeakValueDictionary[int, SharedKVBuffer] = weakref.WeakValueDictionary()


class SharedKVBuffer:
    """An anonymous shared-memory file, mapped read-write in this process.

    The buffer owns its fd and mapping; both are released by `close()` or when
    the object is collected. Tensors made by `tensor()` keep the mapping alive.
    """

    def __init__(
        self, fd: int, size: int, name: str = "kvdepot-kv", *, mapped_at: int | None = None
    ) -> None:
        self.fd = fd
        self.size = size
        self.name = name
        self._mmap: mmap.mmap | None = None
        if mapped_at is None:
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._anchor = ctypes.c_char.from_buffer(self._mmap)
            self.address = ctypes.addressof(self._anchor)
        else:
            # Adopted memory: the mapping belongs to whoever allocated it (see adopt).
            self.address = mapped_at
        with _registry_lock:
            _registry[self.address] = self

    @classmethod
    def allocate(cls, size: int, name: str = "kvdepot-kv") -> SharedKVBuffer:
        """A zero-filled memfd of `size` bytes (not inherited by child processes),
        populated here: its pages are charged to this process, and the daemon
        refuses a sparse memfd (it would be charged for pages it allocated)."""
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        # Sealable, and sealed against shrinking: the daemon maps this file and
        # refuses one that could shrink under it (its copies would fault).
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            return cls(fd, size, name)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, address: int, size: int, name: str = "kvdepot-kv") -> SharedKVBuffer:
        """Moves [address, address+size) of this process's anonymous private memory
        into a new memfd, in place, and returns the buffer over it.

        The pages around the range are rounded out to whole pages; every byte keeps its
        address and value, so tensors over the memory stay valid. It goes 64 MiB at a
        time (the memfd's copy of a piece, then that piece mapped over the original),
        so the process never holds more than one extra piece. The mapping stays owned
        by the allocator: freeing the memory unmaps it, and the daemon's own mapping
        keeps the pages until it lets go.

        Contract: nothing may write the range while it moves (a write between the copy
        and the remap would be lost): call it before the memory is used, as vLLM's
        `register_kv_caches` is. After it, a fork() shares these pages with the child
        instead of copying them. Raises AdoptError when the range is not anonymous
        private read-write memory, or the move fails (the memory keeps its bytes, and
        may then be partly in a memfd nobody else sees).
        """
        page = mmap.PAGESIZE
        start = address & ~(page - 1)
        end = (address + size + page - 1) & ~(page - 1)
        reason = _not_anonymous(start, end)
        if reason:
            raise AdoptError(reason)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, end - start)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            _move(fd, start, end - start)
        except OSError as exc:
            # Pieces moved already keep their bytes (now in the memfd): still valid memory.
            os.close(fd)
            raise AdoptError(f"cannot move the KV memory into a memfd: {exc}") from exc
        return cls(fd, end - start, name, mapped_at=start)

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
        if self._mmap is not None:
            return memoryview(self._mmap)
        return memoryview((ctypes.c_char * self.size).from_address(self.address)).cast("B")

    def tensor(self) -> torch.Tensor:
        """A 1-D torch.uint8 tensor over the whole buffer (shares memory)."""
        import torch

        return torch.frombuffer(self.memoryview(), dtype=torch.uint8, count=self.size)

    def close(self) -> None:
        """Closes the fd. The mapping lives on while tensors reference it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class AdoptError(Exception):
    """Memory that cannot be moved into a memfd; says why."""


_MOVE_STEP = 64 << 20
_ZERO_CHECK = 2 << 20
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


def _not_anonymous(start: int, end: int) -> str:
    """Why [start, end) is not wholly anonymous private read-write memory ("" if it is)."""
    at = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi <= at or lo > at:
                continue
            path = fields[5] if len(fields) > 5 else ""
            if fields[1] != "rw-p" or fields[4] != "0" or path:
                return (
                    f"the KV memory at {at:#x} is not anonymous private read-write memory "
                    f"({fields[1]} {path or 'anonymous'})"
                )
            at = hi
            if at >= end:
                return ""
    return f"the KV memory at {at:#x} is not mapped"


def _move(fd: int, start: int, length: int) -> None:
    """Moves [start, start+length) into the memfd piece by piece: the memfd's pages
    are allocated here (so they follow this process's NUMA policy, as the original
    pages did), the piece's non-zero parts are copied in, and the memfd's piece is
    mapped over the original, which frees its anonymous pages."""
    zeros = bytes(_ZERO_CHECK)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    for offset in range(0, length, _MOVE_STEP):
        n = min(_MOVE_STEP, length - offset)
        os.posix_fallocate(fd, offset, n)
        # A fresh KV cache is zeros, which the memfd holds already: copy only the rest.
        for part in range(offset, offset + n, _ZERO_CHECK):
            size = min(_ZERO_CHECK, offset + n - part)
            if libc.memcmp(start + part, zeros, size) != 0:
                view = memoryview((ctypes.c_char * size).from_address(start + part))
                done = 0
                while done < size:
                    done += os.pwrite(fd, view[done:], part + done)
        got = libc.mmap(start + offset, n, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
        if got in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap(MAP_FIXED) of the memfd failed: {os.strerror(err)}")
