"""`TouchesAfterWrites` (kvdepot.server.core.touch_order), sans-I/O: a touch that names
a row still to write comes back once every such row is settled, and only then."""

from __future__ import annotations

from kvdepot.server.core.touch_order import TouchesAfterWrites


def test_a_touch_of_rows_all_written_is_not_kept() -> None:
    t = TouchesAfterWrites()
    assert t.touched("ns", [b"a", b"b"]) == []
    t.noted(("ns", b"c"))
    assert t.touched("ns", [b"a", b"b"]) == []
    assert t.touched("other", [b"c"]) == []  # another namespace's row of that name
    assert t.waiting == 0


def test_a_touch_comes_back_once_its_last_row_is_written() -> None:
    t = TouchesAfterWrites()
    for key in (b"b", b"c"):
        t.noted(("ns", key))
    assert t.touched("ns", [b"a", b"b", b"c"]) == []
    assert t.waiting == 1
    assert t.settled(("ns", b"c")) == []  # b is still being written
    assert t.settled(("ns", b"b")) == [("ns", [b"a", b"b", b"c"])]
    assert t.waiting == 0
    assert t.settled(("ns", b"b")) == []  # settled once more: nothing left to hand back


def test_touches_come_back_oldest_first_and_a_row_noted_twice_settles_twice() -> None:
    t = TouchesAfterWrites()
    t.noted(("ns", b"a"))
    t.noted(("ns", b"a"))  # stored again (evicted, recomputed) before its first write ended
    t.touched("ns", [b"a"])
    t.touched("ns", [b"b", b"a"])
    assert t.settled(("ns", b"a")) == []
    assert t.settled(("ns", b"a")) == [("ns", [b"a"]), ("ns", [b"b", b"a"])]


def test_past_the_bound_the_oldest_touch_is_due_as_it_stands() -> None:
    t = TouchesAfterWrites(max_touches=2)
    t.noted(("ns", b"x"))
    assert t.touched("ns", [b"x", b"1"]) == []
    assert t.touched("ns", [b"x", b"2"]) == []
    assert t.touched("ns", [b"x", b"3"]) == [("ns", [b"x", b"1"])]
    assert t.waiting == 2
    assert t.settled(("ns", b"x")) == [("ns", [b"x", b"2"]), ("ns", [b"x", b"3"])]


def test_what_it_keeps_is_bounded_even_behind_a_touch_that_never_settles() -> None:
    """Touches handed back behind one still kept are forgotten once it goes; past the
    bound the oldest goes as it stands, so memory stays bounded whatever never settles."""
    t = TouchesAfterWrites(max_touches=3)
    t.noted(("ns", b"stuck"))
    assert t.touched("ns", [b"stuck"]) == []
    handed_back = []
    for i in range(10):  # each handed back at once, behind the stuck one
        row = ("ns", bytes([i]))
        t.noted(row)
        handed_back += t.touched("ns", [row[1]])
        assert t.settled(row) == [("ns", [row[1]])]
        assert len(t._kept) <= 3
    assert handed_back == [("ns", [b"stuck"])]  # made room, as it stood
    assert t.settled(("ns", b"stuck")) == []  # not handed back twice
    assert t.waiting == 0 and not t._kept
