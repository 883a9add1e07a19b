"""Eviction keeps loadable prefixes (docs/architecture.md §6, kvdepot.server.core.eviction):
rows used together are admitted tail first, a touch makes a request's rows young again,
head youngest, and what a full pool keeps of a prompt is its leading chunks."""

from __future__ import annotations

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.eviction import tail_first
from kvdepot.server.core.index import BlockIndex, Slot
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.prefix_fetch import leading_run
from tests.support.prefixes import reach

SLOT = 4096


def key(prompt: int, chunk: int, group: int = 0) -> bytes:
    return prompt.to_bytes(16, "big") + chunk.to_bytes(16, "big") + group.to_bytes(4, "big")


def make(slots: int, groups: int = 1) -> BlockIndex:
    ix = BlockIndex(ExtentAllocator(slots * SLOT))
    ix.declare_namespace(NamespaceLayout("ns", 1, 1, tuple((SLOT,) for _ in range(groups))))
    return ix


def store(ix: BlockIndex, keys: list[bytes], per_job: int = 20) -> None:
    """Stores `keys` in jobs of `per_job` (chunked prefill: one job a step)."""
    for start in range(0, len(keys), per_job):
        claim = ix.begin_store_many("ns", keys[start : start + per_job], 0, "engine")
        ix.finish_store_many(claim.slots, 0, True)


def loadable(ix: BlockIndex, keys: list[bytes]) -> tuple[int, int]:
    """(leading chunks a lookup reaches, chunks held after the first miss)."""
    return reach(ix.lookup("ns", keys))


def test_a_full_pool_keeps_the_leading_chunks_of_a_prompt_not_its_tail() -> None:
    # The case: prompt 1 (40 chunks) stored, then prompt 2 (60) overflows.
    ix = make(slots=85)
    p1 = [key(1, c) for c in range(40)]
    p2 = [key(2, c) for c in range(60)]
    store(ix, p1, per_job=40)
    store(ix, p2)
    assert loadable(ix, p1) == (25, 0)  # before: 0 leading, 25 unreachable
    assert loadable(ix, p2) == (60, 0)
    ix.check_invariants()


def test_a_prompt_stored_over_several_steps_keeps_its_head_once_touched() -> None:
    """Chunked prefill stores a prompt in several jobs, so its tail is younger than its
    head; the touch the connector sends when the request ends puts the head last."""
    ix = make(slots=85)
    p1 = [key(1, c) for c in range(40)]
    store(ix, p1, per_job=20)
    assert ix.touch("ns", p1) == 40
    store(ix, [key(2, c) for c in range(60)])
    assert loadable(ix, p1) == (25, 0)
    assert ix.stats.touched_keys == 40


def test_a_prefix_used_again_survives_a_flood_that_evicts_one_that_was_not() -> None:
    ix = make(slots=100)
    used, unused = [key(1, c) for c in range(30)], [key(2, c) for c in range(30)]
    for prompt in (used, unused):
        store(ix, prompt)
        ix.touch("ns", prompt)  # the request ends: the connector's touch
    ix.touch("ns", used[:20])  # a later request reached 20 chunks of it again
    store(ix, [key(3, c) for c in range(50)])  # 10 rows must go
    assert loadable(ix, used) == (20, 0)  # the 10 not reached again went first
    assert loadable(ix, unused) == (30, 0)
    store(ix, [key(4, c) for c in range(30)])  # 30 more must go: the unused prompt's
    assert loadable(ix, used) == (20, 0) and loadable(ix, unused) == (0, 0)


def test_a_load_and_an_unpin_make_the_head_youngest() -> None:
    ix = make(slots=20)
    keys = [key(1, c) for c in range(10)]
    store(ix, keys, per_job=10)
    store(ix, [key(2, c) for c in range(10)], per_job=10)
    # A load of prompt 1 (pinned by the scheduler first, read, then unpinned).
    assert ix.pin("ns", keys, "scheduler") == [True] * 10
    held = ix.begin_read_many("ns", keys)
    ix.end_read_many(held)
    assert ix.unpin("ns", keys, "scheduler") == 0
    assert [s.key for s in ix.coldest()][-10:] == keys[::-1]  # the head youngest
    store(ix, [key(3, c) for c in range(15)])
    assert loadable(ix, keys) == (5, 0) and loadable(ix, [key(2, c) for c in range(10)]) == (0, 0)
    ix.check_invariants()


def test_a_touch_skips_rows_held_or_being_written_and_counts_what_it_refreshed() -> None:
    ix = make(slots=10)
    keys = [key(1, c) for c in range(4)]
    store(ix, keys[:3], per_job=3)
    claim = ix.begin_store_many("ns", keys[3:], 0, "engine")  # WRITING
    assert ix.pin("ns", keys[:1], "scheduler") == [True]  # held
    assert ix.touch("ns", [*keys, key(9, 9)]) == 2  # chunks 1 and 2 only
    assert [s.key for s in ix.coldest()] == [keys[2], keys[1]]
    ix.finish_store_many(claim.slots, 0, True)
    ix.unpin("ns", keys[:1], "scheduler")
    assert [s.key for s in ix.coldest()] == [keys[2], keys[1], keys[3], keys[0]]
    ix.check_invariants()


