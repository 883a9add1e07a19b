"""Metrics scraped over HTTP from a live daemon: after a known sequence of stores, loads
and evictions they show exactly those counts and bytes (histogram counts, sums and
buckets included), and the operations guide lists every kvdepot_ family.
"""

from __future__ import annotations

import enum
import json
import os
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvdepot.bench.daemon import process_cpu_seconds as cpu_seconds
from kvdepot.server.core.kinds import AbortReason, DropReason, EvictionReason
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import connect
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import DaemonFactory
from tests.support.guide import GUIDE, REPO
from tests.support.ops import (
    GEO_M,
    SLOT_M,
    admin,
    free_port,
    keys_m,
    load,
    sample,
    scrape,
    store,
)


def test_metrics_show_exactly_what_happened(daemon_factory: DaemonFactory) -> None:
    """A known sequence of stores, loads, lookups, LRU/admin/clear evictions, dropped
    stores, inline Put/Get and a failed load; then one scrape over HTTP must show exactly
    those counts and bytes, histogram buckets, counts and sums included."""
    port = free_port()
    # One session fills and pins most of this small pool: past the per-session quotas'
    # default (half the pool).
    quotas = ("--max-writing-per-session", "100%", "--max-pinned-per-session", "100%")
    d = daemon_factory("--pool-size", "256KiB", *quotas, "--metrics-port", str(port))
    before = scrape(port)
    # Every series exists (at 0) before anything happens, so rate() and alerts work.
    for direction in ("store", "load"):
        assert sample(before, "kvdepot_transfer_size_bytes_count", direction=direction) == 0
        assert sample(before, "kvdepot_failed_transfers_total", direction=direction) == 0
    for reason in ("lru", "admin", "clear"):
        assert sample(before, "kvdepot_evictions_total", reason=reason) == 0
    assert sample(before, "kvdepot_dropped_stores_total", reason="pool_full") == 0
    # The shared CPU copy threads (device ""); no GPU registered, so no GPU's series.
    cpu = {"threads": "cpu", "device": ""}
    assert sample(before, "kvdepot_copies_started_total", **cpu) == 0
    assert sample(before, "kvdepot_copy_threads", **cpu) == 2  # --copy-threads' default
    assert sample(before, "kvdepot_copy_longest_running_seconds", **cpu) == 0  # none running
    assert not [k for k in before if dict(k[1]).get("threads") == "gpu"]

    client = connect(d.target, "metrics-test")
    ns = GEO_M.namespace
    stores: list[int] = []  # bytes of each successful store transfer, in order
    loads: list[int] = []
    stored_blocks = loaded_blocks = 0  # keys written / read by them
    copy_seconds = 0.0  # the jobs' own copy times (Put/Get report none)
    inline_wall = 0.0  # wall time of the Put/Get calls: bounds their copy times
    try:
        eng = Engine(client, GEO_M, 0)
        res = store(eng, range(0, 10))  # 10 of the 16 slots
        stores.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 10 * SLOT_M and res.stored_keys == 10
        stored_blocks += res.stored_keys

        res = load(eng, range(0, 4), base_block=64)  # 0-3 become the youngest
        loads.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 4 * SLOT_M
        loaded_blocks += 4

        keys, gb, idx = chunk_plan(GEO_M, range(50, 51), base_block=100)
        res = eng.job(pb.LOAD, keys, gb, idx)  # never stored: fails, counted as failed
        assert not res.success and res.error_code == "NOT_FOUND"

        # 6 free slots: the LRU evicts chunks 9 and 8 (the first job's tail: a job's rows
        # are admitted tail first, and chunks 0-3 were used again).
        res = store(eng, range(10, 18))
        stores.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 8 * SLOT_M and res.stored_keys == 8
        stored_blocks += res.stored_keys

        hits = client.lookup(ns, keys_m(range(18)))
        assert hits == [c not in (8, 9) for c in range(18)]

        # Inline Put of one section (pool full: LRU evicts chunk 7), then Get it back.
        data = os.urandom(GEO_M.blocks_per_chunk * sum(GEO_M.layer_pages))
        t0 = time.perf_counter()
        put = client.put(ns, make_key(40, 0), 0, data)
        got = client.get(ns, make_key(40, 0), 0)
        inline_wall = time.perf_counter() - t0
        assert put.outcome == "stored" and put.ready and got == data
        stores.append(len(data))
        loads.append(len(data))
        stored_blocks += 1
        loaded_blocks += 1

        ch, stub = admin(d)
        with ch:
            ev = stub.Evict(admin_pb2.EvictRequest(namespace_id=ns, keys=keys_m([5, 6])))
            assert (ev.evicted_blocks, ev.skipped_blocks, ev.not_found_blocks) == (2, 0, 0)
            ready = [*range(0, 5), *range(10, 18), 40]  # 14 blocks
            assert client.pin(ns, keys_m(ready)) == [True] * 14
            res = store(eng, range(20, 24))  # 2 free slots, the rest pinned: 2 dropped
            assert (res.stored_keys, res.dropped_keys) == (2, 2)
            assert res.bytes == 2 * SLOT_M  # only what was copied
            stores.append(res.bytes)
            stored_blocks += res.stored_keys
            copy_seconds += res.copy_seconds
            client.unpin(ns, keys_m(range(0, 4)), wait=True)
            cleared = stub.Clear(admin_pb2.ClearRequest())  # 20, 21 and 0-3
            assert (cleared.evicted_blocks, cleared.skipped_blocks) == (6, 10)
            stats = stub.GetStats(admin_pb2.GetStatsRequest())
        m = scrape(port)
    finally:
        client.close()

    # Transfers: histogram counts, sums and every bucket, per direction.
    for direction, sizes in (("store", stores), ("load", loads)):
        assert sample(m, "kvdepot_transfer_size_bytes_count", direction=direction) == len(sizes)
        assert sample(m, "kvdepot_transfer_size_bytes_sum", direction=direction) == sum(sizes)
        for (name, labels), value in m.items():
            if (
                name == "kvdepot_transfer_size_bytes_bucket"
                and dict(labels)["direction"] == direction
            ):
                le = float(dict(labels)["le"])
                assert value == sum(s <= le for s in sizes), (direction, le)
        assert sample(m, "kvdepot_transfer_copy_seconds_count", direction=direction) == len(sizes)
    seconds = sum(
        sample(m, "kvdepot_transfer_copy_seconds_sum", direction=d) for d in ("store", "load")
    )
    assert copy_seconds <= seconds + 1e-9 <= copy_seconds + inline_wall + 1e-6
    # The copy threads: every job's copy ran on the shared CPU threads (shm), inline
    # copies too, and their busy time holds every job's copy time.
    started = sample(m, "kvdepot_copies_started_total", **cpu)
    assert 4 <= started == stats.copies_started, (started, stats.copies_started)
    busy = sample(m, "kvdepot_copy_busy_seconds_total", **cpu)
    assert copy_seconds <= busy
    assert abs(busy - stats.copy_busy_seconds) < 1e-6, (busy, stats.copy_busy_seconds)
    assert sample(m, "kvdepot_copy_wait_seconds_total", **cpu) >= 0
    assert sample(m, "kvdepot_copy_longest_running_seconds", **cpu) == 0  # all ended
    assert list(stats.gpu_copies_started) == [] and list(stats.gpu_copy_busy_seconds) == []
    assert sample(m, "kvdepot_failed_transfers_total", direction="load") == 1
    assert sample(m, "kvdepot_failed_transfers_total", direction="store") == 0
    # The index.
    assert sample(m, "kvdepot_evictions_total", reason="lru") == 3  # chunks 4, 5, 6
    assert sample(m, "kvdepot_evictions_total", reason="admin") == 2
    assert sample(m, "kvdepot_evictions_total", reason="clear") == 6
    assert sample(m, "kvdepot_dropped_stores_total", reason="pool_full") == 2
    assert sample(m, "kvdepot_lookups_total") == 18
    assert sample(m, "kvdepot_lookup_hits_total") == 16
    assert sample(m, "kvdepot_lookup_misses_total") == 2
    assert sample(m, "kvdepot_pin_keys_total") == sample(m, "kvdepot_pinned_keys_total") == 14
    assert stored_blocks == 10 + 8 + 1 + 2 and loaded_blocks == 4 + 1
    assert sample(m, "kvdepot_transfer_blocks_total", direction="store") == stored_blocks
    assert sample(m, "kvdepot_transfer_blocks_total", direction="load") == loaded_blocks
    assert sample(m, "kvdepot_blocks", state="ready") == 10
    assert sample(m, "kvdepot_blocks", state="writing") == 0
    assert sample(m, "kvdepot_pinned_blocks") == 10
    # The pool.
    assert sample(m, "kvdepot_pool_capacity_bytes") == 256 << 10
    assert sample(m, "kvdepot_pool_used_bytes") == 10 * SLOT_M
    assert sample(m, "kvdepot_pool_pinned_bytes") == 10 * SLOT_M
    assert sample(m, "kvdepot_pool_largest_free_extent_bytes") <= 6 * SLOT_M
    # Sessions and jobs (the client was still connected at the scrape).
    assert sample(m, "kvdepot_engines") == 1
    assert sample(m, "kvdepot_registrations") == 1
    assert sample(m, "kvdepot_namespaces") == 1
    assert sample(m, "kvdepot_inflight_jobs") == 0
    # Admin/GetStats tells the same story.
    assert (stats.stores, stats.stored_bytes) == (len(stores), sum(stores))
    assert (stats.loads, stats.loaded_bytes) == (len(loads), sum(loads))
    assert (stats.store_jobs, stats.stored_blocks) == (len(stores), stored_blocks)
    assert (stats.load_jobs, stats.loaded_blocks) == (len(loads), loaded_blocks)
    assert (stats.failed_store_jobs, stats.failed_load_jobs) == (0, 1)
    assert (stats.pin_calls, stats.pin_keys, stats.pinned_keys) == (1, 14, 14)
    assert dict(stats.evictions_by_reason) == {"lru": 3, "admin": 2, "clear": 6}
    assert stats.evictions == 11 and stats.dropped_stores == 2


