"""The disk tier's index at a clean stop: written at close, taken back at the next open.

A clean stop writes every readable record's namespace, key, offset, length,
payload tag and admitting fleet key id, least recently used first, to
`kvdepot-disk.index` beside the tier's file, with the file's identity (device,
inode, size, modification time) at that moment. The next open reads and deletes
it (so a later SIGKILL leaves none behind, and that start scans the headers
instead: kvdepot.server.disk.scan) and uses it only when the file's identity is
unchanged, so the index comes back in one read instead of a scan. A checkpoint
that does not apply is ignored, never trusted in part; and every read checks the
record's header and payload tags with the record key anyway
(kvdepot.server.disk.record), so even a wrong checkpoint costs misses, never a
wrong byte. Version 2 went with the record format's version 2 (keyed tags): a
version 1 checkpoint lists records that are no longer read, and is ignored.
Version 3 adds each record's chunk event (what its header holds); a version 2
checkpoint is still taken, its records without one.

Format (integers little-endian): magic, version, the identity, the count, then
per record u16 namespace length, u16 key length, u64 offset, u64 length, the
payload's tag, u8 fleet key id length (0 or 8) and the id (8 bytes), (version 3)
u16 chunk event length, namespace, key, (version 3) chunk event; last, a CRC-32 of
everything before it. Pure functions.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable

from kvdepot.server.disk.record import DIGEST_BYTES, FLEET_ID_BYTES, PAGE

FILE_NAME = "kvdepot-disk.index"
MAGIC = b"KVDINDEX"
VERSION = 3  # 2: no chunk events (read); 1: of version 1 records (unkeyed digests), not read
_HEAD = struct.Struct("<8sHQQQqQ")  # magic, version, dev, ino, size, mtime_ns, count
_ENTRY = struct.Struct(f"<HHQQ{DIGEST_BYTES}sB{FLEET_ID_BYTES}s")
_EVENT_LEN = struct.Struct("<H")  # version 3
_CRC = struct.Struct("<I")

Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns
# namespace, key, offset, length, digest (the payload's tag), admitting fleet key id,
# chunk event
Item = tuple[str, bytes, int, int, bytes, bytes, bytes]


def encode(identity: Identity, items: Iterable[Item]) -> bytes:
    body = bytearray()
    count = 0
    for namespace, key, offset, length, digest, fleet, event in items:
        ns = namespace.encode()
        body += _ENTRY.pack(len(ns), len(key), offset, length, digest, len(fleet), fleet)
        body += _EVENT_LEN.pack(len(event)) + ns + key + event
        count += 1
    data = _HEAD.pack(MAGIC, VERSION, *identity, count) + body
    return bytes(data) + _CRC.pack(zlib.crc32(data))


def decode(data: bytes, identity: Identity) -> list[Item] | None:
    """The records, or None when `data` is not a whole checkpoint of this very file
    (another file, a file written since, torn, damaged, another version). Never
    raises."""
    if len(data) < _HEAD.size + _CRC.size:
        return None
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if crc != zlib.crc32(memoryview(data)[: len(data) - _CRC.size]):
        return None
    magic, version, dev, ino, size, mtime, count = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version not in (2, VERSION) or (dev, ino, size, mtime) != identity:
        return None
    items: list[Item] = []
    pos = _HEAD.size
    end = len(data) - _CRC.size
    try:
        for _ in range(count):
            ns_len, key_len, offset, length, digest, fleet_len, fleet = _ENTRY.unpack_from(
                data, pos
            )
            pos += _ENTRY.size
            event_len = 0
            if version == VERSION:
                (event_len,) = _EVENT_LEN.unpack_from(data, pos)
                pos += _EVENT_LEN.size
            if pos + ns_len + key_len + event_len > end or fleet_len not in (0, FLEET_ID_BYTES):
                return None
            if event_len > PAGE:  # a record's header holds less
                return None
            namespace = data[pos : pos + ns_len].decode()
            key = data[pos + ns_len : pos + ns_len + key_len]
            pos += ns_len + key_len
            event = data[pos : pos + event_len]
            pos += event_len
            items.append((namespace, key, offset, length, digest, fleet[:fleet_len], event))
    except (struct.error, UnicodeDecodeError):
        return None
    return items if pos == end else None