def test_rows_a_tier_writes_behind_keep_the_prefix_order_whatever_order_the_writes_end() -> None:
    """The disk writes a prompt's rows behind while the request's touch comes, and the
    writes end head first: the rows kept their place, so the full pool still keeps the
    leading chunks (a write's end that put its row at the young end left 25 rows behind
    a miss)."""
    ix = make(slots=85)
    p1 = [key(1, c) for c in range(40)]
    store(ix, p1, per_job=20)
    kept = [ix.begin_keep("ns", k) for k in p1]
    assert ix.touch("ns", p1) == 40  # kept rows are touched as any
    for slot in kept:
        assert slot is not None
        ix.end_keep(slot)
    store(ix, [key(2, c) for c in range(60)])
    assert loadable(ix, p1) == (25, 0)
    ix.check_invariants()


def test_the_fetched_run_stops_at_each_groups_first_key_nothing_holds() -> None:
    assert leading_run([0, 0, 0, 0], [True, True, False, True]) == [True, True, False, False]
    assert leading_run([0, 0, 1, 1], [True, False, True, True]) == [True, False, True, True]
    assert leading_run([], []) == []


def slot(group: int, chunk: int) -> Slot:
    return Slot("ns", key(0, chunk, group), group, Extent(0, SLOT), 0.0)


def test_tail_first_orders_several_groups_by_distance_from_their_last_chunk() -> None:
    # A hybrid job: a full-attention group's chunks 0-3, a sliding-window group's 2-3.
    job = [slot(0, c) for c in range(4)] + [slot(1, c) for c in (2, 3)]
    order = [(s.group, int.from_bytes(s.key[16:32], "big")) for s in tail_first(job)]
    assert order == [(0, 3), (1, 3), (0, 2), (1, 2), (0, 1), (0, 0)]
    one_group = [slot(0, c) for c in range(3)]
    assert list(tail_first(one_group)) == one_group[::-1]
    assert list(tail_first([])) == []


def test_a_namespace_within_its_share_keeps_its_rows_when_another_floods() -> None:
    from kvdepot.server.core.shares import NamespaceShares

    ix = BlockIndex(ExtentAllocator(100 * SLOT), shares=NamespaceShares.parse("guarded=0.3"))
    for ns in ("guarded", "flood"):
        ix.declare_namespace(NamespaceLayout(ns, 1, 1, ((SLOT,),)))
    assert ix.namespaces["guarded"].share_bytes == 30 * SLOT
    assert ix.namespaces["flood"].share_bytes == 0

    def put(ns: str, keys: list[bytes]) -> None:
        claim = ix.begin_store_many(ns, keys, 0, "engine")
        ix.finish_store_many(claim.slots, 0, True)

    guarded = [key(1, c) for c in range(40)]
    put("guarded", guarded)  # 40 rows: 10 over its share
    for n in range(5):  # the flood: 300 rows in jobs of 20, never used again
        put("flood", [key(2, 20 * n + c) for c in range(20)])
    g, f = ix.namespaces["guarded"], ix.namespaces["flood"]
    # The guarded namespace lost what it held over its share, its tail first, and no more.
    assert ix.lookup("guarded", guarded) == [True] * 30 + [False] * 10
    assert (g.used_bytes, g.evicted_blocks) == (30 * SLOT, 10)
    assert f.used_bytes == 70 * SLOT and f.evicted_blocks == 30
    # Its own stores still evict its own least recently used rows (a floor against
    # others, not a wall around it): the new prompt's 5 rows replace its tail's.
    put("guarded", [key(3, c) for c in range(5)])
    assert ix.lookup("guarded", guarded) == [True] * 25 + [False] * 15
    assert (g.used_bytes, f.used_bytes) == (30 * SLOT, 70 * SLOT)
    ix.check_invariants()


def test_shares_are_parsed_with_prefixes_and_checked() -> None:
    import pytest

    from kvdepot.server.core.shares import NamespaceShares

    shares = NamespaceShares.parse("kvd1-ab*=0.25, kvd1-cd=0.5")
    assert shares.fraction_for("kvd1-abcdef") == 0.25
    assert shares.fraction_for("kvd1-cd") == 0.5 and shares.fraction_for("kvd1-cde") == 0
    assert str(shares) == "kvd1-ab*=0.25,kvd1-cd=0.5"
    for bad, why in [
        ("a=0.7,b=0.4", "add up to 1.1"),
        ("a=0", r"fraction in \(0, 1\]"),
        ("a", "NAMESPACE=FRACTION"),
        ("*=0.5", "NAMESPACE=FRACTION"),
        ("a=half", r"fraction in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=why):
            NamespaceShares.parse(bad)
