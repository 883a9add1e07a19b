"""Index snapshots for warm restarts (DESIGN §3).

With `--pool-file`, a clean shutdown (SIGTERM) writes the block index beside the
pool file (`<pool-file>.index`): every namespace's layout and every READY slot's
key, offset and size, least recently used first. The next `kvdepot serve` with
the same pool file and size re-attaches the arena and re-creates those slots, so
engines find the blocks again. Blocks that were being written at shutdown are
not in the snapshot, so they are never served.

Trust rules (a daemon never serves bytes it cannot vouch for):
- The snapshot is consumed at start: read, then deleted before the pool is
  mapped. A daemon that later dies by SIGKILL leaves no snapshot, so the next
  start finds none and begins with an empty pool.
- The snapshot records the pool file's identity after the last write (device,
  inode, size, mtime, ctime). A file replaced, truncated, resized or written by
  someone else between the runs no longer matches, and the pool starts empty.
  (Writes that leave mtime and ctime alone cannot be seen: this is a guard
  against accidents, not against a hostile root.)
- One daemon per pool file: `lock_pool_file` holds an exclusive flock on
  `<pool-file>.lock` from before the snapshot is read until after the next one is
  written, so a second daemon on the same file is refused (and a restarted
  daemon cannot read a snapshot that is still being written).
- The snapshot carries a SHA-256 of its body; a torn or edited snapshot is
  refused. Any inconsistency met while re-creating the index (overlapping
  extents, a size that does not match the layout, a duplicate key) rejects the
  whole snapshot rather than serving part of it.

File format (integers little-endian):
    magic   8 bytes  b"KVDSNAP1"
    length  u64      bytes of the body
    body    u32 header length, header (UTF-8 JSON: format, pool size,
            granularity, pool file identity, namespace layouts, slot count),
            then per slot: u16 namespace index, u16 key length, u64 offset,
            u64 size, key bytes
    digest  32 bytes SHA-256 of the body

`encode`/`decode`/`capture`/`restore`/`check_compatible` are pure; `save`,
`take`, `lock_pool_file` and `PoolFileIdentity.of` do the file I/O, and
`prepare_start`/`finish_start`/`save_at_shutdown` bundle the daemon's start-up and
shutdown steps with their log lines.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.server.core.allocator import OutOfSpace
from kvdepot.server.core.index import BlockIndex, LayoutMismatch
from kvdepot.server.core.layout import LayoutError, NamespaceLayout

log = logging.getLogger("kvdepot.snapshot")

MAGIC = b"KVDSNAP1"
FORMAT = 1
SUFFIX = ".index"
_HEAD = struct.Struct("<8sQ")
_U32 = struct.Struct("<I")
_RECORD = struct.Struct("<HHQQ")
_DIGEST_BYTES = 32
MAX_NAMESPACES = 0xFFFF  # the record's namespace index is a u16


class SnapshotError(ValueError):
    """The snapshot cannot be trusted (corrupt, for another pool, inconsistent)."""


@dataclass(frozen=True)
class PoolFileIdentity:
    """What the pool file looked like after the last write of the daemon that wrote
    the snapshot. Any difference at the next start means someone else touched it."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> PoolFileIdentity | None:
        """The identity of the file at `path` now; None when there is no such file."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def differences(self, other: PoolFileIdentity) -> list[str]:
        """Names of the fields that differ (empty when the files are the same)."""
        return [
            name for name in ("device", "inode", "size", "mtime_ns", "ctime_ns")
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class SnapshotSlot:
    namespace: str
    key: bytes
    offset: int
    size: int


@dataclass
class IndexSnapshot:
    """The part of a BlockIndex that survives a clean restart."""

    pool_size: int
    granularity: int
    pool_file: PoolFileIdentity
    layouts: list[NamespaceLayout] = field(default_factory=list)
    slots: list[SnapshotSlot] = field(default_factory=list)  # least recently used first
    boot_id: str = ""  # of the daemon that wrote it (for the log)

    @property
    def block_bytes(self) -> int:
        return sum(s.size for s in self.slots)


@dataclass(frozen=True)
class RestoreReport:
    namespaces: int
    blocks: int
    bytes: int


def snapshot_path(pool_file: str | os.PathLike[str]) -> str:
    """Where the snapshot of `pool_file` lives: beside it, `<pool-file>.index`."""
    return os.fspath(pool_file) + SUFFIX


# -- pure: index <-> snapshot <-> bytes ------------------------------------------------


def capture(
    index: BlockIndex, pool_size: int, pool_file: PoolFileIdentity, boot_id: str = ""
) -> IndexSnapshot:
    """The READY slots of `index` (writing and doomed slots are left out)."""
    return IndexSnapshot(
        pool_size=pool_size,
        granularity=index.allocator.granularity,
        pool_file=pool_file,
        layouts=[ns.layout for ns in index.namespaces.values()],
        slots=[
            SnapshotSlot(s.namespace, s.key, s.extent.offset, s.extent.size)
            for s in index.ready_slots_by_age()
        ],
        boot_id=boot_id,
    )


def _layout_to_json(layout: NamespaceLayout) -> dict[str, object]:
    return {
        "id": layout.id,
        "world_size": layout.world_size,
        "blocks_per_chunk": layout.blocks_per_chunk,
        "groups": [list(g) for g in layout.groups],
        "description": layout.description,
    }


def _layout_from_json(obj: object) -> NamespaceLayout:
    if not isinstance(obj, dict):
        raise SnapshotError("a namespace entry is not an object")
    try:
        return NamespaceLayout(
            id=str(obj["id"]),
            world_size=int(obj["world_size"]),
            blocks_per_chunk=int(obj["blocks_per_chunk"]),
            groups=tuple(tuple(int(p) for p in g) for g in obj["groups"]),
            description=str(obj.get("description", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:  # LayoutError is a ValueError
        raise SnapshotError(f"bad namespace layout in the snapshot: {exc}") from None


def encode(snap: IndexSnapshot) -> bytes:
    """The snapshot file's bytes (see the module docstring for the format)."""
    if len(snap.layouts) > MAX_NAMESPACES:
        raise SnapshotError(f"{len(snap.layouts)} namespaces; a snapshot holds {MAX_NAMESPACES}")
    ns_index = {layout.id: i for i, layout in enumerate(snap.layouts)}
    header = json.dumps(
        {
            "format": FORMAT,
            "pool_size": snap.pool_size,
            "granularity": snap.granularity,
            "pool_file": {
                "device": snap.pool_file.device,
                "inode": snap.pool_file.inode,
                "size": snap.pool_file.size,
                "mtime_ns": snap.pool_file.mtime_ns,
                "ctime_ns": snap.pool_file.ctime_ns,
            },
            "namespaces": [_layout_to_json(lay) for lay in snap.layouts],
            "slots": len(snap.slots),
            "boot_id": snap.boot_id,
        },
        separators=(",", ":"),
    ).encode()
    parts = [_U32.pack(len(header)), header]
    for s in snap.slots:
        parts.append(_RECORD.pack(ns_index[s.namespace], len(s.key), s.offset, s.size))
        parts.append(s.key)
    body = b"".join(parts)
    return _HEAD.pack(MAGIC, len(body)) + body + hashlib.sha256(body).digest()


