"""The disk tier's record: one block's bytes on disk, self-describing and authenticated.

A record is one header page followed by the payload, both aligned to `PAGE`
(4096) bytes so that O_DIRECT can write them straight from the pool's memory:

    page 0     header: magic, format version, namespace id, key, payload length,
               the payload's tag, the fleet key id that admitted the row (none for
               a row this node's engines stored), the row's chunk event (what a
               router indexes it by; none when the row had none, or when it does
               not fit in the page beside the names), then the header's own tag
    page 1..   the payload, `length` bytes, padded to a multiple of PAGE

Both tags are keyed BLAKE3 (16 bytes) under the daemon's own record key
(`RecordKey`: a random secret of the tier's directory, kvdepot.server.disk.secret),
each under a subkey of its own, and both bind the record's file offset:

- the payload's tag covers the offset, the namespace, key and length (framed with
  their lengths) and then the payload, so a record verifies only for the block it
  names, where it was written: a torn record (a crash between the header and the
  last payload page), a stale one (an extent reused by a shorter record), one of
  another namespace, or a whole valid record copied to another offset never does;
- the header's tag covers the offset and the header's bytes (the payload's tag
  among them), so the recovery scan tells a header from payload bytes without
  reading the payload, and only a header this daemon wrote, at this offset, is
  one. Payload bytes are a client's: a page of them that imitates a header (any
  unkeyed digest or CRC can be computed by anyone) is refused, since nobody but the
  daemon holds the key (docs/security.md, "The disk tier trusts only what it
  wrote").

The payload is hashed once on write and once on read, as before the tags were
keyed: keyed BLAKE3 costs what unkeyed does. Version 1 (an unkeyed digest and a
CRC-32) is not read: its records are not adopted (a cache: they are recomputed).
Version 2 (no chunk event) is read as before: its records come back without one.

BLAKE3 was measured against the alternatives on 1-4 MiB buffers, one core
(docs/disk-tier.md): about 6.3 GB/s, CRC-32 (zlib) 3.8, BLAKE2b 0.9, so it keeps
up with an NVMe disk and costs less CPU than a CRC. It is the disk tier's
dependency (the `disk` extra), as it is the remote tier's.

Pure functions and constants: no files, threads or clocks. Callers (the tier's
I/O threads, the recovery scan) own the buffers and the key.
"""

from __future__ import annotations

import enum
import hmac
import struct
from dataclasses import dataclass

import blake3

PAGE = 4096
MAGIC = b"KVDDISK\x00"
VERSION = 3  # 2: no chunk event (read); 1: an unkeyed digest and a CRC-32 (not adopted)
READ_VERSIONS = (2, 3)
KEY_BYTES = 32
FLEET_ID_BYTES = 8  # a fleet key's id (kvdepot.server.remote.fleet_key)
DIGEST_BYTES = 16  # the payload's tag (the index keeps it as the record's digest)
TAG_BYTES = 16
MAX_NAMESPACE_BYTES = 1024
MAX_KEY_BYTES = 1024
# magic, version, namespace length, key length, payload length, the payload's tag,
# the admitting fleet key id's length (0 or FLEET_ID_BYTES) and the id; (version 3)
# the chunk event's length; then the namespace, key and chunk event bytes; then the
# header's tag over everything before it.
_FIXED = struct.Struct(f"<8sHHHQ{DIGEST_BYTES}sB{FLEET_ID_BYTES}s")
_EVENT_LEN = struct.Struct("<H")  # version 3 only
NAMESPACE_AT = _FIXED.size + _EVENT_LEN.size  # where a header's namespace id starts
_HEAD = struct.Struct("<8sH")  # magic and version: what tells an old record apart
_OFFSET = struct.Struct("<Q")  # the header tag's binding to the record's offset
_FRAME = struct.Struct("<QHHQ")  # the payload tag's framing: offset, namespace, key, length
assert _FIXED.size + _EVENT_LEN.size + MAX_NAMESPACE_BYTES + MAX_KEY_BYTES + TAG_BYTES <= PAGE
# Subkeys of the record key, one per tag (BLAKE3's key derivation mode).
_PAYLOAD_CONTEXT = "kvdepot disk tier record payload tag v2"
_HEADER_CONTEXT = "kvdepot disk tier record header tag v2"


class RecordError(ValueError):
    """A block that cannot be a record (namespace or key too long, empty payload)."""


@dataclass(frozen=True, slots=True)
class Header:
    """What a record's header page says (authenticated by its tag; the payload not yet)."""

    namespace: str
    key: bytes
    length: int  # payload bytes
    digest: bytes  # the payload's tag
    admitted_by: bytes = b""  # the fleet key id that admitted the row; b"": local
    chunk_event: bytes = b""  # the row's (kvdepot.v1.ChunkEvent); b"": none

    @property
    def record_size(self) -> int:
        return record_size(self.length)


class Refusal(enum.Enum):
    """Why a page that starts like a record header is not one (`refusal`)."""

    OLD_FORMAT = "old_format"  # another format version: not read, not adopted
    UNAUTHENTIC = "unauthentic"  # this version, but its tag fails: forged, damaged or
    # written under another key (the key file replaced), or at another offset


