"""How a block row is framed in the remote tier: the key name and the value.

Two formats; a node writes and reads one of them (`Codec`):

Format 2, keyed (the default: `--remote-key-file`). Key b"kvd2:" + namespace id
+ b":" + block key (vLLM's OffloadKey, binary). Value: a 60-byte header, the
namespace id, the key, the row's chunk event, then the row's bytes:

    offset  size  field
         0     4  magic b"KVDR"
         4     1  format version (2)
         5     1  flags (0; reserved)
         6     2  namespace id length      (big-endian, like every field)
         8     2  key length
        10     2  chunk event length (0: none; at most MAX_CHUNK_EVENT_BYTES)
        12     8  payload length
        20     8  key id: which fleet key made the MAC (kvdepot.server.remote.fleet_key)
        28    32  MAC: keyed BLAKE3 of bytes 0..27, the namespace, the key, the
                  chunk event and the payload

Format 1, CRC only (`--remote-insecure`; what kvdepot wrote before format 2).
Key b"kvd1:" + namespace id + b":" + block key. Value: a 24-byte header (bytes
0..19 as above with version 1, then a CRC-32 of them, the namespace, the key, the
chunk event and the payload), the namespace id, the key, the chunk event, then the
row's bytes.

The chunk event (a serialized kvdepot.v1.ChunkEvent: what a router indexes the row
by) travels with the row, so a node that fetches it publishes the storing engine's
complete event. It was a reserved zero field before, so rows without one are the
rows older kvdepot wrote, and read as before; an older reader refuses a row with
one (its length differs from the layout's), as it refuses any value it cannot read.

The payload is one whole block row exactly as the pool holds it: every rank's
section, `NamespaceLayout.slot_bytes(group)` bytes. The names differ by format,
so keyed and insecure nodes sharing one store never see each other's rows, and
rows left by an older kvdepot do not hold a keyed fleet's names.

Contract: `Codec.decode` returns the payload only when every field matches what
the reader expects (format, namespace, key, length) and the MAC (or, format 1,
the checksum) holds; anything else raises `VerifyError` naming why, and the
caller discards the value. The MAC covers the lengths (they are in the header),
so no split of the same bytes into namespace, key, event and payload verifies twice.
Format 1's CRC-32 catches only accidents: anyone who can write to the store can
write a valid format-1 frame, which is why it is opt-in.
"""

from __future__ import annotations

import hmac
import struct
import zlib
from typing import NamedTuple

from blake3 import blake3

from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.remote.fleet_key import INSECURE_ID, KEY_ID_BYTES, Keyring

MAGIC = b"KVDR"
_HEADER = struct.Struct(">4sBBHHHQ")  # the fields both formats share (20 bytes)
_CRC = struct.Struct(">I")
_KEY_ID_BYTES = KEY_ID_BYTES
_MAC_BYTES = 32
HEADER_V1 = _HEADER.size + _CRC.size  # 24
HEADER_V2 = _HEADER.size + _KEY_ID_BYTES + _MAC_BYTES  # 60


