"""How a block row is framed in the remote tier: the key name and the value.

Key:   b"kvd1:" + namespace id + b":" + block key (vLLM's OffloadKey, binary).
Value: a 24-byte header, the namespace id, the key, then the row's bytes:

    offset  size  field
         0     4  magic b"KVDR"
         4     1  format version (1)
         5     1  flags (0; reserved)
         6     2  namespace id length      (big-endian, like every field)
         8     2  key length
        10     2  reserved (0)
        12     8  payload length
        20     4  CRC-32 (zlib) of bytes 0..19, the namespace, the key and the payload

The payload is one whole block row exactly as the pool holds it: every rank's
section, `NamespaceLayout.slot_bytes(group)` bytes.

Contract: `decode` returns the payload only when every field matches what the
reader expects (namespace, key, length) and the checksum holds; anything else
raises `VerifyError` naming why, and the caller discards the value. CRC-32
catches truncation and accidental corruption; it is not a defence against
someone who can write to the store on purpose (who could write a valid frame
anyway): protect the store with its own access control.
"""

from __future__ import annotations

import struct
import zlib

MAGIC = b"KVDR"
VERSION = 1
KEY_PREFIX = b"kvd1:"
_HEADER = struct.Struct(">4sBBHHHQ")  # without the checksum
_CRC = struct.Struct(">I")
HEADER_BYTES = _HEADER.size + _CRC.size  # 24


class VerifyError(ValueError):
    """A value that must not be loaded; `reason` is a short label for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def remote_key(namespace_id: str, key: bytes) -> bytes:
    """The store key of one block row. The namespace is in the name, so rows of
    different models or layouts never collide."""
    return KEY_PREFIX + namespace_id.encode() + b":" + key


def frame_bytes(namespace_id: str, key: bytes, payload_len: int) -> int:
    """Bytes of the framed value (for accounting before encoding)."""
    return HEADER_BYTES + len(namespace_id.encode()) + len(key) + payload_len


def encode(namespace_id: str, key: bytes, payload: bytes | memoryview) -> bytes:
    """The framed value. Copies the payload once (into the result)."""
    ns = namespace_id.encode()
    head = _HEADER.pack(MAGIC, VERSION, 0, len(ns), len(key), 0, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(key, zlib.crc32(ns, zlib.crc32(head))))
    return b"".join((head, _CRC.pack(crc), ns, key, payload))


def decode(value: bytes, namespace_id: str, key: bytes, payload_len: int) -> memoryview:
    """The payload of `value` if it is this namespace's row for `key` of
    `payload_len` bytes and intact; else VerifyError."""
    if len(value) < HEADER_BYTES:
        raise VerifyError("truncated", f"{len(value)} bytes, shorter than the header")
    magic, version, _flags, ns_len, key_len, _res, plen = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise VerifyError("bad_magic", "not a kvdepot value")
    if version != VERSION:
        raise VerifyError("bad_version", f"format version {version}, this daemon reads {VERSION}")
    ns = namespace_id.encode()
    end = HEADER_BYTES + ns_len + key_len + plen
    if len(value) != end:
        raise VerifyError("truncated", f"{len(value)} bytes where the header says {end}")
    mv = memoryview(value)
    at = HEADER_BYTES
    if bytes(mv[at : at + ns_len]) != ns:
        raise VerifyError("wrong_namespace", "the value belongs to another namespace")
    at += ns_len
    if bytes(mv[at : at + key_len]) != key:
        raise VerifyError("wrong_key", "the value belongs to another key")
    at += key_len
    if plen != payload_len:
        raise VerifyError("wrong_length", f"{plen} payload bytes, the layout says {payload_len}")
    (crc,) = _CRC.unpack_from(value, _HEADER.size)
    head = mv[: _HEADER.size]
    payload = mv[at:]
    got = zlib.crc32(payload, zlib.crc32(key, zlib.crc32(ns, zlib.crc32(head))))
    if got != crc:
        raise VerifyError("bad_checksum", "the checksum does not match: corrupted")
    return payload
