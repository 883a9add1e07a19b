"""The disk tier's record: one block's bytes on disk, self-describing and checked.

A record is one header page followed by the payload, both aligned to `PAGE`
(4096) bytes so that O_DIRECT can write them straight from the pool's memory:

    page 0     header: magic, format version, namespace id, key, payload length,
               the payload digest, and a CRC-32 of the header itself
    page 1..   the payload, `length` bytes, padded to a multiple of PAGE

The digest is BLAKE3 (16 bytes) over the namespace, key and length (framed with
their lengths) and then the payload, so a record verifies only for the block it
names: a torn record (a crash between the header and the last payload page), a
stale one (an extent reused by a shorter record) or one of another namespace
never does. The header's own CRC lets the recovery scan tell a header from
payload bytes without reading the payload; the payload's digest is checked on
every read (kvdepot.server.disk.tier).

BLAKE3 was measured against the alternatives on 1-4 MiB buffers, one core
(docs/disk-tier.md): about 6.3 GB/s, CRC-32 (zlib) 3.8, BLAKE2b 0.9, so it keeps
up with an NVMe disk and costs less CPU than a CRC. It is the disk tier's
dependency (the `disk` extra), as it is the remote tier's.

Pure functions and constants: no files, threads or clocks. Callers (the tier's
I/O threads, the recovery scan) own the buffers.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import blake3

PAGE = 4096
MAGIC = b"KVDDISK\x00"
VERSION = 1
DIGEST_BYTES = 16
MAX_NAMESPACE_BYTES = 1024
MAX_KEY_BYTES = 1024
# magic, version, namespace length, key length, payload length, digest; then the
# namespace and key bytes; then the CRC-32 of everything before it.
_FIXED = struct.Struct(f"<8sHHHQ{DIGEST_BYTES}s")
_CRC = struct.Struct("<I")
_FRAME = struct.Struct("<HHQ")  # the digest's framing of namespace, key, length
assert _FIXED.size + MAX_NAMESPACE_BYTES + MAX_KEY_BYTES + _CRC.size <= PAGE


class RecordError(ValueError):
    """A block that cannot be a record (namespace or key too long, empty payload)."""


@dataclass(frozen=True, slots=True)
class Header:
    """What a record's header page says (checked by its CRC, not yet its payload)."""

    namespace: str
    key: bytes
    length: int  # payload bytes
    digest: bytes

    @property
    def record_size(self) -> int:
        return record_size(self.length)


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


def digest(namespace: str, key: bytes, payload: memoryview | bytes) -> bytes:
    """The payload's digest for this namespace and key (over `len(payload)` bytes).

    Releases the GIL for large payloads (blake3), so it runs on I/O threads."""
    ns = _names(namespace, key)
    h = blake3.blake3(_FRAME.pack(len(ns), len(key), len(payload)))
    h.update(ns)
    h.update(key)
    h.update(payload)
    return h.digest(DIGEST_BYTES)


def encode_header(header: Header, page: memoryview) -> None:
    """Writes `header` into the first PAGE bytes of `page` (the rest zeroed)."""
    ns = _names(header.namespace, header.key)
    if header.length <= 0:
        raise RecordError("a record needs a payload")
    fixed = _FIXED.pack(MAGIC, VERSION, len(ns), len(header.key), header.length, header.digest)
    body = fixed + ns + header.key
    page[:PAGE] = body + _CRC.pack(zlib.crc32(body)) + bytes(PAGE - len(body) - _CRC.size)


def decode_header(page: memoryview | bytes) -> Header | None:
    """The header in the first PAGE bytes of `page`; None for anything else (payload
    bytes, zeros, a torn or damaged header, another format version). Never raises."""
    if len(page) < PAGE or bytes(page[:8]) != MAGIC:
        return None
    _magic, version, ns_len, key_len, length, dig = _FIXED.unpack_from(page, 0)
    if version != VERSION or ns_len > MAX_NAMESPACE_BYTES or key_len > MAX_KEY_BYTES:
        return None
    end = _FIXED.size + ns_len + key_len
    (crc,) = _CRC.unpack_from(page, end)
    if crc != zlib.crc32(page[:end]) or length <= 0:
        return None
    try:
        namespace = bytes(page[_FIXED.size : _FIXED.size + ns_len]).decode()
    except UnicodeDecodeError:
        return None
    key = bytes(page[_FIXED.size + ns_len : end])
    return Header(namespace, key, length, dig)
