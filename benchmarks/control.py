"""Control-plane figures: scheduler-side lookups and the pin round trip.

The vLLM connector answers `lookup` from a local mirror of the namespace's ready
keys, fed by the daemon's Watch stream, and makes one pin call per step with
hits (docs/architecture.md §3, §10). When the connector's own bench (`connector_bench`, needs vLLM)
is there, the CLI reports its figures; this module always measures the same two
things with the plain client library, so the section exists in every
environment and the two can be compared:

- lookups: a Watch-fed mirror (a set of ready keys), one call per key as the
  scheduler makes them, half hits, half misses;
- the daemon's batch Lookup RPC (for scripts and operators, not on the
  scheduler path);
- pin: Pin of one request's keys, then Unpin, each a unary RPC; p50/p99.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from kvdepot.bench.geometry import make_keys
from kvdepot.bench.stats import percentile
from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb


class KeyMirror:
    """The scheduler-side view of a namespace: ready keys, kept by Watch events."""

    def __init__(self) -> None:
        self._ready: set[bytes] = set()
        self.synced = threading.Event()

    def on_event(self, event: pb.WatchEvent) -> None:
        if event.tier == pb.WatchEvent.TIER_DISK:  # on disk only: never a hit, as in the connector
            return
        if event.kind == pb.WatchEvent.SNAPSHOT:
            if event.reset:
                self._ready = set()
                self.synced.clear()
            self._ready.update(event.keys)
        elif event.kind == pb.WatchEvent.SNAPSHOT_END:
            self.synced.set()
        elif event.kind == pb.WatchEvent.STORED:
            self._ready.update(event.keys)
        elif event.kind == pb.WatchEvent.REMOVED:
            self._ready.difference_update(event.keys)

    def lookup(self, key: bytes) -> bool:
        """What the connector's `lookup(key)` costs at least: one membership test."""
        return key in self._ready

    def keys(self) -> list[bytes]:
        return list(self._ready)


def measure_control(
    target: str, namespace: str, salt: bytes, lookups: int, pins: int, pin_keys: int
) -> dict[str, Any]:
    """Lookup rates and pin latency against the namespace the data-path series filled."""
    client = DepotClient(target, client_name="kvdepot-bench control").start()
    try:
        if not client.wait_connected(15):
            raise RuntimeError(f"no kvdepot daemon answered at {target}")
        mirror = KeyMirror()
        watch = client.watch(namespace, mirror.on_event)
        try:
            if not mirror.synced.wait(30):
                raise RuntimeError("the Watch snapshot did not arrive within 30 s")
            ready = mirror.keys()
        finally:
            watch.stop()
        if len(ready) < pin_keys:
            raise RuntimeError(
                f"the namespace holds {len(ready)} ready key(s), fewer than the {pin_keys} a pin "
                f"takes: the data-path series stored too little"
            )
        rng = random.Random(7)
        # Half hits (keys the daemon holds), half misses (keys nobody stored).
        misses = make_keys(salt, 1 << 30, 0, max(1, len(ready)), 0)
        probe = [rng.choice(ready) if i % 2 == 0 else rng.choice(misses) for i in range(4096)]
        queries = (probe * (lookups // len(probe) + 1))[:lookups]
        lookup = mirror.lookup
        best = float("inf")
        for _ in range(3):  # best of three: a lookup loop is short and the machine is shared
            t = time.perf_counter()
            hits = 0
            for key in queries:
                hits += lookup(key)
            best = min(best, time.perf_counter() - t)
        rpc_batch = 1024
        batches = max(2, min(50, lookups // rpc_batch // 10))
        client.lookup(namespace, probe[:rpc_batch])  # warm-up
        t = time.perf_counter()
        for b in range(batches):
            start = (b * rpc_batch) % (len(probe) - rpc_batch + 1)
            client.lookup(namespace, probe[start : start + rpc_batch])
        rpc_rate = batches * rpc_batch / (time.perf_counter() - t)
        pin_ms, unpin_ms, pinned = [], [], 0
        for i in range(pins + 5):
            keys = [ready[(i * pin_keys + k) % len(ready)] for k in range(pin_keys)]
            t0 = time.perf_counter()
            got = client.pin(namespace, keys)
            t1 = time.perf_counter()
            client.unpin(namespace, keys, wait=True)
            t2 = time.perf_counter()
            if i >= 5:  # the first calls set up the channel's call path: warm-up
                pin_ms.append((t1 - t0) * 1e3)
                unpin_ms.append((t2 - t1) * 1e3)
                pinned += sum(got)
        return {
            "source": "kvdepot.client (Watch-fed mirror + Pin/Unpin RPCs)",
            "ready_keys": len(ready),
            "lookup_keys_per_s": len(queries) / best,
            "lookup_hit_share": hits / len(queries),
            "rpc_lookup_keys_per_s": rpc_rate,
            "rpc_lookup_batch": rpc_batch,
            "pin_keys": pin_keys,
            "pin_ms": {"p50": percentile(pin_ms, 50), "p99": percentile(pin_ms, 99)},
            "unpin_ms": {"p50": percentile(unpin_ms, 50), "p99": percentile(unpin_ms, 99)},
            "pins": len(pin_ms),
            "pinned_share": pinned / max(1, len(pin_ms) * pin_keys),
        }
    finally:
        client.close()