class RecordKey:
    """The daemon's secret for its records (32 random bytes, kept in the tier's
    directory: kvdepot.server.disk.secret), as the two tags' keys."""

    __slots__ = ("_header", "_payload")

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a record key has {KEY_BYTES} bytes, not {len(secret)}")
        self._payload = blake3.blake3(secret, derive_key_context=_PAYLOAD_CONTEXT).digest()
        self._header = blake3.blake3(secret, derive_key_context=_HEADER_CONTEXT).digest()

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return "RecordKey(...)"

    def payload_tag(
        self, namespace: str, key: bytes, offset: int, payload: memoryview | bytes
    ) -> bytes:
        """The payload's tag for this namespace and key at `offset` (over
        `len(payload)` bytes). Releases the GIL for large payloads (blake3), so it
        runs on I/O threads."""
        ns = _names(namespace, key)
        h = blake3.blake3(_FRAME.pack(offset, len(ns), len(key), len(payload)), key=self._payload)
        h.update(ns)
        h.update(key)
        h.update(payload)
        return h.digest(DIGEST_BYTES)

    def header_tag(self, body: memoryview | bytes, offset: int) -> bytes:
        h = blake3.blake3(_OFFSET.pack(offset), key=self._header)
        h.update(body)
        return h.digest(TAG_BYTES)


def round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def record_size(length: int) -> int:
    """Bytes a record of a `length`-byte payload occupies on disk."""
    return PAGE + round_up(length)


def _names(namespace: str, key: bytes) -> bytes:
    ns = namespace.encode()
    if len(ns) > MAX_NAMESPACE_BYTES or len(key) > MAX_KEY_BYTES:
        raise RecordError(
            f"namespace id of {len(ns)} bytes or key of {len(key)} bytes is over the "
            f"record's limit ({MAX_NAMESPACE_BYTES}, {MAX_KEY_BYTES})"
        )
    return ns


def fitting_event(namespace: str, key: bytes, chunk_event: bytes) -> bytes:
    """`chunk_event` when it fits in a header page beside these names, else b"" (the
    record is written without it: `encode_header` takes only one that fits)."""
    room = PAGE - _FIXED.size - _EVENT_LEN.size - TAG_BYTES
    return chunk_event if len(namespace.encode()) + len(key) + len(chunk_event) <= room else b""


def encode_header(header: Header, page: memoryview, offset: int, key: RecordKey) -> None:
    """Writes `header` for a record at file `offset` into the first PAGE bytes of
    `page` (the rest zeroed). Its chunk event must fit (`fitting_event`)."""
    ns = _names(header.namespace, header.key)
    if header.length <= 0:
        raise RecordError("a record needs a payload")
    fleet = header.admitted_by
    if len(fleet) not in (0, FLEET_ID_BYTES):
        raise RecordError(f"a fleet key id has {FLEET_ID_BYTES} bytes, not {len(fleet)}")
    event = header.chunk_event
    if fitting_event(header.namespace, header.key, event) != event:
        raise RecordError(f"a chunk event of {len(event)} bytes does not fit in the header")
    fixed = _FIXED.pack(
        MAGIC, VERSION, len(ns), len(header.key), header.length, header.digest, len(fleet), fleet
    )
    body = fixed + _EVENT_LEN.pack(len(event)) + ns + header.key + event
    tag = key.header_tag(body, offset)
    page[:PAGE] = body + tag + bytes(PAGE - len(body) - TAG_BYTES)


def decode_header(page: memoryview | bytes, offset: int, key: RecordKey) -> Header | None:
    """The header in the first PAGE bytes of `page`, read at file `offset`; None for
    anything else: payload bytes, zeros, a torn or damaged header, another format
    version, a header whose tag this key and offset do not give (forged, copied
    from elsewhere). Never raises."""
    if len(page) < PAGE or bytes(page[:8]) != MAGIC:
        return None
    _magic, version, ns_len, key_len, length, dig, fleet_len, fleet = _FIXED.unpack_from(page, 0)
    if version not in READ_VERSIONS or ns_len > MAX_NAMESPACE_BYTES or key_len > MAX_KEY_BYTES:
        return None
    if fleet_len not in (0, FLEET_ID_BYTES):
        return None
    at, event_len = _FIXED.size, 0
    if version == 3:
        (event_len,) = _EVENT_LEN.unpack_from(page, at)
        at += _EVENT_LEN.size
    end = at + ns_len + key_len + event_len
    if end + TAG_BYTES > PAGE:
        return None
    tag = bytes(page[end : end + TAG_BYTES])
    if not hmac.compare_digest(tag, key.header_tag(page[:end], offset)) or length <= 0:
        return None
    try:
        namespace = bytes(page[at : at + ns_len]).decode()
    except UnicodeDecodeError:
        return None
    name = bytes(page[at + ns_len : at + ns_len + key_len])
    event = bytes(page[at + ns_len + key_len : end])
    return Header(namespace, name, length, dig, fleet[:fleet_len], event)


def refusal(page: memoryview | bytes) -> Refusal | None:
    """Why a page `decode_header` refused looks like a header all the same (the
    recovery scan counts them); None for a page that does not (payload bytes,
    zeros)."""
    if len(page) < _HEAD.size:
        return None
    magic, version = _HEAD.unpack_from(page, 0)
    if magic != MAGIC:
        return None
    return Refusal.UNAUTHENTIC if version in READ_VERSIONS else Refusal.OLD_FORMAT