def decode(data: bytes) -> IndexSnapshot:
    """Parses and verifies a snapshot file's bytes; raises SnapshotError."""
    if len(data) < _HEAD.size + _DIGEST_BYTES:
        raise SnapshotError(f"snapshot of {len(data)} bytes is too short")
    magic, length = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(f"not a kvdepot index snapshot (magic {magic!r})")
    if _HEAD.size + length + _DIGEST_BYTES != len(data):
        raise SnapshotError(
            f"snapshot length mismatch: body of {length} bytes declared, file has {len(data)}"
        )
    body = memoryview(data)[_HEAD.size : _HEAD.size + length]
    if hashlib.sha256(body).digest() != data[_HEAD.size + length :]:
        raise SnapshotError("snapshot checksum mismatch (torn or edited file)")
    try:
        (hlen,) = _U32.unpack_from(body)
        header = json.loads(bytes(body[_U32.size : _U32.size + hlen]))
        if header.get("format") != FORMAT:
            raise SnapshotError(f"snapshot format {header.get('format')!r}, expected {FORMAT}")
        pf = header["pool_file"]
        identity = PoolFileIdentity(
            int(pf["device"]), int(pf["inode"]), int(pf["size"]), int(pf["mtime_ns"]),
            int(pf["ctime_ns"]),
        )
        layouts = [_layout_from_json(obj) for obj in header["namespaces"]]
        count = int(header["slots"])
        pos = _U32.size + hlen
        slots = []
        for _ in range(count):
            ns_i, klen, offset, size = _RECORD.unpack_from(body, pos)
            pos += _RECORD.size
            key = bytes(body[pos : pos + klen])
            pos += klen
            if len(key) != klen or ns_i >= len(layouts):
                raise SnapshotError("a slot record is truncated or names no namespace")
            slots.append(SnapshotSlot(layouts[ns_i].id, key, offset, size))
        if pos != len(body):
            raise SnapshotError(f"{len(body) - pos} unexpected bytes after the slot records")
        return IndexSnapshot(
            pool_size=int(header["pool_size"]),
            granularity=int(header["granularity"]),
            pool_file=identity,
            layouts=layouts,
            slots=slots,
            boot_id=str(header.get("boot_id", "")),
        )
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        raise SnapshotError(f"malformed snapshot: {exc}") from None


