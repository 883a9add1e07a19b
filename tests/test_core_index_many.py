"""BlockIndex.begin_store_many / finish_store_many: a store job's keys in one call
each way, with the decisions, evictions, events and rollback they promise."""

from __future__ import annotations

import pytest

from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex, IndexEvent, SlotState
from kvdepot.server.core.kinds import AbortReason, DropReason, EventKind, EvictionReason
from kvdepot.server.core.layout import LayoutError, NamespaceLayout

SLOT = 4096


def key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def make(slots: int = 4, world: int = 1) -> BlockIndex:
    ix = BlockIndex(ExtentAllocator(slots * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", world, 1, ((SLOT // world,),)))
    return ix


def fill(ix: BlockIndex, keys: list[bytes]) -> None:
    """Stores `keys` READY, a job each (so the first is the least recently used),
    and forgets the events."""
    for k in keys:
        claim = ix.begin_store_many("ns", [k], 0, "filler")
        assert ix.finish_store_many(claim.slots, 0, True) == 1
    ix.take_events()


def events(ix: BlockIndex) -> list[tuple[EventKind, tuple[bytes, ...], EvictionReason | None]]:
    return [(e.kind, e.keys, e.reason) for e in ix.take_events()]


def test_a_job_is_claimed_and_settled_in_one_call_each_way() -> None:
    ix = make(slots=4)
    fill(ix, [key(0)])
    claim = ix.begin_store_many("ns", [key(1), key(0), key(2), key(1)], 0, "s1")
    # key(0) is READY, the second key(1) is this rank's section already in flight.
    assert claim.present == 2 and claim.dropped == 0 and claim.drop_reason is None
    assert [s.key for s in claim.slots] == [key(1), key(2)]
    offsets = [s.extent.offset for s in claim.slots]
    assert claim.offsets == [offsets[0], None, offsets[1], None]
    assert len(set(offsets)) == 2
    assert ix.lookup("ns", [key(1), key(2)]) == [False, False]  # WRITING: invisible
    assert events(ix) == []
    ix.check_invariants()
    assert ix.finish_store_many(claim.slots, 0, True) == 2
    assert ix.lookup("ns", [key(0), key(1), key(2)]) == [True, True, True]
    assert events(ix) == [(EventKind.STORED, (key(1), key(2)), None)]  # one event, key order
    ix.check_invariants()


def test_room_is_made_from_the_lru_end_and_announced_before_the_call_returns() -> None:
    ix = make(slots=4)
    fill(ix, [key(i) for i in range(4)])
    assert ix.begin_read("ns", key(0)) is not None  # held: not evictable
    old = {k: s.extent.offset for k, s in ix.namespaces["ns"].slots.items()}
    claim = ix.begin_store_many("ns", [key(10), key(11)], 0, "s1")
    # Announced now, before any copy could land in the extents handed on.
    assert events(ix) == [(EventKind.REMOVED, (key(1), key(2)), EvictionReason.LRU)]
    assert claim.offsets == [old[key(1)], old[key(2)]]  # same size: the extents handed on
    assert ix.stats.evictions[EvictionReason.LRU] == 2
    ix.check_invariants()
    ix.finish_store_many(claim.slots, 0, True)
    assert ix.lookup("ns", [key(i) for i in (0, 1, 2, 3, 10, 11)]) == [
        True,
        False,
        False,
        True,
        True,
        True,
    ]
    ix.check_invariants()


def test_a_smaller_victim_is_freed_and_the_allocation_retried() -> None:
    # Group 0 rows are one unit, group 1 rows two: a group-1 store needs two
    # adjacent group-0 rows gone (freed and coalesced, not handed on).
    ix = BlockIndex(ExtentAllocator(4 * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,), (2 * SLOT,))))
    fill(ix, [key(i) for i in range(4)])
    claim = ix.begin_store_many("ns", [key(9, group=1)], 0, "s1")
    assert len(claim.slots) == 1 and claim.slots[0].extent.size == 2 * SLOT
    assert events(ix) == [(EventKind.REMOVED, (key(0), key(1)), EvictionReason.LRU)]
    ix.check_invariants()
    ix.finish_store_many(claim.slots, 0, True)
    ix.check_invariants()


