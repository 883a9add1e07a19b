"""The pool arena: one mapping of `--pool-size` bytes, a memfd or a named file.

The arena is pre-faulted in the background (MADV_POPULATE_WRITE in chunks, or a
write per page where the kernel lacks it) so the daemon serves at once while the
pool warms; `warmup_done_bytes` says how far it is. A named file (for example
/dev/shm/kvdepot.pool or a hugetlbfs path) outlives the daemon, which is what
makes a warm restart possible.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kvdepot.arena")

_MADV_POPULATE_WRITE = 23  # linux >= 5.14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def buffer_address(buf: mmap.mmap) -> int:
    """The virtual address of a writable mmap (keeps an export on it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class Arena:
    """A shared mapping the copy engines read and write by address."""

    def __init__(self, size: int, path: str | None = None) -> None:
        if size <= 0:
            raise ValueError("pool size must be positive")
        self.size = size
        self.path = path
        self.existed = False
        if path is None:
            fd = os.memfd_create("kvdepot-pool", os.MFD_CLOEXEC)
            self.backing = "memfd"
        else:
            p = Path(path)
            self.existed = p.exists() and p.stat().st_size == size
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.backing = path
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.address = buffer_address(self._mmap)
        self.warmup_done_bytes = 0
        self._warmup_thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def warmup_complete(self) -> bool:
        return self.warmup_done_bytes >= self.size

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._mmap)[offset : offset + nbytes]

    def start_warmup(
        self,
        chunk_bytes: int = 256 << 20,
        on_progress: Callable[[int, int], None] | None = None,
        after_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        """Pre-faults the arena in a background thread.

        `after_chunk(offset, nbytes)` runs after each chunk is faulted (the CUDA
        path page-locks it there); `on_progress(done, total)` reports progress.
        """

        def run() -> None:
            off = 0
            while off < self.size and not self._stop.is_set():
                n = min(chunk_bytes, self.size - off)
                self._populate(off, n)
                if after_chunk is not None:
                    after_chunk(off, n)
                off += n
                self.warmup_done_bytes = off
                if on_progress is not None:
                    on_progress(off, self.size)

        self._warmup_thread = threading.Thread(target=run, name="kvdepot-warmup", daemon=True)
        self._warmup_thread.start()

    def wait_warmup(self, timeout: float | None = None) -> bool:
        if self._warmup_thread is not None:
            self._warmup_thread.join(timeout)
        return self.warmup_complete

    def _populate(self, off: int, n: int) -> None:
        if _libc.madvise(self.address + off, n, _MADV_POPULATE_WRITE) == 0:
            return
        # Older kernels: touch one byte per page, preserving its value (a pool file
        # may hold blocks that a warm restart serves).
        page = mmap.PAGESIZE
        buf = self._mmap
        for p in range(off, off + n, page):
            buf[p] = buf[p]

    def flush(self) -> None:
        if self.path is not None:
            self._mmap.flush()

    def close(self) -> None:
        self._stop.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()
        # The exported address pins the mmap object; it is unmapped when the
        # process exits. Dropping the reference is all we can do here.
        self._mmap = None  # type: ignore[assignment]
