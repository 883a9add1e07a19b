"""What the pool and the disk tier hold, read from the daemon, and which of it no lookup
reaches: the capacity bench's figures (kvdepot.bench.capacity_runs) and the tests'
checks of eviction across the tiers (tests/disk/test_disk_prefixes_daemon.py).

A lookup walks a request's chunks from the first and stops at the first miss, and
Prefetch fetches only the leading run the pool and the tiers below it hold
(docs/architecture.md §2): a row, in RAM or on disk, is worth its bytes only while
every chunk before it in its prompt is held by one of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from kvdepot.v1 import depot_pb2


def unreachable_keys(held: Collection[bytes], parents: Mapping[bytes, bytes | None]) -> set[bytes]:
    """The keys of `held` whose chain to the first chunk is broken: a chunk before one
    (`parents[key]`: the key of the chunk before it, None for a first chunk) is not
    held. Keys `parents` does not know are left out."""
    reached: dict[bytes, bool] = {}

    def reachable(key: bytes) -> bool:
        chain = []
        k: bytes | None = key
        while k is not None and k not in reached:
            chain.append(k)
            k = parents.get(k)
        ok = True if k is None else reached[k]
        for c in reversed(chain):
            ok = ok and c in held
            reached[c] = ok
        return reached[key]

    return {key for key in held if key in parents and not reachable(key)}


class DiskRecords:
    """The disk tier's records of one namespace, as the daemon announces them: a Watch
    stream's TIER_DISK events (STORED: written; REMOVED: evicted, rejected, lost).
    `settled(stats)` is true once the events received add up to GetStats' disk_writes
    (+ disk_recovered) and disk_evicted + disk_rejected: the stream lags the tier by a
    turn of the daemon's loop or two, so read `keys` after it.

    `client` is a DepotClient joined to nothing in particular (the Watch joins);
    `on_event` runs on its stream loop thread, everything else on the caller's."""

    def __init__(self, client: Any, namespace: str, timeout: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()
        self._stored = self._removed = 0
        self._subscribed = threading.Event()
        self._watch = client.watch(namespace, self._on_event)
        if not self._subscribed.wait(timeout):
            self._watch.stop()
            raise TimeoutError("the Watch stream never got its snapshot")

    def _on_event(self, event: depot_pb2.WatchEvent) -> None:
        pb = depot_pb2.WatchEvent
        if event.kind == pb.SNAPSHOT_END:
            self._subscribed.set()
        if event.tier != pb.TIER_DISK:
            return
        with self._lock:
            if event.kind == pb.STORED:
                self._keys.update(event.keys)
                self._stored += len(event.keys)
            elif event.kind == pb.REMOVED:
                self._keys.difference_update(event.keys)
                self._removed += len(event.keys)

    def settled(self, stats: Any) -> bool:
        """Every record change GetStats (`stats`) counts has been heard."""
        with self._lock:
            return (
                self._stored == stats.disk_writes + stats.disk_recovered
                and self._removed == stats.disk_evicted + stats.disk_rejected
            )

    def wait_settled(self, get_stats: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Until no write is in flight or waiting and every change is heard; the
        stats that showed it."""
        deadline = time.monotonic() + timeout
        while True:
            s = get_stats()
            if not s.disk_inflight_bytes and not s.disk_write_waiting and self.settled(s):
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"the disk tier did not settle in {timeout:.0f} s")
            time.sleep(0.001)

    def keys(self) -> set[bytes]:
        with self._lock:
            return set(self._keys)

    def close(self) -> None:
        self._watch.stop()
