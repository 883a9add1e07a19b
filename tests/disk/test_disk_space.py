"""The disk tier's sans-I/O parts, directly: a record being read is never evicted
under it; a header page that is not a whole record header, written at that offset
under the record key, is never taken for one; a freed extent's header is
overwritten by the first record that reuses any of it."""

from __future__ import annotations

import os
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.core.kinds import DiskRemoval
from kvdepot.server.disk import checkpoint, record
from kvdepot.server.disk.record import PAGE, Header, RecordKey
from kvdepot.server.disk.space import DiskSpace, WriteVerdict
from tests.security.disk_forger import v1_header


def written(space: DiskSpace, key: bytes) -> None:
    verdict, entry = space.begin_write("ns", key, PAGE)
    assert verdict is WriteVerdict.ACCEPTED and entry is not None
    space.finish_write(entry, b"d" * 16)


def test_a_record_being_read_is_not_evicted_under_its_reader() -> None:
    space = DiskSpace(capacity=3 * 2 * PAGE, max_inflight_bytes=1 << 20)
    for k in (b"a", b"b", b"c"):
        written(space, k)
    reading = space.begin_read("ns", b"a")
    assert reading is not None
    space.begin_read("ns", b"b")  # b is now more recent than a, and free to go
    space.finish_read(space.begin_read("ns", b"b"), True)  # type: ignore[arg-type]
    written(space, b"d")  # needs room: c goes (a is held, though least recent)
    assert space.contains("ns", b"a") and not space.contains("ns", b"c")
    space.finish_read(reading, False)  # did not verify: dropped, its extent freed
    assert not space.contains("ns", b"a")
    written(space, b"e")
    space.allocator.check_invariants()
    assert space.counters.dropped_entries == 1


def test_a_touch_keeps_the_prefix_a_request_used_and_evicts_tails_first() -> None:
    """The disk keeps the pool's order: a request's records touched again outlive one
    never used again, its first chunk the youngest (kvdepot.server.disk.link.touch)."""
    space = DiskSpace(capacity=6 * 2 * PAGE, max_inflight_bytes=1 << 20)
    used, other = [b"u0", b"u1", b"u2"], [b"o0", b"o1", b"o2"]
    for k in used + other:
        written(space, k)
    assert space.touch("ns", [*used[:2], b"gone"]) == 2
    for k in (b"n0", b"n1", b"n2", b"n3"):
        written(space, k)  # 4 must go: u2 (not touched), then o0 to o2
    assert [space.contains("ns", k) for k in used + other] == [True, True, False] + [False] * 3
    written(space, b"n4")
    assert [space.contains("ns", k) for k in used[:2]] == [True, False]  # the tail first


def test_changes_name_every_record_written_and_dropped_in_order() -> None:
    """What the daemon announces on Watch as the disk's events (tier DISK)."""
    space = DiskSpace(capacity=2 * PAGE, max_inflight_bytes=1 << 20)  # one record
    written(space, b"x")  # before anyone follows: not collected
    got: list[tuple[str, bytes, DiskRemoval | None]] = []
    space.watch(got.extend)
    written(space, b"a")  # x goes for it (least recently used)
    reading = space.begin_read("ns", b"a")
    assert reading is not None
    space.finish_read(reading, False)  # did not verify
    written(space, b"b")
    written(space, b"c")  # b goes for it
    space.clear()  # the file was lost: c goes with it
    space.flush()
    L, R, LOST = DiskRemoval.LRU, DiskRemoval.REJECTED, DiskRemoval.LOST
    assert got == [
        ("ns", b"x", L), ("ns", b"a", None), ("ns", b"a", R), ("ns", b"b", None),
        ("ns", b"b", L), ("ns", b"c", None), ("ns", b"c", LOST),
    ]  # fmt: skip


def test_a_write_of_a_file_that_is_gone_changes_nothing() -> None:
    space = DiskSpace(capacity=4 * 2 * PAGE, max_inflight_bytes=1 << 20)
    verdict, entry = space.begin_write("ns", b"a", PAGE)
    assert entry is not None
    space.clear()  # the file was removed meanwhile
    space.finish_write(entry, b"d" * 16)
    assert not space.contains("ns", b"a") and space.used_bytes == 0


KEY = RecordKey(bytes(range(32)))
OTHER = RecordKey(bytes(32))


