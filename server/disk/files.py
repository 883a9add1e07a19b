"""The disk tier's file: one preallocated file under the tier's directory, and the
direct I/O of records into and out of page-aligned memory.

`TierFile.open(directory, size)` makes the directory and file the daemon's own as
the pool file's are (kvdepot.server.memory.private_files: the directory the
daemon's, created 0700; the file opened with O_NOFOLLOW, 0600), reserves `size`
bytes with fallocate(2) (ENOSPC then, not in the middle of serving; a file system
without fallocate gets a sparse file, with a warning) and opens it with O_DIRECT,
so records go between the pool's memory and the disk without staging and the page
cache does not grow. Where the file system refuses O_DIRECT (ramfs; FUSE file
systems) it falls back to buffered I/O, with a warning.

The directory's record key (kvdepot.server.disk.secret) is loaded, or created,
once the file is locked: a `TierFile` carries the key its records are written and
checked with, so a directory made anew (the old one removed) gets a key of its own.

`write_record` and `read_record` are blocking calls made on the tier's I/O threads
(os.pwritev and os.preadv release the GIL); each takes two page-aligned scratch
pages of its thread: one for the header, one for a payload's last partial page
(the only bytes ever copied). They raise OSError; the tier decides what a failure
means. The caller owns the memory it passes, and keeps it valid during the call.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.common.libc import libc
from kvdepot.server.disk import secret
from kvdepot.server.disk.record import PAGE, RecordKey
from kvdepot.server.memory import private_files

log = logging.getLogger("kvdepot.disk")

FILE_NAME = "kvdepot-disk.tier"


class TierBusy(RuntimeError):
    """Another process (another daemon) has the tier's file open: one daemon per disk."""


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    import numpy as np  # the daemon's dependency; only for buffers it does not own

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def is_aligned(view: memoryview) -> bool:
    return address_of(view) % PAGE == 0


