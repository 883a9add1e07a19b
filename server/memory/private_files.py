"""The daemon's own files: the pool file, its lock, snapshot and journal.

They hold every tenant's KV bytes (the pool) and the index that says which bytes
are served for which key (snapshot, journal), so nobody but the daemon may write
them or put files of their own in their place:

- their directory belongs to the daemon's euid (or root) and nobody else may
  write it; a missing directory is created 0700. Group-writable is refused too,
  trusted group or not: write access to the directory lets a member rename,
  delete or replace the files between two of the daemon's checks, and nothing
  but the daemon needs it (engines reach the pool through the socket, and the
  socket is what `--socket-group` shares);
- each file is opened with O_NOFOLLOW and checked on its open fd (a regular
  file, owned by the daemon's euid, no access for group or others); the files
  the daemon creates get mode 0600.

A refusal is an `UnsafeFileError` (a PermissionError, so the daemon's start-up
turns it into its one-line `--pool-file` error and exit 2).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("kvdepot.files")

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafeFileError(PermissionError):
    """A file or directory of the pool that someone else could control."""

    def __str__(self) -> str:  # one line, without errno decorations
        return str(self.args[0]) if self.args else "unsafe file"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def check_file_stat(st: os.stat_result, path: str, what: str) -> None:
    """Refuses a file the daemon does not own alone (from its lstat or fstat)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(
            f"{what} {path} is a symbolic link: refusing to follow it (remove it; the daemon "
            f"creates its files itself)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{what} {path} is not a regular file: remove it")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeFileError(
            f"{what} {path} belongs to uid {st.st_uid}, not to the daemon (uid {euid}): "
            f"someone else created it; remove it"
        )
    if st.st_mode & 0o077:
        raise UnsafeFileError(
            f"{what} {path} has mode {_mode(st)}: group or others may read or write it; "
            f"chmod 600 it, or remove it"
        )


def check_existing(path: str, what: str) -> None:
    """Refuses `path` (without following a symlink) unless it is absent or the
    daemon's own."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    check_file_stat(st, path, what)


def open_private(path: str, flags: int, what: str) -> int:
    """os.open with O_NOFOLLOW and O_CLOEXEC (mode 0600 when created), then the
    checks of `check_file_stat` on the open fd: what was checked is what is used."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink
            raise UnsafeFileError(
                f"{what} {path} is a symbolic link: refusing to follow it (remove it; the "
                f"daemon creates its files itself)"
            ) from None
        raise
    try:
        check_file_stat(os.fstat(fd), path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: str, what: str) -> bytes:
    """The whole file, opened as `open_private` does; FileNotFoundError when absent."""
    fd = open_private(path, os.O_RDONLY, what)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike[str], data: bytes, what: str) -> None:
    """Writes `data` to `path` as the daemon's own file, atomically: a temporary file
    beside it (opened as `open_private` does), fsync, rename, fsync the directory. A
    crash in the middle leaves either no file or the whole one."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = open_private(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def prepare_directory(directory: Path) -> None:
    """Checks the pool file's directory; creates it 0700 when it is missing and its
    own parent exists. Raises UnsafeFileError, or FileNotFoundError when even the
    parent is missing."""
    try:
        lst = os.lstat(directory)
    except FileNotFoundError:
        try:
            os.mkdir(directory, DIR_MODE)
            log.info("created the pool directory %s (mode 0700)", directory)
        except FileExistsError:
            pass  # created meanwhile: checked below like any other
        lst = os.lstat(directory)
    euid = os.geteuid()
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (euid, 0):
        raise UnsafeFileError(
            f"directory {directory} is a symbolic link of uid {lst.st_uid}: use a real path"
        )
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{directory} is not a directory")
    if st.st_uid not in (euid, 0):
        raise UnsafeFileError(
            f"directory {directory} belongs to uid {st.st_uid}, not to the daemon (uid {euid}): "
            f"use a directory of the daemon's own (a missing one is created 0700)"
        )
    if st.st_mode & 0o022:
        raise UnsafeFileError(
            f"directory {directory} is writable by group or others (mode {_mode(st)}): keep "
            f"the pool in a directory only the daemon can write, e.g. {directory / 'kvdepot'}/ "
            f"(created 0700 by the daemon)"
        )
