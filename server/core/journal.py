"""The crash journal's records: what makes a pool file's blocks survive a SIGKILL.

With `--pool-file`, the daemon appends a record to `<pool-file>.journal` for
every change a restart must know about, before anyone can hear of the change:

    HEADER  the pool's size and slot granularity (first record of a file)
    LAYOUT  a namespace's layout, before its first block
    READY   a block row became READY: namespace, key, offset, extent size, and
            its checksum when known (compaction writes it along)
    SUM     the checksum of a READY row, computed in the background after it
    EVENT   the chunk event of the READY row just listed (what routers index it by,
            Slot.chunk_event: at most MAX_CHUNK_EVENT_BYTES), so a recovered row
            publishes a complete event again
    FREED   a READY row was removed (its extent may be reused from now on)

A row being written has no record, so a restart never serves one. A row whose
extent was freed has a FREED record before anything else can be written there.
After a crash the daemon replays the journal (`replay`) and serves each row that
is still live and whose checksum matches the pool's bytes; a row without a
checksum (the crash came within moments of its store) or with one that does not
match is dropped. The checksum is CRC-32 (zlib) over the row's bytes
(`NamespaceLayout.slot_bytes`, not the extent's rounding).

Record format (integers little-endian): u32 payload length, u32 CRC-32 of the
payload, payload (a type byte, then the fields). Replay stops at the first torn,
damaged or malformed record (wrong sizes, missing fields, an unknown type): what
comes before it was written whole. Replay never raises but JournalError (not a
journal at all), so no journal can keep the daemon from starting.

This module is pure (encode, decode, replay); the file and the threads are in
kvdepot.server.memory.journal_file.

Format 2 added EVENT; a format-1 journal (an older kvdepot's) is still replayed,
its rows without events. An older kvdepot refuses a format-2 journal whole (it
starts empty) rather than stopping at the first EVENT record.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.snapshot import _layout_from_json, _layout_to_json

SUFFIX = ".journal"
FORMAT = 2
FORMATS = (1, 2)  # what replay reads
_FRAME = struct.Struct("<II")
_NS = struct.Struct("<H")
_READY = struct.Struct("<HQQBI")
_SUM = struct.Struct("<HI")
_EVENT = struct.Struct("<HH")  # namespace index, key length; then the key, the event
HEADER, LAYOUT, READY, SUM, FREED, EVENT = b"H", b"L", b"R", b"S", b"F", b"E"
MAX_NAMESPACES = 0xFFFF


class JournalError(ValueError):
    """The journal cannot be used (another pool, unknown format)."""


@dataclass
class Row:
    """A live READY row as the journal knows it."""

    offset: int
    size: int  # the extent's size
    crc: int | None = None
    chunk_event: bytes = b""  # the row's Slot.chunk_event (b"": none)


@dataclass
class JournalState:
    """What a journal says was READY when it ended."""

    pool_size: int = 0
    granularity: int = 0
    layouts: dict[str, NamespaceLayout] = field(default_factory=dict)
    rows: dict[tuple[str, bytes], Row] = field(default_factory=dict)  # oldest first
    records: int = 0
    torn_bytes: int = 0  # bytes after the last whole record (a write cut short)
    stopped: str = ""  # why the replay ended before the end of the file (if it did)


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def header(pool_size: int, granularity: int, boot_id: str) -> bytes:
    body = json.dumps(
        {"format": FORMAT, "pool_size": pool_size, "granularity": granularity, "boot_id": boot_id},
        separators=(",", ":"),
    ).encode()
    return _frame(HEADER + body)


def layout(ns_index: int, lay: NamespaceLayout) -> bytes:
    if ns_index > MAX_NAMESPACES:
        raise JournalError(f"more than {MAX_NAMESPACES} namespaces in one journal")
    body = json.dumps(_layout_to_json(lay), separators=(",", ":")).encode()
    return _frame(LAYOUT + _NS.pack(ns_index) + body)


def ready(ns_index: int, key: bytes, offset: int, size: int, crc: int | None = None) -> bytes:
    fields = _READY.pack(ns_index, offset, size, crc is not None, crc or 0)
    return _frame(READY + fields + key)


def listed(ns_index: int, key: bytes, row: Row) -> bytes:
    """A READY record of `row`, and its EVENT record when it has a chunk event."""
    out = ready(ns_index, key, row.offset, row.size, row.crc)
    return out + chunk_event(ns_index, key, row.chunk_event) if row.chunk_event else out


def chunk_event(ns_index: int, key: bytes, event: bytes) -> bytes:
    return _frame(EVENT + _EVENT.pack(ns_index, len(key)) + key + event)


def checksum(ns_index: int, key: bytes, crc: int) -> bytes:
    return _frame(SUM + _SUM.pack(ns_index, crc) + key)


def freed(ns_index: int, key: bytes) -> bytes:
    return _frame(FREED + _NS.pack(ns_index) + key)


# What a damaged record can raise while it is decoded (a crafted one included).
_DAMAGE = (
    struct.error,
    KeyError,
    TypeError,
    ValueError,  # SnapshotError, LayoutError, JSON and UTF-8 errors among them
    AttributeError,
    OverflowError,
    RecursionError,
)


class _Damaged(Exception):
    """A record that decodes but says something impossible."""


def _positive_int(value: object) -> bool:
    return type(value) is int and 0 < value < 1 << 63


def _header(body: memoryview) -> tuple[int, int]:
    """(pool size, granularity) from the first record; JournalError if it is not one."""
    try:
        head = json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        raise JournalError(f"not a kvdepot journal (its header is not JSON: {exc})") from None
    if not isinstance(head, dict):
        raise JournalError("not a kvdepot journal (its header is not a JSON object)")
    if head.get("format") not in FORMATS:
        raise JournalError(f"journal format {head.get('format')!r}, expected one of {FORMATS}")
    pool_size, granularity = head.get("pool_size"), head.get("granularity")
    if not (_positive_int(pool_size) and _positive_int(granularity)):
        raise JournalError("the journal's header lacks a valid pool_size and granularity")
    # both checked positive ints just above
    return pool_size, granularity  # type: ignore[return-value]


def _apply(st: JournalState, names: dict[int, str], kind: bytes, body: memoryview) -> None:
    """One record after the header; raises _Damaged or one of _DAMAGE."""
    if kind == LAYOUT:
        (i,) = _NS.unpack_from(body)
        lay = _layout_from_json(json.loads(bytes(body[_NS.size :])))
        names[i] = lay.id
        st.layouts[lay.id] = lay
    elif kind == READY:
        i, offset, size, has_crc, row_crc = _READY.unpack_from(body)
        if i not in names:
            raise _Damaged(f"a READY record names namespace #{i}, never declared")
        if has_crc not in (0, 1):
            raise _Damaged(f"a READY record has a checksum flag of {has_crc}")
        ident = (names[i], bytes(body[_READY.size :]))
        st.rows.pop(ident, None)  # re-stored: it moves to the young end
        st.rows[ident] = Row(offset, size, row_crc if has_crc else None)
    elif kind == SUM:
        i, row_crc = _SUM.unpack_from(body)
        row = st.rows.get((names.get(i, ""), bytes(body[_SUM.size :])))
        if row is not None:
            row.crc = row_crc
    elif kind == EVENT:
        i, klen = _EVENT.unpack_from(body)
        key = bytes(body[_EVENT.size : _EVENT.size + klen])
        event = bytes(body[_EVENT.size + klen :])
        if len(key) != klen or len(event) > MAX_CHUNK_EVENT_BYTES:
            raise _Damaged("an EVENT record is truncated or its event too large")
        row = st.rows.get((names.get(i, ""), key))
        if row is not None:
            row.chunk_event = event
    elif kind == FREED:
        (i,) = _NS.unpack_from(body)
        st.rows.pop((names.get(i, ""), bytes(body[_NS.size :])), None)
    else:
        raise _Damaged(f"unknown record type {bytes(kind)!r}")


def replay(data: bytes | memoryview) -> JournalState:
    """The rows a journal leaves live, oldest first.

    Never raises but JournalError, and that only for a file that is not a journal
    (no header record, a header without its fields, another format). A record
    that is torn, fails its CRC or does not decode ends the replay there
    (`stopped` says why): the rows before it are returned, and crash recovery
    still checks each against its checksum before serving it.
    """
    st = JournalState()
    names: dict[int, str] = {}
    view = memoryview(data)
    pos = 0
    while pos + _FRAME.size <= len(view):
        length, crc = _FRAME.unpack_from(view, pos)
        payload = view[pos + _FRAME.size : pos + _FRAME.size + length]
        if length == 0 or len(payload) != length or zlib.crc32(payload) != crc:
            if st.records:
                st.stopped = f"the record at byte {pos} is torn or fails its CRC"
            break
        kind, body = bytes(payload[:1]), payload[1:]
        if st.records == 0:
            if kind != HEADER:
                raise JournalError("not a kvdepot journal (no header record)")
            st.pool_size, st.granularity = _header(body)
        else:
            try:
                _apply(st, names, kind, body)
            except (_Damaged, *_DAMAGE) as exc:
                st.stopped = f"record {st.records + 1} at byte {pos} is malformed ({exc})"
                break
        st.records += 1
        pos += _FRAME.size + length
    else:
        if pos < len(view) and st.records:
            st.stopped = f"{len(view) - pos} byte(s) of a torn record at byte {pos}"
    st.torn_bytes = len(view) - pos
    if st.records == 0 and len(view):
        raise JournalError("not a kvdepot journal (its first record is damaged)")
    return st
