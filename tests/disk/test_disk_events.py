"""The disk tier's events on Watch (`kvdepot serve --disk DIR`): a record written to
disk is announced as STORED of tier DISK, a record the disk's LRU drops as REMOVED of
tier DISK (reason "lru"), and the pool's own events stay what they were (tier POOL,
the default an older client reads as before)."""

from __future__ import annotations

import threading

import pytest

from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.disk.test_disk_daemon import GEO, store
from tests.support.daemon import connect, stats
from tests.support.engine import Engine

pytest.importorskip("blake3")

DISK = pb.WatchEvent.TIER_DISK
POOL = pb.WatchEvent.TIER_POOL
# A 64 KiB row takes a 68 KiB record: a 1 MiB disk tier (its last page the probe's)
# holds exactly 15, so the second batch of 10 evicts 5 of the first.
HOLDS = 15
BATCH = 10


class Events:
    """What a Watch stream delivered (its handler runs on the client's stream thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[pb.WatchEvent] = []

    def __call__(self, event: pb.WatchEvent) -> None:
        with self._lock:
            self._events.append(event)

    def keys(self, kind: int, tier: int) -> list[bytes]:
        with self._lock:
            return [k for e in self._events if (e.kind, e.tier) == (kind, tier) for k in e.keys]

    def of(self, kind: int, tier: int) -> list[pb.WatchEvent]:
        with self._lock:
            return [e for e in self._events if (e.kind, e.tier) == (kind, tier)]


def test_watch_announces_disk_writes_and_disk_evictions(daemon_factory, tmp_path) -> None:
    d = daemon_factory(
        "--pool-size", "16MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "1MiB"
    )  # fmt: skip
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    events = Events()
    watch = c.watch(GEO.namespace, events)
    wait_for(lambda: events.of(pb.WatchEvent.SNAPSHOT_END, POOL), what="the snapshot")

    first = store(engine, range(BATCH))
    wait_for(
        lambda: sorted(events.keys(pb.WatchEvent.STORED, DISK)) == sorted(first),
        what="STORED of tier DISK for every row written to disk",
    )
    assert stats(c).disk_writes == BATCH
    assert not events.of(pb.WatchEvent.REMOVED, DISK)

    second = store(engine, range(BATCH, 2 * BATCH))
    gone = 2 * BATCH - HOLDS
    wait_for(
        lambda: len(events.keys(pb.WatchEvent.REMOVED, DISK)) == gone,
        what="REMOVED of tier DISK for the records the disk evicted",
    )
    s = wait_for(lambda: (s := stats(c)).disk_writes == 2 * BATCH and s, what="rows on disk")
    assert (s.disk_evicted, s.disk_records) == (gone, HOLDS)
    removed = events.keys(pb.WatchEvent.REMOVED, DISK)
    assert set(removed) < set(first)  # the least recently written: the first batch's
    assert {e.reason for e in events.of(pb.WatchEvent.REMOVED, DISK)} == {"lru"}
    wait_for(
        lambda: sorted(events.keys(pb.WatchEvent.STORED, DISK)) == sorted(first + second),
        what="the second batch announced on disk",
    )

    # The pool's events are unchanged: every row STORED once, tier POOL (the default,
    # not on the wire), nothing removed from RAM, and RAM still answers every lookup.
    assert sorted(events.keys(pb.WatchEvent.STORED, POOL)) == sorted(first + second)
    assert not events.of(pb.WatchEvent.REMOVED, POOL)
    assert c.lookup(GEO.namespace, first + second) == [True] * (2 * BATCH)
    watch.stop()
    c.close()
