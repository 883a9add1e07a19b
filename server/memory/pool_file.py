"""The pool file's half of warm restarts: the snapshot file, the lock, start-up
and shutdown.

The snapshot's format and trust rules are in kvdepot.server.core.snapshot (pure:
encode, decode, check, restore); this module reads and writes it beside the pool
file, holds `<pool-file>.lock`, and bundles the daemon's steps with their log
lines:

    lock = lock_pool_file(path)             # before anything else; PoolFileBusy
    plan = prepare_start(path, size, gran)  # consumes the snapshot, before mapping
    finish_start(plan, index)               # re-creates the index (or None: empty)
    ...
    save_at_shutdown(index, path, size, boot_id)  # after the last copy and unmap
    os.close(lock)
"""

from __future__ import annotations

import fcntl
import logging
import os
from dataclasses import dataclass

from kvdepot.server.core import snapshot
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.snapshot import IndexSnapshot, PoolFileIdentity, RestoreReport
from kvdepot.server.memory import private_files

log = logging.getLogger("kvdepot.snapshot")


def identity_of(path: str | os.PathLike[str]) -> PoolFileIdentity | None:
    """The identity of the file at `path` now; None when there is no such file."""
    try:
        st = os.stat(path, follow_symlinks=False)  # a symlink is refused, never followed
    except FileNotFoundError:
        return None
    return PoolFileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def save(path: str | os.PathLike[str], snap: IndexSnapshot) -> None:
    """Writes the snapshot atomically: a temporary file, fsync, rename, fsync the
    directory. A crash in the middle leaves either no snapshot or the whole one."""
    private_files.write_atomically(path, snapshot.encode(snap), "the snapshot's temporary file")


def take(path: str | os.PathLike[str]) -> bytes | None:
    """Reads and deletes the snapshot (consumes it); None when there is none.

    Deleting before the pool is mapped is what makes a later SIGKILL safe: the
    next start finds no snapshot and trusts nothing in the pool file.
    """
    try:
        data = private_files.read_private(os.fspath(path), "the index snapshot")
    except FileNotFoundError:
        return None
    os.unlink(path)
    return data


class PoolFileBusy(RuntimeError):
    """Another daemon holds the pool file (its `<pool-file>.lock`)."""


def lock_pool_file(pool_file: str) -> int:
    """Takes an exclusive lock on `<pool-file>.lock` and returns its fd; hold it for
    the daemon's life and close it after the snapshot is written.

    Two daemons mapping one pool file would overwrite each other's blocks, and the
    second would consume the first one's snapshot. The lock lives in a separate
    file so that taking it never creates or touches the pool file (whose times the
    snapshot vouches for). Raises PoolFileBusy, naming the holder where it can.
    """
    path = pool_file + ".lock"
    fd = private_files.open_private(path, os.O_RDWR | os.O_CREAT, "the pool's lock file")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise PoolFileBusy(
            f"pool file {pool_file} is in use by another kvdepot daemon (pid {holder}, lock "
            f"{path}): give each daemon its own --pool-file"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above, and operators
    return fd


# -- the daemon's start-up and shutdown ------------------------------------------------


@dataclass
class StartPlan:
    """Decided before the pool file is mapped (mapping it may change its times)."""

    pool_file: str
    snapshot: IndexSnapshot | None
    reason: str  # why the pool starts empty (when snapshot is None)
    fresh: bool = False  # no pool file yet: starting empty is routine, not a warning
    crashed: bool = False  # a pool file but no snapshot: the last daemon was killed


def prepare_start(pool_file: str, pool_size: int, granularity: int) -> StartPlan:
    """Consumes the snapshot beside `pool_file` and decides whether it can be used.

    Call before the arena opens the pool file.
    """
    identity = identity_of(pool_file)
    path = snapshot.snapshot_path(pool_file)
    try:
        data = take(path)
    except private_files.UnsafeFileError:
        raise  # someone else's file or a symlink: refused, not read (exit 2)
    except OSError as exc:
        return StartPlan(pool_file, None, f"cannot read or remove the snapshot {path}: {exc}")
    if data is None:
        if identity is None:
            return StartPlan(pool_file, None, "new pool file", fresh=True)
        return StartPlan(
            pool_file,
            None,
            f"no index snapshot at {path}: the previous daemon did not shut down cleanly "
            f"(killed or crashed), so the pool's contents cannot be vouched for",
            crashed=True,
        )
    try:
        snap = snapshot.decode(data)
    except snapshot.SnapshotError as exc:
        return StartPlan(pool_file, None, f"the index snapshot {path} is unusable: {exc}")
    why = snapshot.check_compatible(snap, pool_size, granularity, identity)
    if why is not None:
        return StartPlan(pool_file, None, f"the index snapshot {path} does not apply: {why}")
    return StartPlan(pool_file, snap, "")


def finish_start(plan: StartPlan, index: BlockIndex) -> RestoreReport | None:
    """Re-creates the index from the plan's snapshot (logging what happened).

    Returns None, and leaves `index` possibly half-filled, when the pool must
    start empty: the caller then uses a fresh index.
    """
    if plan.snapshot is None:
        level = logging.INFO if plan.fresh else logging.WARNING
        log.log(level, "starting with an empty pool (%s): %s", plan.pool_file, plan.reason)
        return None
    try:
        report = snapshot.restore(index, plan.snapshot)
    except snapshot.SnapshotError as exc:
        log.error("starting with an empty pool (%s): %s", plan.pool_file, exc)
        return None
    except Exception as exc:  # a bug must cost the cache, not every start
        log.exception("starting with an empty pool (%s): restore failed: %r", plan.pool_file, exc)
        return None
    log.info(
        "warm restart: re-attached %d block(s) (%d bytes) in %d namespace(s) from %s "
        "(written by boot id %s)",
        report.blocks,
        report.bytes,
        report.namespaces,
        plan.pool_file,
        plan.snapshot.boot_id or "?",
    )
    return report


def save_at_shutdown(index: BlockIndex, pool_file: str, pool_size: int, boot_id: str) -> None:
    """Writes the snapshot of a cleanly stopped daemon. Call after every copy has
    ended and the arena is flushed and unmapped, so the identity is final."""
    identity = identity_of(pool_file)
    if identity is None:
        log.error("pool file %s vanished: no index snapshot written", pool_file)
        return
    snap = snapshot.capture(index, pool_size, identity, boot_id)
    path = snapshot.snapshot_path(pool_file)
    try:
        save(path, snap)
    except (OSError, snapshot.SnapshotError) as exc:
        log.error("could not write the index snapshot %s: %s (the next start is cold)", path, exc)
        return
    log.info(
        "index snapshot written: %d block(s) (%d bytes) to %s",
        len(snap.slots),
        snap.block_bytes,
        path,
    )
