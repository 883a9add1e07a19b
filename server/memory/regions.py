"""Client memory mapped into the daemon: the region interface and shared memory.

A region is owned by one registration: opened when it is registered, closed when
the registration or its session ends, never while a copy uses it (the state
counts copies in flight per registration), so closing may unmap at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import stat
import threading
from abc import ABC, abstractmethod

from kvdepot.common.kinds import MemoryPath
from kvdepot.common.libc import MADV_POPULATE_WRITE, libc

log = logging.getLogger("kvdepot.memory")

_POPULATE_STEP = 16 << 20


def buffer_address(buf: mmap.mmap) -> int:
    """The virtual address of a writable mmap.

    The temporary ctypes object takes a buffer export only while it lives, so
    none is left behind: `buf.close()` still unmaps at once, after which the
    address must not be used. Owners close the mmap only when no copy runs.
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def seal_against_shrinking(fd: int) -> None:
    """Makes sure the client cannot shrink the file while the daemon maps it.

    A copy that touches a page past the end of a shrunk file gets SIGBUS, which
    kills the whole daemon, so a file that cannot be sealed is refused (ValueError).
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_SHRINK:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        raise ValueError(
            f"the file cannot be sealed against shrinking ({exc.strerror}): pass a memfd "
            f"created with MFD_ALLOW_SEALING (kvdepot.client.SharedKVBuffer does), so that "
            f"truncating it cannot crash the daemon"
        ) from None


def check_passed_file(fd: int) -> None:
    """The daemon maps only memory the client could read and write itself: a
    regular file (a memfd is one; never a device) opened O_RDWR. ValueError."""
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise ValueError(
            "the passed fd is not open for reading and writing (O_RDWR): the daemon maps "
            "only memory its client may write itself"
        )
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ValueError(
            "the passed fd is not a memfd or regular file (a device, socket or pipe): pass "
            "the memfd the KV tensors live in"
        )


def check_populated(fd: int, size: int) -> None:
    """A memfd's pages are charged to whoever first touches them: one the client
    never populated would be allocated by the daemon's copies, in the daemon's
    memory (cgroup). Refused (ValueError) unless the first `size` bytes are allocated."""
    blocks = os.fstat(fd).st_blocks * 512
    if blocks < size:
        raise ValueError(
            f"the memfd is sparse ({blocks} of {size} bytes allocated): populate it first "
            f"(posix_fallocate; kvdepot.client.SharedKVBuffer does), so that its memory is "
            f"charged to its owner, not to the daemon"
        )


class MappedRegion(ABC):
    """A client memory region reachable by the daemon's copy engines.

    Owned by one registration: opened when it is registered, closed when the
    registration or its session ends (never while a copy uses it).
    """

    kind: MemoryPath | str
    size: int
    address: int

    @abstractmethod
    def close(self) -> None:
        """Releases the region (unmaps it). Idempotent."""

    @property
    def populating_bytes(self) -> int:
        """Bytes of the region the daemon is still preparing for copies (0: ready)."""
        return 0


class SharedMemoryRegion(MappedRegion):
    """A memfd (or file) the client passed over SCM_RIGHTS, mapped shared."""

    kind = MemoryPath.SHM

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
        # Held while the mapping is populated or closed: close() never unmaps under
        # a populate step.
        self._lock = threading.Lock()
        self.populated = threading.Event()
        if st.st_blocks * 512 >= size:
            threading.Thread(target=self._populate, name="kvdepot-populate", daemon=True).start()
        else:
            # Pages the client has not allocated would be allocated here, and charged to
            # the daemon's memory (cgroup): left to fault in as copies reach them.
            self.populated.set()

    @classmethod
    def from_passed_fd(cls, fd: int, size: int) -> SharedMemoryRegion:
        """Checks `fd` (a regular file opened O_RDWR, populated: `check_passed_file`,
        `check_populated`), seals it against shrinking and maps it (ValueError/OSError
        with why). The caller keeps ownership of `fd` (the mapping does not need it)."""
        check_passed_file(fd)
        seal_against_shrinking(fd)
        if 0 < size <= os.fstat(fd).st_size:  # (a short file is refused below, saying so)
            check_populated(fd, size)
        return cls(fd, size)

    @property
    def populating_bytes(self) -> int:
        return 0 if self.populated.is_set() else self.size

    def _populate(self) -> None:
        """Fills this mapping's page tables ahead of the first copies, in the
        background and off the event loop (MAP_POPULATE would hold the loop for about
        0.5 s per GiB). A copy into a page this process never touched takes a page
        fault for every 4 KiB; an engine loads into blocks it has not used yet, so
        without this its loads ran at a tenth of the speed. Only done when the client
        allocated every page (a moved KV cache does, see SharedKVBuffer.adopt), so
        MADV_POPULATE_WRITE only maps pages and neither writes nor allocates any."""
        try:
            for offset in range(0, self.size, _POPULATE_STEP):
                with self._lock:
                    if self._mmap is None:
                        return
                    n = min(_POPULATE_STEP, self.size - offset)
                    if libc.madvise(self.address + offset, n, MADV_POPULATE_WRITE) != 0:
                        err = ctypes.get_errno()
                        log.info(
                            "shared-memory region of %d bytes not populated ahead (%s): "
                            "its first copies fault page by page",
                            self.size,
                            os.strerror(err),
                        )
                        return
        finally:
            self.populated.set()

    def close(self) -> None:
        with self._lock:
            m, self._mmap = self._mmap, None
        if m is not None:
            m.close()  # unmaps now: no copy runs on a closing region
