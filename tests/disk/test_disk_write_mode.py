"""`kvdepot serve --disk DIR --disk-write evict`: nothing is written while the pool is
below its high-water fill (80 %); past it, the pool's least recently used rows not on
disk yet are written, and no others (a row used again is hot: not written); when RAM
evicts those rows they come back from disk through Prefetch, byte for byte."""

from __future__ import annotations

import math

import pytest

from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.disk.test_disk_daemon import (
    GEO,
    PER_JOB,
    ROW,
    load_mismatches,
    serve,
    settled,
    store,
)
from tests.disk.test_disk_events import DISK, POOL, Events
from tests.support.daemon import connect, stats
from tests.support.engine import Engine
from tests.support.status_cli import status

pytest.importorskip("blake3")

FETCHING = pb.PrefetchResponse.FETCHING
ABSENT = pb.PrefetchResponse.ABSENT
STORED = pb.WatchEvent.STORED
HIGH_WATER = 0.8  # DiskSettings.high_water


def test_evict_mode_writes_the_cold_end_ahead_of_eviction(daemon_factory, tmp_path) -> None:
    d = serve(daemon_factory, tmp_path / "disk", "--disk-write", "evict")
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    events = Events()
    watch = c.watch(GEO.namespace, events)
    wait_for(lambda: events.of(pb.WatchEvent.SNAPSHOT_END, POOL), what="the snapshot")

    # 150 of the 16 MiB pool's 256 rows: under the high water, nothing is written.
    keys = store(engine, range(150))
    s = stats(c)
    assert s.disk_write_mode == "evict" and s.ready_blocks == 150
    assert (s.disk_writes, s.disk_inflight_bytes, s.disk_records) == (0, 0, 0)
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert "0 records, writes on evict" in screen, screen

    # Rows 0-49 are used again (loaded): the hot end. Then 90 more rows take the pool
    # past its high water: the coldest rows over the mark are written, only they.
    assert load_mismatches(engine, range(50)) == 0
    keys += store(engine, range(150, 240))
    over = 240 * ROW - HIGH_WATER * s.capacity_bytes
    cold = math.ceil(over / ROW)
    assert 0 < cold < 100
    # Stored first and never used again, each job's rows tail first (eviction.tail_first).
    never_used = [k for job in range(50, 240, PER_JOB) for k in reversed(keys[job : job + PER_JOB])]
    expected = never_used[:cold]
    wait_for(
        lambda: sorted(events.keys(pb.WatchEvent.STORED, DISK)) == sorted(expected),
        what="the coldest rows over the high water written to disk",
        detail=lambda: f"written: {sorted(keys.index(k) for k in events.keys(STORED, DISK))}",
    )
    s = stats(c)
    assert (s.disk_writes, s.disk_records, s.evictions) == (cold, cold, 0)

    # RAM evicts (144 rows at least): the cold end, written ahead of it. Every row it
    # evicted is on disk or counted as a write dropped; those on disk come back through
    # Prefetch, byte for byte.
    store(engine, range(240, 400))
    s = settled(c)
    assert s.evictions >= 144 and not s.dropped_stores and s.disk_writes > cold
    lost = s.disk_write_drops.get("evicted", 0)
    gone = [i for i, here in enumerate(c.lookup(GEO.namespace, keys)) if not here]
    assert len(gone) == s.evictions
    back: list[int] = []
    # An eighth of the pool at a time (what the promoter may claim at once), one key a
    # Prefetch: these rows are no request's prefix, and a Prefetch fetches nothing
    # behind a key no tier holds.
    for part in (gone[n : n + 32] for n in range(0, len(gone), 32)):
        states = [c.prefetch(GEO.namespace, [keys[i]], timeout=5.0).states[0] for i in part]
        assert set(states) <= {FETCHING, ABSENT}, states
        came = [i for i, st in zip(part, states, strict=True) if st == FETCHING]
        asked = [keys[i] for i in came]
        wait_for(lambda a=asked: all(c.lookup(GEO.namespace, a)), what="rows promoted")
        assert sum(load_mismatches(engine, range(i, i + 1)) for i in came) == 0
        back += came
    # The rows written first were the next victims: at least those came back.
    assert len(back) == len(gone) - lost and len(back) >= cold
    s = stats(c)
    assert (s.disk_hits, s.disk_rejected) == (len(back), 0)
    watch.stop()
    c.close()