@dataclass(eq=False)
class TierFile:
    path: Path
    fd: int
    size: int
    direct: bool
    identity: tuple[int, int]  # (st_dev, st_ino): the file the tier opened
    found_bytes: int  # bytes that were there before this open (what a scan may read)
    found_identity: tuple[int, int, int, int]  # dev, ino, size, mtime_ns before this open
    key: RecordKey  # the directory's: every record is written and checked with it
    users: int = 0  # I/O calls in progress (the tier counts them under its lock)
    retired: bool = False  # close once the last user is done
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, directory: Path, size: int) -> TierFile:
        """Opens or creates the tier's file and reserves `size` bytes. Raises
        UnsafeFileError (someone else's directory or file), OSError (ENOSPC, EROFS...)."""
        if size < 2 * PAGE or size % PAGE:
            raise ValueError(f"disk tier size {size} is not a multiple of {PAGE} (>= 2 pages)")
        private_files.prepare_directory(directory)
        path = directory / FILE_NAME
        flags = os.O_RDWR | os.O_CREAT
        direct = True
        try:
            fd = private_files.open_private(str(path), flags | os.O_DIRECT, "the disk tier file")
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = private_files.open_private(str(path), flags, "the disk tier file")
            direct = False
        try:
            _lock(fd, path)
            st = os.fstat(fd)
            found = min(st.st_size, size)
            if st.st_size > size:
                os.ftruncate(fd, size)
            key = secret.load_or_create(directory)  # under the lock: one creator
            _reserve(fd, size, path)
            if direct and not _direct_works(fd):
                os.close(fd)
                fd = private_files.open_private(str(path), flags, "the disk tier file")
                _lock(fd, path)
                direct = False
        except BaseException:
            os.close(fd)
            raise
        if not direct:
            log.warning(
                "the file system of %s refuses direct I/O: the disk tier uses buffered I/O "
                "there (the page cache grows with it)",
                path,
            )
        identity = (st.st_dev, st.st_ino)
        found_identity = (*identity, st.st_size, st.st_mtime_ns)
        return cls(path, fd, size, direct, identity, found, found_identity, key)

    def identity_now(self) -> tuple[int, int, int, int]:
        """dev, ino, size, mtime_ns of the open file now (what a checkpoint vouches for)."""
        st = os.fstat(self.fd)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def still_there(self) -> bool:
        """Whether the path still names the file the tier has open (not removed,
        not replaced)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def probe(self, page: memoryview) -> None:
        """Writes a page to the file's last page (never a record's: the tier keeps it
        out of its space) and reads it back. Raises OSError when the disk fails."""
        pattern = b"kvdepot-disk-probe".ljust(PAGE, b"\x5a")
        page[:PAGE] = pattern
        _transfer(os.pwritev, self.fd, [page[:PAGE]], self.size - PAGE)
        page[:PAGE] = bytes(PAGE)
        if (
            _transfer(os.preadv, self.fd, [page[:PAGE]], self.size - PAGE) != PAGE
            or bytes(page[:PAGE]) != pattern
        ):
            raise OSError(errno.EIO, "the probe page did not read back")

    def sync(self) -> None:
        """fdatasync(2): the records written so far are on the disk's stable storage
        (O_DIRECT leaves them in a drive's volatile cache, and an extent's first write
        in the file system's journal). Blocks while the file system is frozen."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    # -- records (I/O threads) -----------------------------------------------------------

    def write_record(
        self, offset: int, header: memoryview, payload: memoryview, tail: memoryview
    ) -> None:
        """Writes header page + payload (its last partial page through `tail`)."""
        iov = self._iov(header, payload, tail)
        rest = len(payload) % PAGE
        if rest:
            tail[:rest] = payload[len(payload) - rest :]
        _transfer(os.pwritev, self.fd, iov, offset)

    def read_record(
        self, offset: int, header: memoryview, dest: memoryview, tail: memoryview
    ) -> bool:
        """Reads header page + payload into `header` and `dest` (its last partial page
        through `tail`); False when the file ends before the record does."""
        iov = self._iov(header, dest, tail)
        if _transfer(os.preadv, self.fd, iov, offset) < sum(len(v) for v in iov):
            return False
        rest = len(dest) % PAGE
        if rest:
            dest[len(dest) - rest :] = tail[:rest]
        return True

    def read_at(self, buffer: memoryview, offset: int) -> int:
        """Reads up to len(buffer) bytes (page multiple, aligned) at `offset`."""
        return _transfer(os.preadv, self.fd, [buffer], offset)

    @staticmethod
    def _iov(header: memoryview, payload: memoryview, tail: memoryview) -> list[memoryview]:
        whole = len(payload) - len(payload) % PAGE
        iov = [header[:PAGE]]
        if whole:
            iov.append(payload[:whole])
        if whole != len(payload):
            iov.append(tail[:PAGE])
        return iov


def reopen(old: TierFile | None, directory: Path, size: int, page: memoryview) -> TierFile | None:
    """Makes the tier's file usable again after a failure: the same file with its
    space reserved again (it may have been truncated), or, when it was removed or
    replaced, a new one; then a probe page written and read back. Returns the new
    file, or None when `old` serves again. Raises OSError (still failing)."""
    if old is not None and old.still_there():
        _reserve(old.fd, old.size, old.path)
        old.probe(page)
        return None
    new = TierFile.open(directory, size)
    try:
        new.probe(page)
    except BaseException:
        new.close()
        raise
    return new


def _lock(fd: int, path: Path) -> None:
    """An exclusive lock on the open file (flock: it changes none of the file's times)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TierBusy(
            f"disk tier file {path} is in use by another process: give each kvdepot daemon "
            f"its own disk directory"
        ) from None


def _reserve(fd: int, size: int, path: Path) -> None:
    before = os.fstat(fd).st_size
    if libc.fallocate(fd, 0, 0, size) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):
        # A failed fallocate keeps what it reserved (ext4: a 64 GiB request with 51 GiB
        # free left a 51 GiB file, and the file system full): give it back.
        try:
            os.ftruncate(fd, before)
        except OSError as exc:
            log.warning("could not give back the space of %s (%s)", path, exc)
        raise OSError(err, f"cannot reserve {size} bytes for {path}: {os.strerror(err)}")
    log.warning(
        "the file system of %s cannot reserve space (fallocate): the disk tier's file is "
        "sparse, and a full file system shows as failed writes",
        path,
    )
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)


def _direct_works(fd: int) -> bool:
    """Some file systems accept O_DIRECT at open and refuse it at the first I/O."""
    import mmap

    page = mmap.mmap(-1, PAGE)
    try:
        os.preadv(fd, [page], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        page.close()
    return True


def _transfer(
    op: Callable[[int, Sequence[memoryview], int], int],
    fd: int,
    iov: Sequence[memoryview],
    offset: int,
) -> int:
    """Calls os.pwritev / os.preadv until the whole vector moved or (reading) the file
    ended; the bytes moved."""
    total = sum(len(v) for v in iov)
    done = 0
    views = list(iov)
    while done < total:
        n = op(fd, views, offset + done)
        if n == 0:
            if op is os.pwritev:
                raise OSError(errno.EIO, "the disk accepted no bytes")
            break  # end of file
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return done