def check_compatible(
    snap: IndexSnapshot, pool_size: int, granularity: int, pool_file: PoolFileIdentity | None
) -> str | None:
    """Why this snapshot must not be used for a pool of `pool_size` bytes in a file
    that looks like `pool_file` now; None when it may."""
    if pool_file is None:
        return "the pool file is gone"
    if snap.pool_size != pool_size:
        return f"the pool size changed ({snap.pool_size} bytes then, {pool_size} now)"
    if pool_file.size != pool_size:
        return f"the pool file has {pool_file.size} bytes, not the pool's {pool_size}"
    if snap.granularity != granularity:
        return f"the slot granularity changed ({snap.granularity} then, {granularity} now)"
    diff = snap.pool_file.differences(pool_file)
    if diff:
        return (
            f"the pool file was replaced or modified after the snapshot was written "
            f"({', '.join(diff)} differ)"
        )
    return None


def restore(index: BlockIndex, snap: IndexSnapshot) -> RestoreReport:
    """Re-creates the snapshot's namespaces and READY slots in an empty `index`.

    Slots are adopted in snapshot order (least recently used first), so the LRU
    order survives. Raises SnapshotError on any inconsistency; the caller must
    then discard `index` (it may hold part of the snapshot).
    """
    if index.namespaces or index.allocator.used_bytes:
        raise SnapshotError("restore needs an empty index")
    if snap.granularity != index.allocator.granularity:
        raise SnapshotError("the snapshot was taken with another slot granularity")
    try:
        for layout in snap.layouts:
            index.declare_namespace(layout)
        for s in snap.slots:
            extent = index.allocator.allocate_at(s.offset, s.size)
            if extent.size != s.size:
                raise SnapshotError(f"slot at {s.offset}: size {s.size} is not granular")
            index.adopt_ready(s.namespace, s.key, extent)
    except (OutOfSpace, LayoutError, LayoutMismatch, ValueError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"inconsistent snapshot: {exc}") from None
    return RestoreReport(len(snap.layouts), len(snap.slots), snap.block_bytes)


# -- file I/O ------------------------------------------------------------------------


def save(path: str | os.PathLike[str], snap: IndexSnapshot) -> None:
    """Writes the snapshot atomically: a temporary file, fsync, rename, fsync the
    directory. A crash in the middle leaves either no snapshot or the whole one."""
    data = encode(snap)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
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


def take(path: str | os.PathLike[str]) -> bytes | None:
    """Reads and deletes the snapshot (consumes it); None when there is none.

    Deleting before the pool is mapped is what makes a later SIGKILL safe: the
    next start finds no snapshot and trusts nothing in the pool file.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


def prepare_start(pool_file: str, pool_size: int, granularity: int) -> StartPlan:
    """Consumes the snapshot beside `pool_file` and decides whether it can be used.

    Call before the arena opens the pool file.
    """
    identity = PoolFileIdentity.of(pool_file)
    path = snapshot_path(pool_file)
    try:
        data = take(path)
    except OSError as exc:
        return StartPlan(pool_file, None, f"cannot read or remove the snapshot {path}: {exc}")
    if data is None:
        if identity is None:
            return StartPlan(pool_file, None, "new pool file", fresh=True)
        return StartPlan(
            pool_file, None,
            f"no index snapshot at {path}: the previous daemon did not shut down cleanly "
            f"(killed or crashed), so the pool's contents cannot be vouched for",
        )
    try:
        snap = decode(data)
    except SnapshotError as exc:
        return StartPlan(pool_file, None, f"the index snapshot {path} is unusable: {exc}")
    why = check_compatible(snap, pool_size, granularity, identity)
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
        report = restore(index, plan.snapshot)
    except SnapshotError as exc:
        log.error("starting with an empty pool (%s): %s", plan.pool_file, exc)
        return None
    log.info(
        "warm restart: re-attached %d block(s) (%d bytes) in %d namespace(s) from %s "
        "(written by boot id %s)",
        report.blocks, report.bytes, report.namespaces, plan.pool_file,
        plan.snapshot.boot_id or "?",
    )
    return report


def save_at_shutdown(index: BlockIndex, pool_file: str, pool_size: int, boot_id: str) -> None:
    """Writes the snapshot of a cleanly stopped daemon. Call after every copy has
    ended and the arena is flushed and unmapped, so the identity is final."""
    identity = PoolFileIdentity.of(pool_file)
    if identity is None:
        log.error("pool file %s vanished: no index snapshot written", pool_file)
        return
    snap = capture(index, pool_size, identity, boot_id)
    path = snapshot_path(pool_file)
    try:
        save(path, snap)
    except (OSError, SnapshotError) as exc:
        log.error("could not write the index snapshot %s: %s (the next start is cold)", path, exc)
        return
    log.info("index snapshot written: %d block(s) (%d bytes) to %s", len(snap.slots),
             snap.block_bytes, path)