class VerifyError(ValueError):
    """A value that must not be loaded; `reason` is a short label for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Admitted(NamedTuple):
    """A value that verified: the row's bytes, the id of the key that verified it
    (INSECURE_ID for format 1), and its chunk event (b"": none)."""

    payload: memoryview
    key_id: bytes
    chunk_event: bytes


class Codec:
    """Names and frames values for one fleet: keyed (format 2) with a keyring,
    CRC only (format 1) with None."""

    def __init__(self, keyring: Keyring | None) -> None:
        self.keyring = keyring
        self.version = 1 if keyring is None else 2
        self.prefix = b"kvd1:" if keyring is None else b"kvd2:"
        self.header_bytes = HEADER_V1 if keyring is None else HEADER_V2

    def remote_key(self, namespace_id: str, key: bytes) -> bytes:
        """The store key of one block row. The namespace is in the name, so rows of
        different models or layouts never collide."""
        return self.prefix + namespace_id.encode() + b":" + key

    def frame_bytes(
        self, namespace_id: str, key: bytes, payload_len: int, event_len: int = 0
    ) -> int:
        """Bytes of the framed value: what the reader expects, and checks before
        it downloads a value (STRLEN, between this without an event and with the
        largest one; then a GETRANGE bounded by the latter)."""
        return self.header_bytes + len(namespace_id.encode()) + len(key) + event_len + payload_len

    def encode(
        self,
        namespace_id: str,
        key: bytes,
        payload: bytes | memoryview,
        chunk_event: bytes = b"",
    ) -> bytes:
        """The framed value, with the row's chunk event (left out, b"", when it is
        longer than MAX_CHUNK_EVENT_BYTES: no reader would take it). Copies the
        payload once (into the result)."""
        ns = namespace_id.encode()
        event = chunk_event if len(chunk_event) <= MAX_CHUNK_EVENT_BYTES else b""
        head = _HEADER.pack(MAGIC, self.version, 0, len(ns), len(key), len(event), len(payload))
        if self.keyring is None:
            crc = zlib.crc32(key, zlib.crc32(ns, zlib.crc32(head)))
            crc = zlib.crc32(payload, zlib.crc32(event, crc))
            return b"".join((head, _CRC.pack(crc), ns, key, event, payload))
        fk = self.keyring.current
        head += fk.id
        mac = _mac(fk.mac_key, head, ns, key, event, payload)
        return b"".join((head, mac, ns, key, event, payload))

    @property
    def held_ids(self) -> frozenset[bytes]:
        """The key ids this node admits rows under (format 1: INSECURE_ID)."""
        return frozenset({INSECURE_ID}) if self.keyring is None else self.keyring.ids

    def decode(self, value: bytes, namespace_id: str, key: bytes, payload_len: int) -> memoryview:
        """The payload of `value` if it is this namespace's row for `key` of
        `payload_len` bytes and authentic (format 1: intact); else VerifyError."""
        return self.admit(value, namespace_id, key, payload_len).payload

    def admit(self, value: bytes, namespace_id: str, key: bytes, payload_len: int) -> Admitted:
        """`decode`'s payload, the id of the key that verified it (what the row
        remembers, so that dropping the key drops it) and the row's chunk event."""
        if len(value) < _HEADER.size:
            raise VerifyError("truncated", f"{len(value)} bytes, shorter than the header")
        magic, version, _flags, ns_len, key_len, event_len, plen = _HEADER.unpack_from(value)
        if magic != MAGIC:
            raise VerifyError("bad_magic", "not a kvdepot value")
        if version != self.version:
            why = "old_format" if version < self.version else "bad_version"
            raise VerifyError(why, f"format version {version}, this node reads {self.version}")
        if event_len > MAX_CHUNK_EVENT_BYTES:
            raise VerifyError(
                "event_too_large",
                f"a chunk event of {event_len} bytes; at most {MAX_CHUNK_EVENT_BYTES} are kept",
            )
        ns = namespace_id.encode()
        at = self.header_bytes
        end = at + ns_len + key_len + event_len + plen
        if len(value) != end:
            raise VerifyError("truncated", f"{len(value)} bytes where the header says {end}")
        mv = memoryview(value)
        if bytes(mv[at : at + ns_len]) != ns:
            raise VerifyError("wrong_namespace", "the value belongs to another namespace")
        at += ns_len
        if bytes(mv[at : at + key_len]) != key:
            raise VerifyError("wrong_key", "the value belongs to another key")
        at += key_len
        event = mv[at : at + event_len]
        at += event_len
        if plen != payload_len:
            raise VerifyError(
                "wrong_length", f"{plen} payload bytes, the layout says {payload_len}"
            )
        payload = mv[at:]
        if self.keyring is None:
            (crc,) = _CRC.unpack_from(value, _HEADER.size)
            head = mv[: _HEADER.size]
            got = zlib.crc32(key, zlib.crc32(ns, zlib.crc32(head)))
            got = zlib.crc32(payload, zlib.crc32(event, got))
            if got != crc:
                raise VerifyError("bad_checksum", "the checksum does not match: corrupted")
            return Admitted(payload, INSECURE_ID, bytes(event))
        key_id = bytes(mv[_HEADER.size : _HEADER.size + _KEY_ID_BYTES])
        fk = self.keyring.by_id(key_id)
        if fk is None:
            raise VerifyError(
                "unknown_key", f"MAC made with key id {key_id.hex()}, a key this node lacks"
            )
        head_end = _HEADER.size + _KEY_ID_BYTES
        want = _mac(fk.mac_key, mv[:head_end], ns, key, event, payload)
        if not hmac.compare_digest(want, mv[head_end:HEADER_V2]):
            raise VerifyError("bad_mac", "the MAC does not match: forged or corrupted")
        return Admitted(payload, fk.id, bytes(event))


def _mac(mac_key: bytes, head: bytes | memoryview, ns: bytes, key: bytes, event, payload) -> bytes:
    """Keyed BLAKE3 (32 bytes) of the header, namespace, key, chunk event and payload,
    hashed in place (no concatenated copy); blake3 releases the GIL on large inputs.
    An empty event adds nothing: a row without one has the MAC older kvdepot gave it."""
    h = blake3(key=mac_key)
    h.update(head)
    h.update(ns)
    h.update(key)
    h.update(event)
    h.update(payload)
    return h.digest()
