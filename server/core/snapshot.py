"""Index snapshots for warm restarts.

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
            u64 size, u16 chunk event length, key bytes, chunk event bytes
    digest  32 bytes SHA-256 of the body

Format 2 keeps each row's chunk event (Slot.chunk_event: what routers index the
row by, at most MAX_CHUNK_EVENT_BYTES), so a warm restart's rows publish complete
events again. Format 1 (no event length, no event) is still read: its rows come
back without one.

This module is pure (`capture`, `encode`, `decode`, `check_compatible`,
`restore`); the file half (reading, writing, the lock, the daemon's start-up and
shutdown steps) is kvdepot.server.memory.pool_file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field

from kvdepot.server.core.allocator import OutOfSpace
from kvdepot.server.core.index import BlockIndex, LayoutMismatch
from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.core.layout import LayoutError, NamespaceLayout

MAGIC = b"KVDSNAP1"
FORMAT = 2
SUFFIX = ".index"
_HEAD = struct.Struct("<8sQ")
_U32 = struct.Struct("<I")
_RECORD = struct.Struct("<HHQQH")  # format 1's lacks the final u16 (the event's length)
_RECORDS = {1: struct.Struct("<HHQQ"), 2: _RECORD}
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

    def differences(self, other: PoolFileIdentity) -> list[str]:
        """Names of the fields that differ (empty when the files are the same)."""
        return [
            name
            for name in ("device", "inode", "size", "mtime_ns", "ctime_ns")
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class SnapshotSlot:
    namespace: str
    key: bytes
    offset: int
    size: int
    chunk_event: bytes = b""  # the row's (Slot.chunk_event); b"": none


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
    """The READY slots of `index` (writing and doomed slots are left out, and so are
    rows a fleet key admitted: fetched again after the restart, they are checked
    under the keys the node holds then, never kept past a key's rotation)."""
    return IndexSnapshot(
        pool_size=pool_size,
        granularity=index.allocator.granularity,
        pool_file=pool_file,
        layouts=[ns.layout for ns in index.namespaces.values()],
        slots=[
            SnapshotSlot(s.namespace, s.key, s.extent.offset, s.extent.size, s.chunk_event)
            for s in index.ready_slots_by_age()
            if not s.admitted_by
        ],
        boot_id=boot_id,
    )


def _layout_to_json(layout: NamespaceLayout) -> dict[str, object]:
    obj: dict[str, object] = {
        "id": layout.id,
        "world_size": layout.world_size,
        "blocks_per_chunk": layout.blocks_per_chunk,
        "groups": [list(g) for g in layout.groups],
        "description": layout.description,
    }
    if not layout.default_group_ids:
        # Only when they are not 0, 1, ...: a daemon from before group ids reads the
        # others as they always were. It would read these as 0, 1, ... too, but its
        # job check refuses every key whose group id is not its group's position.
        obj["group_ids"] = list(layout.group_ids)
    return obj


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
            group_ids=tuple(int(g) for g in obj.get("group_ids", ())),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # LayoutError: ValueError
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
        event = s.chunk_event if len(s.chunk_event) <= MAX_CHUNK_EVENT_BYTES else b""
        parts.append(_RECORD.pack(ns_index[s.namespace], len(s.key), s.offset, s.size, len(event)))
        parts.append(s.key)
        parts.append(event)
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
        if _U32.size + hlen > len(body):
            raise SnapshotError(f"a header of {hlen} bytes in a body of {len(body)}")
        header = json.loads(bytes(body[_U32.size : _U32.size + hlen]))
        if not isinstance(header, dict):
            raise SnapshotError("the snapshot's header is not a JSON object")
        fmt = header.get("format")
        record = _RECORDS.get(fmt) if isinstance(fmt, int) else None
        if record is None:
            raise SnapshotError(
                f"snapshot format {header.get('format')!r}, expected one of {sorted(_RECORDS)}"
            )
        pf = header["pool_file"]
        identity = PoolFileIdentity(
            int(pf["device"]),
            int(pf["inode"]),
            int(pf["size"]),
            int(pf["mtime_ns"]),
            int(pf["ctime_ns"]),
        )
        layouts = [_layout_from_json(obj) for obj in header["namespaces"]]
        count = int(header["slots"])
        pos = _U32.size + hlen
        if not 0 <= count <= (len(body) - pos) // record.size:  # a huge count fails here
            raise SnapshotError(f"{count} slot records cannot fit in the snapshot")
        slots = []
        for _ in range(count):
            ns_i, klen, offset, size, *more = record.unpack_from(body, pos)
            elen = more[0] if more else 0
            pos += record.size
            key = bytes(body[pos : pos + klen])
            pos += klen
            event = bytes(body[pos : pos + elen])
            pos += elen
            if len(key) != klen or len(event) != elen or ns_i >= len(layouts):
                raise SnapshotError("a slot record is truncated or names no namespace")
            if elen > MAX_CHUNK_EVENT_BYTES:
                raise SnapshotError(f"a chunk event of {elen} bytes in a slot record")
            slots.append(SnapshotSlot(layouts[ns_i].id, key, offset, size, event))
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
    # Anything a crafted header can raise (a deep JSON nesting, an infinite number).
    except (
        KeyError,
        TypeError,
        ValueError,
        struct.error,
        AttributeError,
        OverflowError,
        RecursionError,
    ) as exc:
        raise SnapshotError(f"malformed snapshot: {exc!r}") from None


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
            slot = index.adopt_ready(s.namespace, s.key, extent)
            if s.chunk_event:
                index.keep_chunk_events(s.namespace, (slot,), {s.key: s.chunk_event})
    except (OutOfSpace, LayoutError, LayoutMismatch, ValueError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"inconsistent snapshot: {exc}") from None
    return RestoreReport(len(snap.layouts), len(snap.slots), snap.block_bytes)
