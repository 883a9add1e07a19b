"""The scheduler-side manager's parts that need no daemon, each on its own: the mirror's
generation rule and its events, the back-off after failed loads, the step's figures.

The parts that talk to the daemon (pins, unpins, prefetch) are tested through the
manager against a real `kvdepot serve` (test_connector.py, test_reset_race.py,
test_remote_tier.py).
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import Locality

from kvdepot.client.vllm.load_failures import LoadFailureBackoff
from kvdepot.client.vllm.mirror import ReadyMirror
from kvdepot.client.vllm.stats import MetricName, StepStats
from kvdepot.v1 import depot_pb2

WatchEvent = depot_pb2.WatchEvent


def stored(*keys: bytes) -> WatchEvent:
    return WatchEvent(kind=WatchEvent.STORED, keys=list(keys))


def removed(*keys: bytes) -> WatchEvent:
    return WatchEvent(kind=WatchEvent.REMOVED, keys=list(keys))


def snapshot(*keys: bytes, reset: bool) -> WatchEvent:
    return WatchEvent(kind=WatchEvent.SNAPSHOT, keys=list(keys), reset=reset)


# -- the mirror -------------------------------------------------------------------------


def test_the_mirror_follows_stored_and_removed_events() -> None:
    mirror = ReadyMirror(enable_events=False, on_forget=lambda: None)
    on_event = mirror.handler(0)
    on_event(stored(b"a", b"b", b"c"))
    on_event(removed(b"b"))
    assert mirror.ready == {b"a", b"c"}
    mirror.discard([b"c"])  # a pin found it gone before its REMOVED event
    assert mirror.ready == {b"a"}
    assert mirror.take_events() == ()  # events off


def test_events_of_an_earlier_generation_never_reach_the_mirror() -> None:
    mirror = ReadyMirror(enable_events=False, on_forget=lambda: None)
    old = mirror.handler(0)
    old(stored(b"old"))
    mirror.start_generation(1)
    assert mirror.ready == set()
    old(stored(b"late"))  # the left namespace's stream, still running
    new = mirror.handler(1)
    new(stored(b"new"))
    assert mirror.ready == {b"new"}


def test_an_event_being_applied_while_the_generation_switches_stays_in_the_old_one() -> None:
    """The Watch thread passed its generation check and is applying an event when the
    scheduler resets: the switch waits for it, and the new mirror starts empty."""
    mirror = ReadyMirror(enable_events=False, on_forget=lambda: None)
    applying, release = threading.Event(), threading.Event()
    apply_event = mirror.apply

    def held(event: WatchEvent) -> None:
        applying.set()
        assert release.wait(10)
        apply_event(event)

    mirror.apply = held  # type: ignore[method-assign]
    watch = threading.Thread(target=mirror.handler(0), args=(stored(b"old"),))
    watch.start()
    assert applying.wait(10)
    switch = threading.Thread(target=mirror.start_generation, args=(1,))
    switch.start()
    release.set()
    watch.join(10)
    switch.join(10)
    assert not watch.is_alive() and not switch.is_alive()
    assert mirror.ready == set()


def test_a_reset_snapshot_forgets_everything_and_reports_it() -> None:
    forgotten: list[bool] = []
    mirror = ReadyMirror(enable_events=True, on_forget=lambda: forgotten.append(True))
    on_event = mirror.handler(0)
    on_event(snapshot(b"a", b"b", reset=False))
    on_event(WatchEvent(kind=WatchEvent.SNAPSHOT_END))
    assert [(sorted(e.keys), e.removed) for e in mirror.take_events()] == [([b"a", b"b"], False)]
    assert forgotten == []
    on_event(snapshot(b"c", reset=True))  # the daemon restarted
    assert mirror.ready == {b"c"} and forgotten == [True]
    events = [(sorted(e.keys), e.removed) for e in mirror.take_events()]
    assert events == [([b"a", b"b"], True), ([b"c"], False)]
    assert mirror.take_events() == ()  # drained


def test_disk_tier_events_are_storage_events_and_never_hits() -> None:
    mirror = ReadyMirror(enable_events=True, on_forget=lambda: None)
    on_event = mirror.handler(0)
    on_event(stored(b"a"))
    disk = WatchEvent.TIER_DISK
    on_event(WatchEvent(kind=WatchEvent.STORED, keys=[b"a", b"b"], tier=disk))
    on_event(WatchEvent(kind=WatchEvent.REMOVED, keys=[b"a"], tier=disk, reason="lru"))
    assert mirror.ready == {b"a"}  # only the pool's events move the ready set
    got = [(e.keys, e.medium.value, e.removed, e.locality) for e in mirror.take_events()]
    assert got == [
        ([b"a"], "CPU", False, None),
        ([b"a", b"b"], "STORAGE", False, Locality.LOCAL),
        ([b"a"], "STORAGE", True, Locality.LOCAL),
    ]
    mirror.start_generation(1)  # an engine reset: the old namespace's disk events drop too
    on_event(WatchEvent(kind=WatchEvent.STORED, keys=[b"c"], tier=disk))
    assert mirror.take_events() == () and mirror.ready == set()


def test_with_shards_a_key_is_ready_only_while_every_shard_holds_it() -> None:
    forgotten: list[bool] = []
    mirror = ReadyMirror(enable_events=True, on_forget=lambda: forgotten.append(True), shards=2)
    shard0, shard1 = mirror.handler(0, shard=0), mirror.handler(0, shard=1)
    shard0(snapshot(b"a", b"b", reset=True))
    shard0(stored(b"c"))
    assert mirror.ready == set()  # shard 1 holds none of their sections yet
    shard1(snapshot(b"b", reset=True))
    shard1(stored(b"a", b"x"))
    assert mirror.ready == {b"a", b"b"}  # c: shard 1 lacks it; x: shard 0 does
    shard0(removed(b"a"))  # evicted on shard 0 first: a miss, never a hit
    assert mirror.ready == {b"b"}
    shard0(stored(b"a"))
    assert mirror.ready == {b"a", b"b"}
    shard1(snapshot(b"c", reset=True))  # shard 1 restarted and kept only c
    assert mirror.ready == {b"c"} and len(forgotten) == 3
    events = [(sorted(e.keys), e.removed) for e in mirror.take_events()]
    assert events == [
        ([b"b"], False),
        ([b"a"], False),
        ([b"a"], True),
        ([b"a"], False),
        ([b"a", b"b"], True),
        ([b"c"], False),
    ]
    disk = WatchEvent.TIER_DISK  # one event per block: shard 0's
    shard1(WatchEvent(kind=WatchEvent.STORED, keys=[b"d"], tier=disk))
    shard0(WatchEvent(kind=WatchEvent.STORED, keys=[b"d"], tier=disk))
    assert [(e.keys, e.medium.value) for e in mirror.take_events()] == [([b"d"], "STORAGE")]
    mirror.start_generation(1)
    mirror.handler(1, shard=0)(stored(b"c"))
    assert mirror.ready == set()  # the new generation starts with nothing on any shard


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # the shard
            st.sampled_from(["stored", "removed", "reset"]),
            st.lists(st.sampled_from([b"a", b"b", b"c", b"d", b"e"]), max_size=4),
        ),
        max_size=30,
    )
)
def test_with_shards_the_ready_keys_are_those_every_shard_holds(
    script: list[tuple[int, str, list[bytes]]],
) -> None:
    """Any interleaving of three shards' events: a key is ready exactly while every
    shard holds it, and the KV events replay to the ready set."""
    mirror = ReadyMirror(enable_events=True, on_forget=lambda: None, shards=3)
    handlers = [mirror.handler(0, shard=s) for s in range(3)]
    held: list[set[bytes]] = [set(), set(), set()]
    replayed: set[bytes] = set()
    for shard, kind, keys in script:
        if kind == "stored":
            handlers[shard](stored(*keys))
            held[shard].update(keys)
        elif kind == "removed":
            handlers[shard](removed(*keys))
            held[shard].difference_update(keys)
        else:
            handlers[shard](snapshot(*keys, reset=True))
            held[shard] = set(keys)
        assert mirror.ready == held[0] & held[1] & held[2]
        for event in mirror.take_events():
            if event.removed:
                replayed.difference_update(event.keys)
            else:
                assert not replayed & set(event.keys), "a key announced ready twice"
                replayed.update(event.keys)
        assert replayed == mirror.ready


KEYS_OF = {g: [bytes([c]) * 4 + g.to_bytes(4, "big") for c in b"abc"] for g in (0, 1)}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # the shard
            st.sampled_from(["stored", "removed", "reset"]),
            st.lists(st.sampled_from(KEYS_OF[0] + KEYS_OF[1]), max_size=4),
        ),
        max_size=30,
    )
)
def test_a_key_of_a_group_a_shard_lacks_needs_the_other_shards_alone(
    script: list[tuple[int, str, list[bytes]]],
) -> None:
    """Shard 0 is a pipeline stage with no layer of group 1 (it never holds a key of
    it): a key of group 1 is ready exactly while shards 1 and 2 hold it, one of group 0
    while all three do."""
    lacks = [frozenset({1}), frozenset(), frozenset()]
    mirror = ReadyMirror(enable_events=True, on_forget=lambda: None, shards=3, lacks=lacks)
    handlers = [mirror.handler(0, shard=s) for s in range(3)]
    held: list[set[bytes]] = [set(), set(), set()]
    replayed: set[bytes] = set()
    for shard, kind, keys in script:
        if shard == 0:
            keys = [k for k in keys if k in KEYS_OF[0]]
        if kind == "stored":
            handlers[shard](stored(*keys))
            held[shard].update(keys)
        elif kind == "removed":
            handlers[shard](removed(*keys))
            held[shard].difference_update(keys)
        else:
            handlers[shard](snapshot(*keys, reset=True))
            held[shard] = set(keys)
        both = held[1] & held[2]
        assert mirror.ready == (both & held[0]) | (both & set(KEYS_OF[1]))
        for event in mirror.take_events():
            if event.removed:
                replayed.difference_update(event.keys)
            else:
                assert not replayed & set(event.keys), "a key announced ready twice"
                replayed.update(event.keys)
        assert replayed == mirror.ready


# -- the back-off after failed loads ----------------------------------------------------


def test_keys_whose_load_failed_stay_backed_off_until_their_time_is_over() -> None:
    failures = LoadFailureBackoff(backoff_s=60.0)
    before = failures.until
    assert failures.note(iter([b"a", b"b"])) == 2
    assert set(failures.until) == {b"a", b"b"}
    assert before == {}  # replaced, not changed: a reader holding it saw a whole dict
    failures.prune()
    assert set(failures.until) == {b"a", b"b"}  # 60 s to go
    failures.clear()
    assert failures.until == {}
    assert failures.note([]) == 0


def test_an_expired_back_off_is_pruned() -> None:
    failures = LoadFailureBackoff(backoff_s=0.0)
    failures.note([b"a"])
    failures.prune()
    assert failures.until == {}


# -- the step's figures -----------------------------------------------------------------


def test_a_quiet_step_reports_nothing_and_gauges_travel_when_they_change() -> None:
    stats = StepStats()
    first = stats.take(connected=True, mirror_keys=3)
    assert first is not None and first.reduce()[MetricName.MIRROR_KEYS] == 3.0
    assert stats.take(connected=True, mirror_keys=3) is None  # nothing new
    stats.count_pin(0.001, misses=2)
    taken = stats.take(connected=True, mirror_keys=3)
    assert taken is not None
    figures = taken.reduce()
    assert figures[MetricName.PINS] == 1 and figures[MetricName.PIN_MISSES] == 2
    assert figures[f"{MetricName.PIN_SECONDS}_count"] == 1
    assert stats.take(connected=False, mirror_keys=3) is not None  # a gauge changed
