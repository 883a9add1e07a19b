"""A Watch stream's queue (kvdepot.server.state.events.Watcher) with the events a
store job now brings: one event carrying every key of the job."""

from __future__ import annotations

import asyncio

from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.kinds import EventKind, EvictionReason, Tier
from kvdepot.server.state.events import Watcher


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def test_a_job_sized_event_is_sent_in_messages_of_at_most_max_keys() -> None:
    async def run() -> None:
        w = Watcher("ns")
        stored, removed = EventKind.STORED, EventKind.REMOVED
        w.push(IndexEvent("ns", removed, tuple(key(i) for i in range(3)), EvictionReason.LRU))
        w.push(IndexEvent("ns", stored, tuple(key(i) for i in range(10, 20))))
        w.push(IndexEvent("ns", stored, (key(20), key(21))))
        assert w.queued_keys == 15
        runs = []
        while (r := w.take_run(max_keys=4)) is not None:
            runs.append((r.kind, r.keys, r.reason))
        # Every key once, in order, no message over 4 keys, kinds never mixed.
        assert [len(k) for _, k, _ in runs] == [3, 4, 4, 4]
        assert runs[0] == (removed, (key(0), key(1), key(2)), EvictionReason.LRU)
        stored_keys = [k for kind, ks, _ in runs[1:] for k in ks if kind is stored]
        assert stored_keys == [key(i) for i in range(10, 22)]
        assert w.queued_keys == 0 and not w.queue

    asyncio.run(run())


def test_the_disk_tiers_events_are_never_merged_with_the_pools() -> None:
    async def run() -> None:
        w = Watcher("ns")
        stored, disk = EventKind.STORED, Tier.DISK
        w.push(IndexEvent("ns", stored, (key(1),)))
        w.push(IndexEvent("ns", stored, (key(2), key(3)), None, disk))
        w.push(IndexEvent("ns", stored, (key(4),), None, disk))
        w.push(IndexEvent("ns", stored, (key(5),)))
        runs = []
        while (r := w.take_run(max_keys=2)) is not None:
            runs.append((r.keys, r.tier))
        assert runs == [
            ((key(1),), Tier.POOL),
            ((key(2), key(3)), disk),
            ((key(4),), disk),  # the rest of the disk's run, split at max_keys
            ((key(5),), Tier.POOL),
        ]

    asyncio.run(run())


def test_removed_rows_chunk_events_stay_with_their_keys_when_runs_merge_and_split() -> None:
    async def run() -> None:
        w = Watcher("ns")
        removed, lru = EventKind.REMOVED, EvictionReason.LRU
        w.push(IndexEvent("ns", removed, (key(1), key(2)), lru, chunk_events=(b"e1", b"e2")))
        w.push(IndexEvent("ns", removed, (key(3),), lru))  # a row that had none
        w.push(IndexEvent("ns", removed, (key(4), key(5)), lru, chunk_events=(b"", b"e5")))
        w.push(IndexEvent("ns", removed, (key(6),), lru))
        runs = []
        while (r := w.take_run(max_keys=4)) is not None:
            runs.append((r.keys, r.chunk_events))
        assert runs == [
            ((key(1), key(2), key(3), key(4)), (b"e1", b"e2", b"", b"")),
            ((key(5), key(6)), (b"e5", b"")),
        ]
        # A run of rows none of which had one carries none (not a list of b"").
        w.push(IndexEvent("ns", removed, (key(7),), lru))
        w.push(IndexEvent("ns", removed, (key(8),), lru))
        r = w.take_run(max_keys=4)
        assert r is not None and r.chunk_events == ()

    asyncio.run(run())