def test_keys_with_no_room_are_dropped_and_counted() -> None:
    ix = make(slots=2)
    fill(ix, [key(0), key(1)])
    assert ix.pin("ns", [key(0), key(1)], "pinner") == [True, True]
    claim = ix.begin_store_many("ns", [key(5), key(1), key(6)], 0, "s1")
    assert (claim.slots, claim.offsets) == ([], [None, None, None])
    assert (claim.present, claim.dropped) == (1, 2)
    assert claim.drop_reason is DropReason.POOL_FULL
    assert ix.stats.dropped_stores[DropReason.POOL_FULL] == 2
    assert events(ix) == []
    assert ix.finish_store_many(claim.slots, 0, True) == 0
    ix.check_invariants()


def test_a_bad_key_or_rank_changes_nothing() -> None:
    ix = make(slots=2)
    fill(ix, [key(0), key(1)])  # a full pool: a claim would evict
    for keys, rank in (([key(5), b"abc"], 0), ([key(5), key(6, group=3)], 0), ([key(5)], 1)):
        with pytest.raises(LayoutError):
            ix.begin_store_many("ns", keys, rank, "s1")
    assert ix.lookup("ns", [key(0), key(1), key(5)]) == [True, True, False]
    assert events(ix) == [] and ix.stats.evictions[EvictionReason.LRU] == 0
    ix.check_invariants()


def test_rows_of_several_ranks_become_ready_when_the_last_rank_settles() -> None:
    ix = make(slots=4, world=2)
    first = ix.begin_store_many("ns", [key(1), key(2)], 0, "rank0")
    second = ix.begin_store_many("ns", [key(3), key(1), key(2)], 1, "rank1")
    assert second.slots[1:] == first.slots  # the rows rank 0 reserved
    assert second.offsets[1:] == first.offsets
    assert ix.begin_store_many("ns", [key(1)], 0, "rank0").present == 1  # in flight
    assert ix.finish_store_many(first.slots, 0, True) == 0
    assert ix.finish_store_many(second.slots, 1, True) == 2
    assert events(ix) == [(EventKind.STORED, (key(1), key(2)), None)]
    assert ix.namespaces["ns"].slots[key(3)].state is SlotState.WRITING  # rank 0 missing
    ix.check_invariants()


def test_a_failed_copy_drops_the_rows_and_frees_their_extents() -> None:
    ix = make(slots=4, world=2)
    other = ix.begin_store_many("ns", [key(1)], 1, "rank1")
    ix.finish_store_many(other.slots, 1, True)  # rank 1's half is written
    claim = ix.begin_store_many("ns", [key(1), key(2)], 0, "rank0")
    assert ix.finish_store_many(claim.slots, 0, False) == 0
    assert ix.namespaces["ns"].slots == {}
    assert ix.allocator.free_bytes == ix.allocator.capacity
    assert ix.stats.aborted_writes[AbortReason.COPY_FAILED] == 2
    assert events(ix) == []
    ix.check_invariants()


def test_a_row_doomed_during_the_copy_is_freed_when_the_copy_settles() -> None:
    ix = make(slots=4)
    claim = ix.begin_store_many("ns", [key(1), key(2)], 0, "gone")
    assert ix.release_owner("gone") == (0, 2)  # the session ended mid-copy
    assert ix.allocator.free_bytes < ix.allocator.capacity  # copies still in flight
    assert ix.finish_store_many(claim.slots, 0, True) == 0
    assert ix.allocator.free_bytes == ix.allocator.capacity
    assert ix.counts()["doomed"] == 0 and events(ix) == []
    ix.check_invariants()


