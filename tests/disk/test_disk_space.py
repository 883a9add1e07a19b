"""The disk tier's sans-I/O parts, directly: a record being read is never evicted
under it; a header page that is not a whole record header is never taken for one."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.core.kinds import DiskRemoval
from kvdepot.server.disk import record
from kvdepot.server.disk.record import PAGE, Header
from kvdepot.server.disk.space import DiskSpace, WriteVerdict


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


def test_a_header_round_trips() -> None:
    page = memoryview(bytearray(PAGE))
    header = Header("ns-1", b"k" * 36, 12345, record.digest("ns-1", b"k" * 36, b"x" * 12345))
    record.encode_header(header, page)
    assert record.decode_header(page) == header
    assert header.record_size == PAGE + 4 * PAGE


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 80), st.integers(0, 255), st.sampled_from([PAGE, PAGE - 1, 100, 0]))
def test_a_damaged_or_short_header_is_never_taken_for_one(at: int, value: int, cut: int) -> None:
    page = bytearray(PAGE)
    record.encode_header(Header("ns", b"key", 5, b"\1" * 16), memoryview(page))
    original = bytes(page)
    page[at] = value
    found = record.decode_header(bytes(page[:cut]) if cut < PAGE else bytes(page))
    used = len(original.rstrip(b"\0"))  # the header's bytes, its CRC last
    if cut < PAGE or (at < used and page[at] != original[at]):
        assert found is None
    else:
        assert found is not None  # the page's unused tail is not checked
    assert record.decode_header(os.urandom(PAGE)) is None
