"""The daemon over real sockets and processes: the shared-memory data path.

Separate client processes store and load through a real `kvdepot serve`, and the
bytes that went in come out identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvdepot.client import DepotClient
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

ENGINE = str(Path(__file__).parent / "support" / "engine.py")


def spawn(action: str, target: str, ranks: str, **opts: object) -> subprocess.Popen[str]:
    args = [sys.executable, ENGINE, action, "--target", target, "--ranks", ranks]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_two_rank_processes_store_and_a_third_loads_every_byte(daemon) -> None:
    """TP=2, two groups with different page sizes, blocks_per_chunk=2, 100 chunks."""
    writers = [spawn("store", daemon.target, str(r), chunks=100) for r in (0, 1)]
    reports = [json.loads(w.stdout.readline()) for w in writers]
    for rep in reports:
        assert rep["failed"] == 0 and rep["jobs"] == 10, rep
        assert rep["stored"] == 200  # 100 chunks x 2 groups, this rank's section each
    # The loader uses other block ids; it registers rank 0 and rank 1 of its own.
    loader = spawn("verify", daemon.target, "0,1", chunks=100, base_block=300)
    out, _ = loader.communicate(timeout=120)
    rep = json.loads(out)
    assert rep == {
        "memory_path": "shm",
        "jobs": 20,
        "failed": 0,
        "mismatched_pages": 0,
        "stored": 0,
        "errors": [],
    }, rep
    for w in writers:
        w.communicate("go\n", timeout=30)
        assert w.returncode == 0


def test_a_row_missing_a_rank_is_never_visible(daemon, client) -> None:
    geo = Geometry(world_size=2, namespace="half")
    eng = Engine(client, geo, 0)
    keys, blocks, idx = chunk_plan(geo, range(0, 3))
    events: list[pb.WatchEvent] = []
    watch = client.watch("half", events.append)
    res = eng.job(pb.STORE, keys, blocks, idx)
    assert res.success and res.stored_keys == 6
    assert client.lookup("half", keys) == [False] * 6
    assert client.pin("half", keys) == [False] * 6
    load = eng.job(pb.LOAD, keys, blocks, idx)
    assert not load.success and load.error_code == "NOT_FOUND"
    # Prove the watch is live before trusting the absence of an event: complete another
    # row with both ranks and wait for its STORED event. Events of a namespace arrive in
    # order, so a STORED event for the half row would have come before this one.
    full_keys, full_blocks, full_idx = chunk_plan(geo, range(3, 5))
    rank1 = Engine(client, geo, 1)
    for e in (eng, rank1):
        assert e.job(pb.STORE, full_keys, full_blocks, full_idx).stored_keys == 4
    assert client.lookup("half", full_keys) == [True] * 4
    deadline = time.monotonic() + 10
    stored: list[bytes] = []
    while time.monotonic() < deadline and len(stored) < 4:
        stored = [k for e in list(events) if e.kind == pb.WatchEvent.STORED for k in e.keys]
        time.sleep(0.02)
    assert sorted(stored) == sorted(full_keys), "the watch never saw the complete row"
    assert client.lookup("half", keys) == [False] * 6
    watch.stop()


def test_eviction_is_lru_spares_pinned_and_shows_on_watch(daemon_factory) -> None:
    # One group, 1 layer of 64 KiB, world 1, bpc 1: 64 KiB slots in a 1 MiB pool (16 slots).
    # This one session pins the whole pool (past the default quota, half of it).
    d = daemon_factory("--pool-size", "1MiB", "--max-pinned-per-session", "100%")
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    geo = Geometry(
        groups=[[65536]], blocks_per_chunk=1, world_size=1, num_blocks=64, namespace="small"
    )
    eng = Engine(c, geo, 0)
    events: list[pb.WatchEvent] = []
    got = threading.Event()

    def on_event(e: pb.WatchEvent) -> None:
        events.append(e)
        got.set()

    watch = c.watch("small", on_event)
    keys = [make_key(i, 0) for i in range(24)]
    for i in range(16):
        eng.fill(0, [keys[i]], [i], 0)
        assert eng.job(pb.STORE, [keys[i]], [[i]], [0]).stored_keys == 1
    assert c.pin("small", [keys[0]]) == [True]  # the oldest, but pinned
    for i in range(16, 20):  # four more: evicts keys 1..4, never key 0
        eng.fill(0, [keys[i]], [i], 0)
        res = eng.job(pb.STORE, [keys[i]], [[i]], [0])
        assert res.success and res.stored_keys == 1
    ready = c.lookup("small", keys[:20])
    assert ready == [True] + [False] * 4 + [True] * 15
    deadline = time.time() + 5
    while time.time() < deadline:
        removed = [k for e in events if e.kind == pb.WatchEvent.REMOVED for k in e.keys]
        if len(removed) >= 4:
            break
        time.sleep(0.05)
    assert removed == keys[1:5]
    # Pin everything: a store that cannot get space is dropped with a reason, not an error.
    assert all(c.pin("small", [k for k, r in zip(keys[:20], ready, strict=True) if r]))
    eng.fill(0, [keys[20]], [20], 0)
    res = eng.job(pb.STORE, [keys[20]], [[20]], [0])
    assert res.success and res.dropped_keys == 1 and "pinned" in res.drop_reason
    # The pinned blocks still load intact (into other block ids).
    res = eng.job(pb.LOAD, [keys[0]], [[40]], [0])
    assert res.success and eng.mismatches(0, [keys[0]], [40], 0) == 0
    watch.stop()
    c.close()


def test_a_rank_that_finds_the_pool_full_leaves_its_mate_no_row_that_cannot_be_whole(
    daemon_factory,
) -> None:
    """TP=2 through a real daemon: rank 0 runs ahead into a full pool and drops keys;
    rank 1, coming after the rows before them are whole, drops those keys too instead
    of evicting whole rows for rows rank 0 will never write (before, those rows held
    the pool for the reservation timeout)."""
    # 32 KiB a rank, 64 KiB rows: 16 rows in a 1 MiB pool, all one session may write.
    d = daemon_factory("--pool-size", "1MiB", "--max-writing-per-session", "100%")
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    geo = Geometry(
        groups=[[32768]], blocks_per_chunk=1, world_size=2, num_blocks=64, namespace="ahead"
    )
    ranks = [Engine(c, geo, 0), Engine(c, geo, 1)]
    keys = [make_key(i, 0) for i in range(20)]
    for eng in ranks:
        eng.fill(0, keys, list(range(20)), 0)
    head = ranks[0].job(pb.STORE, keys[:16], [list(range(16))], [0])
    assert head.success and head.stored_keys == 16  # the pool is all rank 0's rows
    ahead = ranks[0].job(pb.STORE, keys[16:], [list(range(16, 20))], [16])
    # (Its session's quota, the whole pool, is what refuses them first: it holds it all.)
    assert ahead.success and ahead.stored_keys == 0 and ahead.dropped_keys == 4
    done = ranks[1].job(pb.STORE, keys[:16], [list(range(16))], [0])
    assert done.success and done.stored_keys == 16  # whole rows: evictable now
    late = ranks[1].job(pb.STORE, keys[16:], [list(range(16, 20))], [16])
    assert late.success and late.stored_keys == 0 and late.dropped_keys == 4
    assert "another rank of this block row dropped it" in late.drop_reason
    assert d.stats().writing_blocks == 0
    assert c.lookup("ahead", keys) == [True] * 16 + [False] * 4
    # Every whole row still loads, byte for byte, on both ranks (into other blocks).
    for eng in ranks:
        res = eng.job(pb.LOAD, keys[:16], [list(range(32, 48))], [0])
        assert res.success, res.error
        assert eng.mismatches(0, keys[:16], list(range(32, 48)), 0) == 0
    # Rank 0 storing key 16 anew (a later step) is a new attempt: its mate joins it.
    assert ranks[0].job(pb.STORE, keys[16:17], [[16]], [16]).stored_keys == 1
    assert ranks[1].job(pb.STORE, keys[16:17], [[16]], [16]).stored_keys == 1
    assert c.lookup("ahead", keys[16:17]) == [True]
    assert d.stats().writing_blocks == 0
    c.close()


def test_same_key_in_another_namespace_misses_and_slot_sizes_coexist(daemon, client) -> None:
    a = Geometry(world_size=1, namespace="model-a")  # 4 KiB + 1 KiB pages
    b = Geometry(groups=[[2048] * 4], world_size=1, blocks_per_chunk=4, namespace="model-b")
    ea, eb = Engine(client, a, 0), Engine(client, b, 0)
    ka, ba, ia = chunk_plan(a, range(0, 8))
    kb, bb, ib = chunk_plan(b, range(0, 8))
    assert ka[:8] == kb  # the very same keys (group 0) ...
    for g, blocks in enumerate(ba):
        ea.fill(g, ka[g * 8 : (g + 1) * 8], blocks, ia[g])
    eb.fill(0, kb, bb[0], ib[0])
    assert ea.job(pb.STORE, ka, ba, ia).success
    assert client.lookup("model-b", kb) == [False] * 8  # ... miss in the other namespace
    assert eb.job(pb.STORE, kb, bb, ib).success
    ns = {
        n.id: n for n in client.admin.ListNamespaces(admin_pb2.ListNamespacesRequest()).namespaces
    }
    assert list(ns["model-a"].slot_bytes) == [16384, 6144]
    assert list(ns["model-b"].slot_bytes) == [32768]
    # Both namespaces' bytes come back intact from the one pool.
    la = [[x + 200 for x in blocks] for blocks in ba]
    assert ea.job(pb.LOAD, ka, la, ia).success
    assert sum(ea.mismatches(g, ka[g * 8 : (g + 1) * 8], la[g], ia[g]) for g in range(2)) == 0
    lb = [[x + 200 for x in bb[0]]]
    assert eb.job(pb.LOAD, kb, lb, ib).success
    assert eb.mismatches(0, kb, lb[0], ib[0]) == 0


def test_unaligned_first_block_loads_the_right_sub_blocks(daemon, client) -> None:
    geo = Geometry(groups=[[1024, 1024]], world_size=1, blocks_per_chunk=4, namespace="unaligned")
    eng = Engine(client, geo, 0)
    keys = [make_key(i, 0) for i in range(3)]
    eng.fill(0, keys, list(range(12)), 0)
    assert eng.job(pb.STORE, keys, [list(range(12))], [0]).stored_keys == 3
    # Logical blocks 6..10: the second half of chunk 1 and three blocks of chunk 2.
    dst = [100, 101, 102, 103, 104]
    res = eng.job(pb.LOAD, keys[1:], [dst], [6])
    assert res.success and res.bytes == 5 * 2048
    assert eng.mismatches(0, keys[1:], dst, 6) == 0


def test_inline_put_and_get_round_trip(daemon, client) -> None:
    geo = Geometry(world_size=2, namespace="inline")
    reg = client.register_kv(geo.layout(), 1, None, [], [])
    assert reg.memory_path == "inline"
    k = make_key(1, 1)
    section = geo.blocks_per_chunk * sum(geo.groups[1])
    assert client.put("inline", k, 1, b"\x01" * section).outcome == "stored"
    assert client.lookup("inline", [k]) == [False]
    assert client.put("inline", k, 0, b"\x02" * section).ready
    assert client.get("inline", k, 0) == b"\x02" * section
    assert client.get("inline", k, 1) == b"\x01" * section