class _Unhashable(bytes):
    """A key that passes the checks and then fails mid-claim (a stand-in for a bug)."""

    def __hash__(self) -> int:
        raise RuntimeError("boom")


def test_a_claim_that_fails_midway_settles_what_it_had_claimed() -> None:
    ix = make(slots=2)
    fill(ix, [key(0), key(1)])
    with pytest.raises(RuntimeError, match="boom"):
        ix.begin_store_many("ns", [key(5), _Unhashable(key(6))], 0, "s1")
    # key(5) was claimed (evicting key(0)); the failure dropped it again, and
    # the eviction that did happen was still announced.
    assert ix.lookup("ns", [key(0), key(1), key(5)]) == [False, True, False]
    assert ix.counts() == {"ready": 1, "writing": 0, "pinned": 0, "doomed": 0}
    assert events(ix) == [(EventKind.REMOVED, (key(0),), EvictionReason.LRU)]
    assert ix.stats.aborted_writes[AbortReason.COPY_FAILED] == 1
    ix.check_invariants()


def test_single_key_calls_keep_their_decisions() -> None:
    ix = make(slots=1)
    d = ix.begin_store("ns", key(1), 0, "s1")
    assert d.outcome == "write" and d.slot is not None
    again = ix.begin_store("ns", key(1), 0, "s1")
    assert again.outcome == "present" and again.slot is d.slot  # the slot, for Put
    assert ix.begin_store("ns", key(2), 0, "s1").reason is DropReason.POOL_FULL
    assert ix.finish_store(d.slot, 0, True) is True
    heard: list[IndexEvent] = ix.take_events()
    assert [(e.kind, e.keys) for e in heard] == [(EventKind.STORED, (key(1),))]
    ix.check_invariants()


def test_evictions_across_namespaces_are_announced_per_namespace() -> None:
    ix = BlockIndex(ExtentAllocator(3 * SLOT))
    for ns_id in ("a", "b"):
        ix.declare_namespace(NamespaceLayout(ns_id, 1, 1, ((SLOT,),)))
    for ns_id, k in (("a", key(0)), ("b", key(1)), ("a", key(2))):
        claim = ix.begin_store_many(ns_id, [k], 0, "filler")
        ix.finish_store_many(claim.slots, 0, True)
    ix.take_events()
    claim = ix.begin_store_many("b", [key(7), key(8), key(9)], 0, "s1")
    assert len(claim.slots) == 3
    assert sorted(events(ix)) == [
        (EventKind.REMOVED, (key(0), key(2)), EvictionReason.LRU),
        (EventKind.REMOVED, (key(1),), EvictionReason.LRU),
    ]
    assert ix.finish_store_many(claim.slots, 0, True) == 3
    assert events(ix) == [(EventKind.STORED, (key(7), key(8), key(9)), None)]
    ix.check_invariants()


def test_a_load_job_holds_its_keys_up_to_the_first_missing_one() -> None:
    ix = make(slots=4)
    fill(ix, [key(0), key(1), key(3)])
    held = ix.begin_read_many("ns", [key(0), key(1), key(2), key(3)])
    assert [s.key for s in held] == [key(0), key(1)]  # key(2) is the one not ready
    assert ix.namespaces["ns"].slots[key(3)].readers == 0  # nothing held past it
    # Held: a Clear evicts only the key not held.
    assert ix.clear() == (1, 2)
    for slot in held:
        ix.end_read(slot)
    assert ix.clear() == (2, 0)
    ix.check_invariants()