def test_a_header_round_trips_at_its_offset_under_its_key_only() -> None:
    page = memoryview(bytearray(PAGE))
    tag = KEY.payload_tag("ns-1", b"k" * 36, 8 * PAGE, b"x" * 12345)
    header = Header("ns-1", b"k" * 36, 12345, tag)
    record.encode_header(header, page, 8 * PAGE, KEY)
    assert record.decode_header(page, 8 * PAGE, KEY) == header
    assert header.record_size == PAGE + 4 * PAGE
    # The same bytes elsewhere in the file, or under another key, are not a header.
    assert record.decode_header(page, 9 * PAGE, KEY) is None
    assert record.decode_header(page, 8 * PAGE, OTHER) is None
    assert record.refusal(page) is record.Refusal.UNAUTHENTIC
    assert record.refusal(bytes(PAGE)) is None


def test_a_header_keeps_the_fleet_key_that_admitted_its_row() -> None:
    page = memoryview(bytearray(PAGE))
    header = Header("ns", b"key", 100, b"t" * 16, b"fleet-id")
    record.encode_header(header, page, 0, KEY)
    assert record.decode_header(page, 0, KEY) == header
    local = Header("ns", b"key", 100, b"t" * 16)
    record.encode_header(local, page, 0, KEY)
    assert record.decode_header(page, 0, KEY) == local != header
    with pytest.raises(record.RecordError, match="fleet key id"):
        record.encode_header(Header("ns", b"key", 100, b"t" * 16, b"short"), page, 0, KEY)


def version_2_header(header: Header, offset: int) -> bytes:
    """`header` as kvdepot wrote it before chunk events (record format version 2)."""
    ns = header.namespace.encode()
    fleet = header.admitted_by
    body = record._FIXED.pack(
        record.MAGIC, 2, len(ns), len(header.key), header.length, header.digest, len(fleet), fleet
    )
    body += ns + header.key
    body += KEY.header_tag(body, offset)
    return body + bytes(PAGE - len(body))


def test_a_header_keeps_its_rows_chunk_event_and_version_2_headers_still_read() -> None:
    """The chunk event (what routers index the row by) is in the header page, under
    its tag; one that does not fit beside the names is left out by the writer; a
    header of the format before (version 2) is read, without one."""
    page = memoryview(bytearray(PAGE))
    event = os.urandom(900)
    header = Header("ns", b"key", 100, b"t" * 16, b"", event)
    record.encode_header(header, page, PAGE, KEY)
    assert record.decode_header(page, PAGE, KEY) == header
    flipped = bytearray(page)
    flipped[record.NAMESPACE_AT + len("ns") + len(b"key") + 10] ^= 1  # in the event
    assert record.decode_header(bytes(flipped), PAGE, KEY) is None

    room = PAGE - record.NAMESPACE_AT - record.TAG_BYTES - len("ns") - len(b"key")
    assert record.fitting_event("ns", b"key", b"e" * room) == b"e" * room
    assert record.fitting_event("ns", b"key", b"e" * (room + 1)) == b""
    with pytest.raises(record.RecordError, match="does not fit"):
        record.encode_header(
            Header("ns", b"key", 100, b"t" * 16, b"", b"e" * (room + 1)), page, 0, KEY
        )
    record.encode_header(Header("ns", b"key", 100, b"t" * 16, b"", b"e" * room), page, 0, KEY)
    assert record.decode_header(page, 0, KEY).chunk_event == b"e" * room  # type: ignore[union-attr]

    old = Header("ns", b"key", 100, b"t" * 16, b"fleet-id")
    page2 = version_2_header(old, 3 * PAGE)
    assert record.decode_header(page2, 3 * PAGE, KEY) == old
    assert record.decode_header(page2, 4 * PAGE, KEY) is None  # still bound to its offset


