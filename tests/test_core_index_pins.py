"""Pins and unpins on the index directly, against a model: any sequence of pins,
unpins (of keys pinned, pinned twice, never pinned, absent), reads and stores by
several owners leaves each owner holding what the model says, the counters and
eviction order consistent (BlockIndex.check_invariants), and no pinned row evicted."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.layout import NamespaceLayout

SLOT = 4096
ROWS = 6
OWNERS = ("s1", "s2")


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def store(ix: BlockIndex, i: int) -> None:
    claim = ix.begin_store_many("ns", [key(i)], 0, "writer")
    ix.finish_store_many(claim.slots, 0, True)


keys = st.lists(st.integers(0, ROWS + 2), max_size=8)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("pin"), st.sampled_from(OWNERS), keys),
        st.tuples(st.just("unpin"), st.sampled_from(OWNERS), keys),
        st.tuples(st.just("read"), st.just(""), keys),
        st.tuples(st.just("store"), st.just(""), keys),
        st.tuples(st.just("release"), st.sampled_from(OWNERS), st.just([])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_pins_and_unpins_keep_the_model(script: list[tuple[str, str, list[int]]]) -> None:
    ix = BlockIndex(ExtentAllocator(ROWS * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, ((SLOT,),)))
    for i in range(ROWS):
        store(ix, i)
    ns = ix.namespaces["ns"]
    model: dict[str, Counter[int]] = {o: Counter() for o in OWNERS}
    for op, owner, numbers in script:
        if op == "pin":
            pinned = ix.pin("ns", [key(i) for i in numbers], owner)
            for i, ok in zip(numbers, pinned, strict=True):
                assert ok == ix.lookup("ns", [key(i)])[0]
                if ok:
                    model[owner][i] += 1
        elif op == "unpin":
            expected_missing = 0
            for i in numbers:
                if model[owner][i] > 0:
                    model[owner][i] -= 1
                else:
                    expected_missing += 1
            assert ix.unpin("ns", [key(i) for i in numbers], owner) == expected_missing
        elif op == "read":
            for i in numbers:
                if ix.lookup("ns", [key(i)])[0]:
                    ix.end_read(ix.begin_read("ns", key(i)))
        elif op == "store":
            for i in numbers:
                store(ix, i)  # may evict: never a pinned row
        else:
            pins, _ = ix.release_owner(owner)
            assert pins == sum(model[owner].values())
            model[owner].clear()
        ix.check_invariants()
        held = {i for counts in model.values() for i, n in counts.items() if n > 0}
        assert all(ix.lookup("ns", [key(i) for i in sorted(held)])), "a pinned row was evicted"
        for i in range(ROWS + 3):
            slot = ns.slots.get(key(i))
            expected = {o: model[o][i] for o in OWNERS if model[o][i] > 0}
            assert ((slot.pins or {}) if slot is not None else {}) == expected
    for owner in OWNERS:  # every pin dropped: nothing held, every row evictable again
        ix.unpin("ns", [key(i) for i, n in model[owner].items() for _ in range(n)], owner)
    ix.check_invariants()
    assert ix.pinned_bytes == 0 and ns.pinned_blocks == 0
