"""BlockIndex: states, tensor-parallel rows, pins, LRU eviction, sessions, events."""

from __future__ import annotations

import pytest

from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import (
    BlockIndex,
    LayoutMismatch,
    SlotState,
    StoreOutcome,
    UnknownNamespace,
)
from kvdepot.server.core.kinds import DropReason, EventKind, EvictionReason
from kvdepot.server.core.layout import NamespaceLayout


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(slots: int = 4, world: int = 1, timeout: float = 60.0) -> tuple[BlockIndex, Clock]:
    clock = Clock()
    lay = NamespaceLayout("ns", world, 1, ((4096 // world,),))
    ix = BlockIndex(ExtentAllocator(slots * 4096), reservation_timeout=timeout, clock=clock)
    ix.declare_namespace(lay)
    return ix, clock


def store(ix: BlockIndex, k: bytes, rank: int = 0, owner: str = "s1") -> StoreOutcome:
    d = ix.begin_store("ns", k, rank, owner)
    if d.outcome is StoreOutcome.WRITE:
        assert d.slot is not None
        ix.finish_store(d.slot, rank, True)
    return d.outcome


def test_a_row_is_ready_only_when_every_rank_has_written() -> None:
    ix, _ = make(world=2)
    d0 = ix.begin_store("ns", key(1), 0, "rank0")
    assert ix.lookup("ns", [key(1)]) == [False]
    ix.finish_store(d0.slot, 0, True)
    assert ix.lookup("ns", [key(1)]) == [False]  # rank 1 missing
    assert ix.begin_read("ns", key(1)) is None
    assert ix.begin_store("ns", key(1), 0, "rank0").outcome is StoreOutcome.PRESENT
    d1 = ix.begin_store("ns", key(1), 1, "rank1")
    assert d1.slot is d0.slot
    assert ix.finish_store(d1.slot, 1, True)
    assert ix.lookup("ns", [key(1)]) == [True]
    assert [e.kind for e in ix.take_events()] == ["stored"]
    ix.check_invariants()


def test_lru_evicts_oldest_ready_unpinned_and_never_pinned() -> None:
    ix, _ = make(slots=3)
    for i in range(3):
        store(ix, key(i))
    ix.take_events()
    assert ix.pin("ns", [key(0)], "s1") == [True]
    assert store(ix, key(3)) is StoreOutcome.WRITE  # evicts key 1 (oldest unpinned)
    assert ix.lookup("ns", [key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    events = ix.take_events()
    assert [(e.kind, e.keys, e.reason) for e in events] == [
        (EventKind.REMOVED, (key(1),), EvictionReason.LRU),
        (EventKind.STORED, (key(3),), None),
    ]
    ix.check_invariants()


def test_reading_a_block_makes_it_young() -> None:
    ix, _ = make(slots=2)
    store(ix, key(0))
    store(ix, key(1))
    ix.end_read(ix.begin_read("ns", key(0)))
    store(ix, key(2))
    assert ix.lookup("ns", [key(0), key(1)]) == [True, False]


def test_store_is_dropped_when_everything_is_pinned() -> None:
    ix, _ = make(slots=2)
    store(ix, key(0))
    store(ix, key(1))
    ix.pin("ns", [key(0), key(1)], "s1")
    d = ix.begin_store("ns", key(2), 0, "s1")
    assert d.outcome is StoreOutcome.DROPPED and d.reason is DropReason.POOL_FULL
    assert "pinned" in d.reason.text
    assert ix.stats.dropped_stores[DropReason.POOL_FULL] == 1
    ix.unpin("ns", [key(0), key(1)], "s1")
    assert store(ix, key(2)) is StoreOutcome.WRITE
    ix.check_invariants()


def test_session_end_releases_pins_and_unfinished_rows() -> None:
    ix, _ = make(slots=4, world=2)
    d = ix.begin_store("ns", key(5), 0, "dead")
    ix.finish_store(d.slot, 0, True)
    store(ix, key(6), 0, "other")
    store(ix, key(6), 1, "other")
    ix.pin("ns", [key(6)], "dead")
    assert ix.allocator.used_bytes == 2 * 4096
    pins, rows = ix.release_owner("dead")
    assert (pins, rows) == (1, 1)
    assert ix.allocator.used_bytes == 4096  # only the ready row of "other"
    assert ix.lookup("ns", [key(5), key(6)]) == [False, True]
    ix.check_invariants()


def test_a_doomed_slot_is_freed_only_after_its_copy_ends() -> None:
    ix, _ = make(slots=2, world=2)
    d = ix.begin_store("ns", key(1), 0, "w")  # copy in flight
    ix.release_owner("w")
    assert ix.allocator.used_bytes == 4096  # still held: the copy may be writing
    assert ix.lookup("ns", [key(1)]) == [False]
    ix.finish_store(d.slot, 0, True)
    assert ix.allocator.used_bytes == 0
    ix.check_invariants()


def test_reservations_expire() -> None:
    ix, clock = make(world=2, timeout=10)
    d = ix.begin_store("ns", key(1), 0, "w")
    ix.finish_store(d.slot, 0, True)
    clock.now = 5
    assert ix.expire_reservations() == 0
    clock.now = 11
    assert ix.expire_reservations() == 1
    assert ix.allocator.used_bytes == 0
    ix.check_invariants()


def test_failed_copy_drops_the_row() -> None:
    ix, _ = make()
    d = ix.begin_store("ns", key(1), 0, "w")
    assert not ix.finish_store(d.slot, 0, False)
    assert ix.lookup("ns", [key(1)]) == [False] and ix.allocator.used_bytes == 0


def test_namespaces_are_isolated_and_layouts_cannot_change() -> None:
    ix, _ = make()
    store(ix, key(1))
    ix.declare_namespace(NamespaceLayout("other", 1, 1, ((1024,),)))
    assert ix.lookup("other", [key(1)]) == [False]
    with pytest.raises(LayoutMismatch):
        ix.declare_namespace(NamespaceLayout("ns", 1, 2, ((4096,),)))
    with pytest.raises(UnknownNamespace):
        ix.lookup("nope", [key(1)])


def test_admin_evict_skips_pinned_and_writing() -> None:
    ix, _ = make(slots=4)
    store(ix, key(1))
    store(ix, key(2))
    ix.begin_store("ns", key(3), 0, "w")
    ix.pin("ns", [key(2)], "s")
    assert ix.evict("ns") == (1, 2)
    assert ix.clear() == (0, 2)
    assert ix.namespaces["ns"].slots[key(3)].state is SlotState.WRITING
    ix.check_invariants()


def test_events_reach_the_subscriber_as_they_happen() -> None:
    """With on_event (the daemon's event bus), every change is announced at once;
    nothing waits for a caller to collect it."""
    seen: list[tuple[EventKind, bytes]] = []
    ix = BlockIndex(
        ExtentAllocator(2 * 4096, 4096), on_event=lambda e: seen.append((e.kind, e.keys[0]))
    )
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((4096,),)))
    store(ix, key(0))
    assert seen == [(EventKind.STORED, key(0))]
    store(ix, key(1))
    store(ix, key(2))  # evicts key 0
    assert seen[1:] == [
        (EventKind.STORED, key(1)),
        (EventKind.REMOVED, key(0)),
        (EventKind.STORED, key(2)),
    ]
    assert ix.take_events() == []