def test_a_checkpoint_keeps_chunk_events_and_version_2_ones_are_still_taken() -> None:
    identity = (1, 2, 3, 4)
    items = [
        ("ns", b"a", 0, 100, b"d" * 16, b"", os.urandom(300)),
        ("ns", b"b", 2 * PAGE, 100, b"e" * 16, b"fleet-id", b""),
    ]
    assert checkpoint.decode(checkpoint.encode(identity, items), identity) == items
    # Version 2: no event length, no event.
    body = b""
    for ns, k, offset, length, digest, fleet, _ in items:
        body += checkpoint._ENTRY.pack(len(ns), len(k), offset, length, digest, len(fleet), fleet)
        body += ns.encode() + k
    data = checkpoint._HEAD.pack(checkpoint.MAGIC, 2, *identity, len(items)) + body
    data += struct.pack("<I", zlib.crc32(data))
    assert checkpoint.decode(data, identity) == [(*item[:6], b"") for item in items]


def test_the_payload_tag_binds_namespace_key_offset_and_key() -> None:
    base = KEY.payload_tag("ns", b"key", PAGE, b"payload")
    assert len(base) == record.DIGEST_BYTES
    assert base == KEY.payload_tag("ns", b"key", PAGE, memoryview(b"payload"))
    others = {
        KEY.payload_tag("nt", b"key", PAGE, b"payload"),
        KEY.payload_tag("ns", b"kez", PAGE, b"payload"),
        KEY.payload_tag("ns", b"key", 2 * PAGE, b"payload"),
        KEY.payload_tag("ns", b"key", PAGE, b"payloaD"),
        KEY.payload_tag("nsk", b"ey", PAGE, b"payload"),  # the framing tells them apart
        OTHER.payload_tag("ns", b"key", PAGE, b"payload"),
    }
    assert base not in others and len(others) == 6
    assert repr(KEY) == "RecordKey(...)"  # never the secret in a log


def test_a_header_of_the_format_before_keys_is_refused_as_old() -> None:
    """What the forger of tests/security/test_disk_forgery.py writes: version 1, an
    unkeyed digest and a CRC that anyone computes."""
    page = v1_header("ns", b"key", b"\xee" * 100)
    assert record.decode_header(page, 0, KEY) is None
    assert record.refusal(page) is record.Refusal.OLD_FORMAT


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 80), st.integers(0, 255), st.sampled_from([PAGE, PAGE - 1, 100, 0]))
def test_a_damaged_or_short_header_is_never_taken_for_one(at: int, value: int, cut: int) -> None:
    page = bytearray(PAGE)
    record.encode_header(Header("ns", b"key", 5, b"\1" * 16), memoryview(page), 0, KEY)
    original = bytes(page)
    page[at] = value
    found = record.decode_header(bytes(page[:cut]) if cut < PAGE else bytes(page), 0, KEY)
    used = len(original.rstrip(b"\0"))  # the header's bytes, its tag last
    if cut < PAGE or (at < used and page[at] != original[at]):
        assert found is None
    else:
        assert found is not None  # the page's unused tail is not checked
    assert record.decode_header(os.urandom(PAGE), 0, KEY) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 3)), min_size=1, max_size=80))
def test_the_first_reuse_of_a_freed_extent_overwrites_its_header(
    ops: list[tuple[int, int]],
) -> None:
    """An evicted (or dropped) record's header page is covered by the first record
    placed over any part of its extent, so its header never survives in front of a
    newer record: no write is needed to wipe it (docs/disk-tier.md)."""
    space = DiskSpace(capacity=24 * PAGE, max_inflight_bytes=1 << 30)
    stale: dict[int, int] = {}  # header offset -> extent size of freed records
    n = 0
    for pages, action in ops:
        items = space.ready_items()
        before = {(i[0], i[1]): (i[2], record.record_size(i[3])) for i in items}
        if action == 3 and before:  # a read that does not verify: dropped and freed
            ident = next(iter(before))
            entry = space.begin_read(*ident)
            assert entry is not None
            space.finish_read(entry, False)
            stale[before[ident][0]] = before[ident][1]
            continue
        n += 1
        verdict, entry = space.begin_write("ns", n.to_bytes(4, "big"), pages * PAGE - 1)
        after = {(ns, k) for ns, k, *_ in space.ready_items()}
        for ident in before.keys() - after:  # evicted for it
            stale[before[ident][0]] = before[ident][1]
        if entry is None:
            continue
        start, end = entry.offset, entry.offset + entry.size
        for header, size in list(stale.items()):
            if header < end and start < header + size:  # it reuses that extent
                assert start <= header < end, (header, size, start, end)
                del stale[header]
        space.finish_write(entry, b"d" * 16)
    space.allocator.check_invariants()
