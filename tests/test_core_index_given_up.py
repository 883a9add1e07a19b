"""Rows given up: a TP > 1 row that some rank dropped (or that was dropped unfinished)
is not begun again by a mate that comes later, since it could never be whole.

Before, the later rank began the row, it held its extent as WRITING until the
reservation timeout, and under pressure such rows filled the pool (the control-plane
ceiling at TP=8 then dropped every store of its load set and failed its loads)."""

from __future__ import annotations

import pytest

from kvdepot.server.core import index_writes
from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.kinds import AbortReason, DropReason
from kvdepot.server.core.layout import NamespaceLayout

SLOT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(slots: int, world: int, clock: Clock | None = None) -> BlockIndex:
    ix = BlockIndex(ExtentAllocator(slots * SLOT), clock=clock or Clock())
    ix.declare_namespace(NamespaceLayout("ns", world, 1, ((SLOT // world,),)))
    return ix


def store(ix: BlockIndex, rank: int, keys: list[bytes], ok: bool = True) -> tuple[int, int, int]:
    """One rank's store job, claimed and settled: (written, present, dropped)."""
    claim = ix.begin_store_many("ns", keys, rank, f"rank{rank}")
    ix.finish_store_many(claim.slots, rank, ok)
    return len(claim.slots), claim.present, claim.dropped


def test_a_row_a_rank_dropped_is_not_begun_by_its_mate_and_the_pool_does_not_clog() -> None:
    """TP=2, a pool of 4 rows; rank 0 runs ahead of rank 1 by two keys."""
    ix = make(slots=4, world=2)
    keys = [key(i) for i in range(6)]
    # Rank 0 writes its half of rows 0..3 (the pool is full of WRITING rows) and
    # drops keys 4 and 5: nothing is evictable.
    assert store(ix, 0, keys) == (4, 0, 2)
    assert ix.stats.dropped_stores[DropReason.POOL_FULL] == 2
    # Rank 1 completes rows 0..3 (now READY, evictable), then comes to keys 4 and 5.
    assert store(ix, 1, keys[:4]) == (4, 0, 0)
    assert store(ix, 1, keys[4:]) == (0, 0, 2)
    assert ix.stats.dropped_stores[DropReason.ROW_GIVEN_UP] == 2
    ns = ix.namespaces["ns"]
    # No row was begun that rank 0 would never write: nothing WRITING, nothing
    # evicted for it, every whole row still there, and the marks are gone (both
    # ranks have passed).
    assert ns.writing_blocks == 0
    assert ix.lookup("ns", keys) == [True] * 4 + [False] * 2
    assert ix.stats.evictions.total() == 0
    assert ns.given_up == {}
    ix.check_invariants()


def test_the_rank_that_gave_a_row_up_may_store_it_again() -> None:
    ix = make(slots=1, world=2)
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    assert store(ix, 0, [key(1)]) == (0, 0, 1)  # pool full: rank 0 gives key 1 up
    assert store(ix, 1, [key(0)]) == (1, 0, 0)  # row 0 whole, evictable
    # Rank 0 comes for key 1 again (a later step stores it anew): a new attempt,
    # and its mate, coming after, joins the row.
    assert store(ix, 0, [key(1)]) == (1, 0, 0)
    assert ix.namespaces["ns"].given_up == {}
    assert store(ix, 1, [key(1)]) == (1, 0, 0)
    assert ix.lookup("ns", [key(0), key(1)]) == [False, True]  # row 0 made room
    assert ix.stats.dropped_stores[DropReason.ROW_GIVEN_UP] == 0
    ix.check_invariants()


def test_a_row_dropped_unfinished_is_given_up_for_the_ranks_still_to_come() -> None:
    """TP=4: rank 0 wrote, rank 1's copy failed; ranks 2 and 3 would begin a row
    that ranks 0 and 1 never come back to."""
    ix = make(slots=4, world=4)
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    assert store(ix, 1, [key(0)], ok=False) == (1, 0, 0)
    assert ix.stats.aborted_writes[AbortReason.COPY_FAILED] == 1
    assert ix.namespaces["ns"].given_up[key(0)].mask == 0b0011
    assert store(ix, 2, [key(0)]) == (0, 0, 1)
    assert ix.namespaces["ns"].given_up[key(0)].mask == 0b0111
    assert store(ix, 3, [key(0)]) == (0, 0, 1)
    assert ix.namespaces["ns"].given_up == {}  # every rank has passed
    assert ix.namespaces["ns"].writing_blocks == 0
    assert ix.stats.dropped_stores[DropReason.ROW_GIVEN_UP] == 2
    ix.check_invariants()


def test_marks_are_forgotten_after_the_reservation_timeout() -> None:
    clock = Clock()
    ix = make(slots=1, world=2, clock=clock)
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    assert store(ix, 0, [key(1)]) == (0, 0, 1)
    clock.now += 30
    assert ix.expire_reservations() == 0
    assert key(1) in ix.namespaces["ns"].given_up
    clock.now += 31  # 61 s after the mark; row 0 (rank 1 never came) expires too
    assert ix.expire_reservations() == 1
    assert ix.namespaces["ns"].given_up == {key(0): ix.namespaces["ns"].given_up[key(0)]}
    clock.now += 61
    ix.expire_reservations()
    assert ix.namespaces["ns"].given_up == {}
    # With the marks gone, rank 1 begins key 1 as any first rank would.
    assert store(ix, 1, [key(1)]) == (1, 0, 0)
    ix.check_invariants()


def test_marks_are_bounded_oldest_forgotten_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_writes, "MAX_GIVEN_UP", 2)
    ix = make(slots=1, world=2)
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    assert store(ix, 0, [key(1), key(2), key(3)]) == (0, 0, 3)
    assert list(ix.namespaces["ns"].given_up) == [key(2), key(3)]
    ix.check_invariants()


def test_one_rank_namespaces_keep_no_marks() -> None:
    ix = make(slots=1, world=1)
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    ix.begin_read("ns", key(0))  # held: the pool has no room
    assert store(ix, 0, [key(1)]) == (0, 0, 1)
    assert ix.namespaces["ns"].given_up == {}
    ix.check_invariants()


def test_a_tier_claims_whole_rows_over_a_mark_and_leaves_none() -> None:
    """The disk and remote tiers claim every rank's section of a row at once (an
    internal writer): a mark does not stop them, and their own drops leave none."""
    ix = make(slots=1, world=2)
    ix.internal_writers = {"tier"}
    assert store(ix, 0, [key(0)]) == (1, 0, 0)
    assert store(ix, 1, [key(1)]) == (0, 0, 1)  # rank 1 gives key 1 up (pool full)
    # The tier's rank-0 claim of key 2 finds no room either: no mark for it.
    assert ix.begin_store_many("ns", [key(2)], 0, "tier").dropped == 1
    assert list(ix.namespaces["ns"].given_up) == [key(1)]
    assert store(ix, 1, [key(0)]) == (1, 0, 0)  # row 0 whole, evictable
    # The tier fetches key 1 whole: every rank's section claimed, then settled.
    claims = [ix.begin_store_many("ns", [key(1)], rank, "tier") for rank in (0, 1)]
    assert [len(c.slots) for c in claims] == [1, 1]
    assert key(1) not in ix.namespaces["ns"].given_up
    for rank, c in enumerate(claims):
        ix.finish_store_many(c.slots, rank, True)
    assert ix.lookup("ns", [key(1)]) == [True]
    ix.check_invariants()