def test_a_claim_takes_the_job_checks_groups_and_checks_keys_without_them() -> None:
    ix = BlockIndex(ExtentAllocator(4 * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT // 2,), (SLOT,))))
    keys = [key(0, 0), key(1, 1)]
    claim = ix.begin_store_many("ns", keys, 0, "s1", groups=(0, 1))
    assert [s.group for s in claim.slots] == [0, 1]
    ix.finish_store_many(claim.slots, 0, True)
    ix.check_invariants()
    # Without them (or with a count that does not match) every key is checked again.
    with pytest.raises(LayoutError):
        ix.begin_store_many("ns", [key(2, 7)], 0, "s1", groups=(0, 1))


def test_a_removed_rows_chunk_event_leaves_with_its_removed_event() -> None:
    ix = make(slots=4)
    ns = ix.namespaces["ns"]
    for k in (key(0), key(1), key(2)):
        claim = ix.begin_store_many("ns", [k], 0, "s")
        ix.keep_chunk_events("ns", claim.slots, {key(0): b"e0", key(2): b"e2"})
        ix.finish_store_many(claim.slots, 0, True)
    fill(ix, [key(3)])
    assert (ns.chunk_event_rows, ns.chunk_event_bytes) == (2, 4)
    # Room made (LRU): the removed rows' chunk events, in key order, b"" for none.
    claim = ix.begin_store_many("ns", [key(10), key(11)], 0, "s1")
    [lru] = ix.take_events()
    assert (lru.kind, lru.keys, lru.chunk_events) == (
        EventKind.REMOVED,
        (key(0), key(1)),
        (b"e0", b""),
    )
    ix.finish_store_many(claim.slots, 0, True)
    assert ix.take_events()[0].chunk_events == ()  # STORED events carry none
    # Evicted by name: the row's, or none for a row that had none.
    ix.evict("ns", [key(2), key(3)], EvictionReason.ADMIN)
    assert [e.chunk_events for e in ix.take_events()] == [(b"e2",), ()]
    assert (ns.chunk_event_rows, ns.chunk_event_bytes) == (0, 0)
    ix.check_invariants()


def test_the_writing_floor_changes_no_decision_only_how_often_room_is_asked() -> None:
    """`writing_room` is asked only when a row would not fit under `writing_floor` less
    every WRITING row's bytes. The same series of store calls and settlements, by three
    owners (two of them one account, as the state counts them), with the floor (the fast
    path) and without it (0: asked at every call, as before) makes the same decisions:
    the same rows written, present and dropped, for the same reasons."""
    import random

    accounts = {"a1": ("a1", "a2"), "a2": ("a1", "a2"), "b": ("b",)}
    per_account, pool_held = 5 * SLOT, 7 * SLOT

    def run(floor: int) -> tuple[list[tuple[object, ...]], int]:
        ix = make(slots=12)
        asked = 0

        def room(owner: object) -> int:  # the state's quota (state.namespaces), by account
            nonlocal asked
            asked += 1
            mine = sum(map(ix.owner_writing_bytes, accounts[str(owner)]))
            return min(per_account - mine, pool_held - ix.writing_bytes())

        ix.writing_room = room
        ix.writing_floor = floor
        rng = random.Random(5)
        open_claims: list[list[object]] = []
        seen: list[tuple[object, ...]] = []
        for _ in range(400):
            if open_claims and rng.random() < 0.55:
                slots = open_claims.pop(rng.randrange(len(open_claims)))
                ix.finish_store_many(slots, 0, rng.random() < 0.9)  # type: ignore[arg-type]
                continue
            owner = rng.choice(list(accounts))
            keys = [key(k) for k in rng.sample(range(40), rng.randint(1, 4))]
            claim = ix.begin_store_many("ns", keys, 0, owner)
            seen.append(
                (
                    owner,
                    [o is not None for o in claim.offsets],
                    claim.present,
                    claim.dropped,
                    claim.drop_reason,
                )
            )
            open_claims.append(list(claim.slots))
            ix.check_invariants()
        return seen, asked

    slow, asked_always = run(0)
    fast, asked_under_floor = run(min(per_account, pool_held))
    assert fast == slow
    reasons = {s[4] for s in slow}
    assert DropReason.SESSION_QUOTA in reasons  # the quota bound, on both paths
    assert 0 < asked_under_floor < asked_always, (asked_under_floor, asked_always)
