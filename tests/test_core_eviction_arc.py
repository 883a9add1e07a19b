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
        p.insert([s])
        p.refresh(s)  # the touch of the request that stored it: still used once
    p.refresh(a)  # a later request reached a again
    assert (len(p), a in p) == (3, True)
    assert drain(p) == [b, c, a]


def test_a_pin_or_read_that_ends_is_a_use_and_admit_coldest_is_none() -> None:
    p = arc(4)
    a, b, c = slot(0), slot(1), slot(2)
    p.insert([a, b, c])
    p.withdraw(a)  # pinned for a load
    assert a not in p and list(p) == [b, c]
    p.admit(a)  # unpinned: used again
    p.withdraw(b)  # held by the disk tier's write
    p.admit_coldest(b)  # not a use: the next victim
    assert list(p) == [b, c, a] == drain(p)


def test_a_row_kept_in_place_stays_in_the_list_it_is_in() -> None:
    """A tier's write behind of a row just stored (BlockIndex.begin_keep) is no use:
    the row stays in T1, still waiting for its storing request's touch, and goes
    before a row loaded since."""
    ix = BlockIndex(ExtentAllocator(8 * SLOT), policy=ArcPolicy(8 * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,),)))
    keys = [key(i) for i in range(3)]
    claim = ix.begin_store_many("ns", keys, 0, "engine")
    ix.finish_store_many(claim.slots, 0, True)
    written = [ix.begin_keep("ns", k) for k in keys[:2]]  # the disk writes two rows
    ix.touch("ns", keys)  # the storing request's own touch, while they are written
    for kept in written:
        assert kept is not None
        ix.end_keep(kept)
    loaded = ix.begin_read("ns", keys[2])
    assert loaded is not None
    ix.end_read(loaded)  # a load: used again
    fresh = [key(i) for i in range(10, 17)]
    for k in fresh:  # rows used once fill the pool, then push two rows out
        claim = ix.begin_store_many("ns", [k], 0, "engine")
        ix.finish_store_many(claim.slots, 0, True)
    assert ix.lookup("ns", keys) == [False, False, True]  # written: used once
    assert ix.lookup("ns", fresh) == [True] * 7
    ix.check_invariants()


def test_rows_used_once_do_not_push_out_a_prefix_used_again_as_lru_does() -> None:
    """The shared-documents case: a document's rows reached again, then a burst of
    rows used once (questions on other documents); the pool holds 8 rows."""
    document = [slot(i) for i in range(4)]

    def flood(policy: ArcPolicy | LruPolicy) -> list[bool]:
        policy.insert(document[::-1])  # stored tail first
        for s in reversed(document):
            policy.refresh(s)  # the storing request's touch
        for s in reversed(document):
            policy.refresh(s)  # a later request reached it
        for q in range(100, 120):
            if len(policy) == 8:
                policy.pop_victim()
            question = slot(q)
            policy.insert([question])
            policy.refresh(question)
        return [s in policy for s in document]

    assert flood(arc(8)) == [True] * 4
    assert flood(LruPolicy()) == [False] * 4


def test_rows_used_again_beyond_their_share_go_after_the_rows_used_once() -> None:
    p = arc(4)
    used_again = [slot(i) for i in range(3)]
    p.insert(used_again[::-1])
    for s in reversed(used_again):
        p.refresh(s)
        p.refresh(s)  # T2, tail first: 2, 1, 0
    once = slot(9)
    p.insert([once])
    p.target = 3.0  # T2 may keep 4 - 3 = 1 row: its two oldest move to T1's young end
    assert drain(p) == [once, used_again[2], used_again[1], used_again[0]]


def test_ghost_hits_move_the_target_and_bring_the_rest_of_their_store_in_as_used_again() -> None:
    p = arc(2)
    a, b = slot(0), slot(1)
    p.insert([a, b])
    assert p.pop_victim() is a  # used once: a's ghost in B1
    # A store of four rows, tail first: rows 3, 2, then a again, then row 4 (before
    # it in the prompt): T1 evicted a too soon.
    tail, back, head = [slot(3), slot(2)], slot(0), slot(4)
    p.insert([*tail, back, head])
    assert p.target == 1
    assert drain(p) == [b, *tail, back, head]  # T1 first; a and what precedes it: T2
    # Now a's ghost is in B2 (it went from T2): stored again, it lowers the target.
    p.insert([slot(0)])
    assert p.target == 0
    assert p.pop_victim().key == key(0) and p.pop_victim() is None


def test_ghosts_are_bounded_by_the_capacity_in_rows() -> None:
    p = arc(4)
    for i in range(100):
        row = slot(i)
        p.insert([row])
        if i % 3 == 0:
            p.refresh(row)
            p.refresh(row)
        if len(p) > 4:
            p.pop_victim()
    assert len(p) == 4 and p.capacity_rows() == 4
    assert len(p._b1) <= 4 and len(p._b2) <= 4


def test_iteration_is_the_order_of_the_victims() -> None:
    p = arc(10)
    rows = [slot(i) for i in range(10)]
    p.insert(rows)
    for s in rows[::3]:
        p.refresh(s)
        p.refresh(s)  # used again: T2
    p.withdraw(rows[4])
    p.admit_coldest(rows[4])
    p.target = 7.0
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
