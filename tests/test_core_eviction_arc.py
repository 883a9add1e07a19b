"""ArcPolicy on its own, and the index evicting what it says (kvdepot.server.core.eviction)."""

from __future__ import annotations

import random

import pytest

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.eviction import ArcPolicy, LruPolicy, make_policy
from kvdepot.server.core.index import BlockIndex, Slot
from kvdepot.server.core.layout import NamespaceLayout

SLOT = 4096


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def slot(i: int) -> Slot:
    return Slot("ns", key(i), 0, Extent(i * SLOT, SLOT), 0.0)


def arc(rows: int) -> ArcPolicy:
    return ArcPolicy(rows * SLOT)


def drain(policy: ArcPolicy | LruPolicy) -> list[Slot]:
    out = []
    while (victim := policy.pop_victim()) is not None:
        out.append(victim)
    return out


def test_a_row_used_once_goes_before_a_row_used_again() -> None:
    p = arc(4)
    a, b, c = slot(0), slot(1), slot(2)
    for s in (a, b, c):
        p.insert(s)
        p.refresh(s)  # the touch of the request that stored it: still used once
    p.refresh(a)  # a later request reached a again
    assert (len(p), a in p) == (3, True)
    assert drain(p) == [b, c, a]  # T1 (b, c) first while it holds >= target rows


def test_a_pin_or_read_that_ends_is_a_use_and_admit_coldest_is_none() -> None:
    p = arc(4)
    a, b, c = slot(0), slot(1), slot(2)
    for s in (a, b, c):
        p.insert(s)
    p.withdraw(a)  # pinned for a load
    assert a not in p and list(p) == [b, c]
    p.admit(a)  # unpinned: used again
    p.withdraw(b)  # held by the disk tier's write
    p.admit_coldest(b)  # not a use: the next victim
    assert list(p) == [b, c, a] == drain(p)


def test_rows_used_once_do_not_push_out_a_prefix_used_again_as_lru_does() -> None:
    """The shared-documents case: a document's rows reached by every request, and each
    request's own question (a row used once); the pool holds 8 rows."""
    document = [slot(i) for i in range(4)]

    def replay(policy: ArcPolicy | LruPolicy) -> bool:
        for s in reversed(document):  # stored tail first, then reached again
            policy.insert(s)
        for s in reversed(document):
            policy.refresh(s)
        for q in range(100, 140):
            for s in reversed(document):  # the next request reaches the document
                policy.refresh(s)
            question = slot(q)
            if len(policy) == 8:
                policy.pop_victim()
            policy.insert(question)
            policy.refresh(question)
        return all(s in policy for s in document)

    assert replay(arc(8))
    assert replay(LruPolicy())  # LRU keeps it too while every request reaches it...

    def flood(policy: ArcPolicy | LruPolicy) -> list[bool]:
        for s in reversed(document):
            policy.insert(s)
            policy.refresh(s)
        for s in reversed(document):
            policy.refresh(s)  # reached again: used twice
        for q in range(100, 120):  # ...but a burst of questions on other documents
            if len(policy) == 8:
                policy.pop_victim()
            policy.insert(slot(q))
        return [s in policy for s in document]

    assert flood(arc(8)) == [True] * 4
    assert flood(LruPolicy()) == [False] * 4


def test_a_ghost_hit_moves_the_target_and_the_row_comes_back_as_used_again() -> None:
    p = arc(2)
    a, b, c = slot(0), slot(1), slot(2)
    p.insert(a)
    p.insert(b)
    assert p.pop_victim() is a  # a's ghost in B1
    p.insert(c)
    assert p.target == 0
    back = slot(0)  # a stored again: T1 evicted it too soon
    p.insert(back)
    assert p.target == 1 and back in p
    p.withdraw(b)  # T1 is c alone: one row, the target; T2 is a
    assert p.pop_victim() is c
    p.insert(slot(3))
    # T1 (row 3) below... at the target: T1's row goes; then T2's, whose ghost goes to B2.
    assert p.pop_victim().key == key(3)
    assert p.pop_victim() is back
    p.insert(slot(0))  # a's ghost in B2 now: T2 evicted it too soon
    assert p.target == 0