def test_guide_lists_every_metric(daemon_factory: DaemonFactory) -> None:
    """Every kvdepot_ metric family a live daemon exports is in the guide's table."""
    port = free_port()
    daemon_factory("--pool-size", "16MiB", "--metrics-port", str(port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        families = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    guide = GUIDE.read_text()
    missing = sorted(f for f in families if f.startswith("kvdepot_") and f"`{f}" not in guide)
    assert not missing, f"docs/operations.md does not list {missing}"
    assert any(f.startswith("process_") for f in families)  # memory, CPU, fds of the daemon


def test_every_reason_a_counter_can_carry_is_explained_where_operators_read() -> None:
    """Each reason label of the by-reason counters is named in the guide's row of its
    metric, and the dropped stores' ones in the dashboard panel an operator sees them
    on: a reason added to the daemon and not to these fails here."""
    rows = {
        line.split("|")[1].strip(): line
        for line in GUIDE.read_text().splitlines()
        if line.startswith("| `kvdepot_")
    }
    counters: dict[str, type[enum.StrEnum]] = {
        "`kvdepot_dropped_stores_total{reason}`": DropReason,
        "`kvdepot_evictions_total{reason}`": EvictionReason,
        "`kvdepot_aborted_writes_total{reason}`": AbortReason,
    }
    for metric, reasons in counters.items():
        missing = [r.value for r in reasons if f"`{r.value}`" not in rows[metric]]
        assert not missing, f"docs/operations.md's {metric} row does not name {missing}"
    dashboard = json.loads((REPO / "deploy/grafana/kvdepot.json").read_text())
    [panel] = [
        p
        for p in dashboard["panels"]
        if any("kvdepot_dropped_stores_total" in t.get("expr", "") for t in p.get("targets", ()))
    ]
    missing = [r.value for r in DropReason if f"{r.value}:" not in panel["description"]]
    assert not missing, f"the dashboard's {panel['title']!r} panel does not explain {missing}"


def test_the_event_loops_cpu_is_its_own_not_the_copy_threads(
    daemon_factory: DaemonFactory,
) -> None:
    """kvdepot_event_loop_cpu_seconds_total (GetStats' loop_cpu_seconds) is the loop
    thread's CPU alone: jobs whose copies keep the copy threads busy for far longer than
    the loop spends on them raise it by a small part of the copy threads' busy time, and
    by less than the daemon process's CPU; GetStats and Prometheus read the same clock."""
    port = free_port()
    d = daemon_factory("--pool-size", "128MiB", "--metrics-port", str(port))
    geo = Geometry(
        groups=[[2 << 20] * 4], blocks_per_chunk=1, world_size=1, num_blocks=24, namespace="loop"
    )
    client = connect(d.target, "loop-cpu-test")
    ch, stub = admin(d)
    try:
        eng = Engine(client, geo, 0)
        store(eng, range(0, 8))  # 8 rows of 8 MiB
        first = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
        assert d.proc is not None
        cpu_before = cpu_seconds(d.proc.pid)
        for _ in range(12):  # 12 loads of 64 MiB, every byte checked
            load(eng, range(0, 8), base_block=16)
        second = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
        cpu_after = cpu_seconds(d.proc.pid)
        m = scrape(port)
    finally:
        ch.close()
        client.close()
    loop = second.loop_cpu_seconds - first.loop_cpu_seconds
    copying = second.copy_busy_seconds - first.copy_busy_seconds
    assert 0 < loop < copying / 2, (loop, copying)
    assert loop < cpu_after - cpu_before, (loop, cpu_after - cpu_before)
    scraped = sample(m, "kvdepot_event_loop_cpu_seconds_total")
    assert second.loop_cpu_seconds <= scraped < second.loop_cpu_seconds + 1.0
