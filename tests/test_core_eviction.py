"""The eviction policy on its own (LruPolicy), and the index evicting what its policy says."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.eviction import EvictionPolicy, LruPolicy
from kvdepot.server.core.index import BlockIndex, Slot, StoreOutcome
from kvdepot.server.core.kinds import EventKind, EvictionReason
from kvdepot.server.core.layout import NamespaceLayout

SLOT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def slot(i: int) -> Slot:
    return Slot("ns", key(i), 0, Extent(i * SLOT, SLOT), 0.0)


def test_lru_gives_victims_oldest_admission_first() -> None:
    lru = LruPolicy()
    a, b, c = slot(0), slot(1), slot(2)
    for s in (a, b, c):
        lru.admit(s)
    assert (len(lru), list(lru), b in lru) == (3, [a, b, c], True)
    assert [lru.pop_victim(), lru.pop_victim()] == [a, b]
    assert (list(lru), a in lru) == ([c], False)


def test_a_withdrawn_row_is_never_a_victim_and_comes_back_as_the_latest_use() -> None:
    lru = LruPolicy()
    a, b, c = slot(0), slot(1), slot(2)
    for s in (a, b, c):
        lru.admit(s)
    lru.withdraw(a)  # pinned or read
    assert list(lru) == [b, c]
    lru.admit(a)  # unpinned or read done: used just now
    assert [lru.pop_victim() for _ in range(3)] == [b, c, a]


def test_an_empty_policy_has_no_victim_and_a_row_never_admitted_cannot_be_withdrawn() -> None:
    lru = LruPolicy()
    assert (lru.pop_victim(), len(lru), list(lru)) == (None, 0, [])
    with pytest.raises(KeyError):
        lru.withdraw(slot(0))


class NewestFirst:
    """A policy that evicts the most recently admitted row: not LRU, to show that
    the index evicts what its policy says."""

    def __init__(self) -> None:
        self._rows: list[Slot] = []
        self.admit = self._rows.append
        self.insert = self._rows.extend
        self.admit_coldest = self._rows.append  # the next victim: the last admitted
        self.withdraw = self._rows.remove

    def pop_victim(self) -> Slot | None:
        return self._rows.pop() if self._rows else None

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Slot]:
        return reversed(self._rows)

    def __contains__(self, row: object) -> bool:
        return row in self._rows


def test_the_index_evicts_its_policys_victims_and_spares_pinned_rows() -> None:
    policy: EvictionPolicy = NewestFirst()
    ix = BlockIndex(ExtentAllocator(3 * SLOT), policy=policy)
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,),)))
    for i in range(3):
        claim = ix.begin_store_many("ns", [key(i)], 0, "s1")
        ix.finish_store_many(claim.slots, 0, True)
    assert ix.pin("ns", [key(2)], "s1") == [True]  # the policy's first choice, held
    ix.take_events()
    assert ix.begin_store("ns", key(3), 0, "s1").outcome is StoreOutcome.WRITE
    assert [(e.kind, e.keys, e.reason) for e in ix.take_events()] == [
        (EventKind.REMOVED, (key(1),), EvictionReason.LRU)
    ]
    assert ix.lookup("ns", [key(0), key(1), key(2)]) == [True, False, True]
    assert ix.evictable_blocks == 1  # key 0; key 2 pinned, key 3 writing
    ix.check_invariants()


def test_a_row_kept_in_place_keeps_its_place_and_eviction_passes_over_it() -> None:
    """A tier writing a row behind (BlockIndex.begin_keep) is no use: the row stays
    where it was in the order, a touch still moves it, eviction takes the rows around
    it and, once the write is done, the row goes in its turn."""
    ix = BlockIndex(ExtentAllocator(3 * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,),)))
    for i in range(3):
        claim = ix.begin_store_many("ns", [key(i)], 0, "s1")
        ix.finish_store_many(claim.slots, 0, True)
    kept = ix.begin_keep("ns", key(0))
    assert kept is not None and [s.key for s in ix.coldest()] == [key(0), key(1), key(2)]
    assert ix.begin_keep("ns", key(9)) is None  # not in the pool
    assert ix.evict("ns", [key(0)]) == (0, 1)  # nor does Admin/Evict take it
    ix.take_events()
    assert ix.begin_store("ns", key(3), 0, "s1").outcome is StoreOutcome.WRITE
    assert [e.keys for e in ix.take_events()] == [(key(1),)]  # passed over key 0
    assert [s.key for s in ix.coldest()] == [key(0), key(2)]  # still the coldest
    ix.touch("ns", [key(0)])  # a request used it again meanwhile
    assert [s.key for s in ix.coldest()] == [key(2), key(0)]
    ix.end_keep(kept)
    ix.check_invariants()
    ix.take_events()
    assert ix.begin_store("ns", key(4), 0, "s1").outcome is StoreOutcome.WRITE
    assert [e.keys for e in ix.take_events()] == [(key(2),)]
    ix.check_invariants()


def test_rows_passed_over_go_back_to_the_cold_end_in_their_order() -> None:
    lru = LruPolicy()
    a, b, c = slot(0), slot(1), slot(2)
    for s in (a, b, c):
        lru.admit(s)
    lru.withdraw(b)
    lru.admit_coldest(b)
    assert list(lru) == [b, a, c]