def test_ghosts_are_bounded_by_the_capacity_in_rows() -> None:
    p = arc(4)
    for i in range(100):
        p.insert(slot(i))
        if len(p) > 4:
            p.pop_victim()
    assert len(p) == 4 and p.capacity_rows() == 4
    assert len(p._b1) <= 4 and len(p._b2) <= 4


def test_iteration_is_the_order_of_the_victims() -> None:
    p = arc(10)
    rows = [slot(i) for i in range(10)]
    for s in rows:
        p.insert(s)
    for s in rows[::3]:
        p.refresh(s)
        p.refresh(s)  # used again: T2
    p.withdraw(rows[4])
    p.admit_coldest(rows[4])
    p.target = 3.0
    order = list(p)
    assert order == drain(p) and len(order) == 10


def test_an_unknown_row_is_a_key_error_and_an_unknown_policy_a_value_error() -> None:
    p = arc(4)
    with pytest.raises(KeyError):
        p.withdraw(slot(0))
    with pytest.raises(KeyError):
        p.refresh(slot(0))
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make_policy("mru", 1 << 20)
    assert isinstance(make_policy("lru", 1 << 20), LruPolicy)
    assert isinstance(make_policy("arc", 1 << 20), ArcPolicy)


# -- in the index --------------------------------------------------------------------------


def prompt_key(prompt: int, chunk: int) -> bytes:
    return prompt.to_bytes(16, "big") + chunk.to_bytes(16, "big") + (0).to_bytes(4, "big")


def make(slots: int) -> BlockIndex:
    ix = BlockIndex(ExtentAllocator(slots * SLOT), policy=ArcPolicy(slots * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,),)))
    return ix


def store(ix: BlockIndex, keys: list[bytes]) -> None:
    claim = ix.begin_store_many("ns", keys, 0, "engine")
    ix.finish_store_many(claim.slots, 0, True)


def test_a_request_s_rows_leave_tail_first_and_a_prefix_loaded_again_stays() -> None:
    ix = make(slots=12)
    p1 = [prompt_key(1, c) for c in range(6)]
    store(ix, p1)
    ix.touch("ns", p1)  # the request ends
    # A second request loads p1's first 4 chunks (pin, read, unpin) and stores 2 more.
    assert ix.pin("ns", p1[:4], "scheduler") == [True] * 4
    ix.end_read_many(ix.begin_read_many("ns", p1[:4]))
    ix.unpin("ns", p1[:4], "scheduler")
    p2 = [*p1[:4], prompt_key(2, 4), prompt_key(2, 5)]
    store(ix, p2[4:])
    ix.touch("ns", p2)
    # T1 holds p1's 2 unused chunks and p2's own 2, T2 the shared 4: 8 fresh rows push
    # out T1, tails first, never the shared prefix.
    store(ix, [prompt_key(3, c) for c in range(8)])
    ready = ix.lookup("ns", p2)
    assert ready == [True] * 4 + [False] * 2
    assert ix.lookup("ns", p1) == [True] * 4 + [False] * 2
    ix.check_invariants()


def test_the_index_with_arc_keeps_its_invariants_under_a_random_mix() -> None:
    rng = random.Random(3)
    ix = make(slots=40)
    pinned: dict[bytes, int] = {}
    for _ in range(3000):
        prompt = rng.randrange(30)
        keys = [prompt_key(prompt, c) for c in range(rng.randint(1, 8))]
        op = rng.random()
        if op < 0.4:
            store(ix, keys)
        elif op < 0.6:
            ok = ix.pin("ns", keys, "scheduler")
            for k, pin in zip(keys, ok, strict=True):
                if pin:
                    pinned[k] = pinned.get(k, 0) + 1
        elif op < 0.75 and pinned:
            k = rng.choice(list(pinned))
            ix.unpin("ns", [k], "scheduler")
            pinned[k] -= 1
            if not pinned[k]:
                del pinned[k]
        elif op < 0.9:
            ix.touch("ns", keys)
        else:
            held = ix.begin_read_many("ns", keys)
            ix.end_read_many(held)
        ix.take_events()
    ix.check_invariants()
    assert ix.evictable_blocks + sum(1 for _ in pinned) <= 40
