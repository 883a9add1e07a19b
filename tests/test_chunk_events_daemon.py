"""Chunk events (TransferJob.key_events) in the daemon, and their translation into vLLM's
KV events (kvdepot.server.kv_events.EventTranslator), without vLLM.

A store's chunk events are kept beside its rows, counted, handed with Watch events to a
watcher that asked, and dropped with the rows; a job whose events are not one per key,
or one of which is too large, is refused with INVALID_ARGUMENT and changes nothing,
and the daemon keeps storing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvdepot.client import DepotClient
from kvdepot.common.jobs import Job, JobResult
from kvdepot.server.core import journal
from kvdepot.server.kv_events import BlockRemoved, BlockStored, EventTranslator
from kvdepot.server.state.jobs import MAX_CHUNK_EVENT_BYTES
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan


def chunk_event(hashes: list[bytes], parent: bytes = b"", tokens: int = 16) -> bytes:
    return pb.ChunkEvent(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(1000, 1000 + tokens)),
        block_size=16,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    ).SerializeToString()


# -- the translator (sans I/O) --------------------------------------------------------------


def test_a_chunk_event_becomes_a_complete_block_stored_and_its_removal_names_its_hashes() -> None:
    tr = EventTranslator(int_hashes=True)
    h1, h2, parent = b"\x01" * 32, b"\x02" * 32, b"\x00" * 31 + b"\x09"
    key = h2 + (0).to_bytes(4, "big")
    [stored] = tr.stored("ns", [key], [chunk_event([h1, h2], parent, tokens=32)])
    assert stored.block_hashes == [int.from_bytes(h1[-8:], "big"), int.from_bytes(h2[-8:], "big")]
    assert stored.parent_block_hash == 9
    assert stored.token_ids == list(range(1000, 1032))
    assert (stored.block_size, stored.group_idx, stored.medium) == (16, 0, "CPU")
    assert tr.rows_remembered == 1
    [removed] = tr.removed("ns", [key])
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == stored.block_hashes and removed.group_idx == 0
    assert tr.rows_remembered == 0  # forgotten with the row


def test_no_or_a_bad_chunk_event_gives_vllms_placeholder() -> None:
    tr = EventTranslator(int_hashes=False)
    key = b"\x07" * 32 + (1).to_bytes(4, "big")
    for data in (b"", b"\xff\xff not a ChunkEvent"):
        [e] = tr.stored("ns", [key], [data])
        assert isinstance(e, BlockStored)
        assert (e.block_hashes, e.token_ids, e.block_size, e.group_idx) == ([key[:-4]], [], 0, 1)
    assert tr.rows_remembered == 0
    [removed] = tr.removed("ns", [key])
    assert removed.block_hashes == [key[:-4]]


# -- the daemon -------------------------------------------------------------------------------


@pytest.fixture
def setup(daemon_factory):
    d = daemon_factory("--pool-size", "16MiB")
    c = DepotClient(d.target, client_name="chunk-events").start()
    assert c.wait_connected(10)
    geo = Geometry(world_size=1, namespace="chunk-events")
    eng = Engine(c, geo, 0)
    yield d, c, geo, eng
    c.close()


def store(eng: Engine, keys: list[bytes], blocks, idx, **fields: Any) -> JobResult:
    job = Job(
        eng._next_job,
        pb.STORE,
        keys,
        [b for bl in blocks for b in bl],
        [len(b) for b in blocks],
        idx,
        registration_id=eng.registration.registration_id,
        **fields,
    )
    eng._next_job += 1
    eng.stream.submit(job)
    assert eng.stream.wait({job.job_id}, timeout=10)
    (res,) = [r for r in eng.stream.poll() if r.job_id == job.job_id]
    return res


def test_the_daemon_keeps_counts_hands_on_and_drops_chunk_events(setup) -> None:
    d, c, geo, eng = setup
    keys, blocks, idx = chunk_plan(geo, range(0, 2))
    ns = geo.layout().id
    events = [chunk_event([k[:-4]]) for k in keys]

    # Refused, nothing stored: not one per key; one too large.
    bad = store(eng, keys, blocks, idx, key_events=events[:-1])
    assert (bad.success, bad.error_code) == (
        False,
        "INVALID_ARGUMENT",
    ) and "one per key" in bad.error
    huge = [b"x" * (MAX_CHUNK_EVENT_BYTES + 1), *events[1:]]
    bad = store(eng, keys, blocks, idx, key_events=huge)
    assert (bad.success, bad.error_code) == (False, "INVALID_ARGUMENT")
    assert str(MAX_CHUNK_EVENT_BYTES) in bad.error
    assert d.stats().ready_blocks == 0

    # A watcher that asks for them gets them with the snapshot and the STORED event.
    seen: list[pb.WatchEvent] = []
    got, watching = threading.Event(), threading.Event()

    def on_event(e: pb.WatchEvent) -> None:
        seen.append(e)
        if e.kind == pb.WatchEvent.SNAPSHOT_END:
            watching.set()
        elif e.kind == pb.WatchEvent.STORED:
            got.set()

    watch = c.watch(ns, on_event, key_events=True)
    assert watching.wait(10)  # subscribed: the store comes as STORED, not in a snapshot
    ok = store(eng, keys, blocks, idx, key_events=events)
    assert ok.success, ok.error
    assert got.wait(10)
    stored = {
        k: e
        for m in seen
        if m.kind == pb.WatchEvent.STORED
        for k, e in zip(m.keys, m.key_events, strict=True)
    }
    assert stored == dict(zip(keys, events, strict=True))
    st = d.stats()
    assert (st.chunk_event_rows, st.chunk_event_bytes) == (len(keys), sum(map(len, events)))
    watch.stop()

    # A later watcher's snapshot carries them; one that does not ask gets none.
    snap: list[pb.WatchEvent] = []
    done = threading.Event()

    def on_snapshot(e: pb.WatchEvent) -> None:
        snap.append(e)
        if e.kind == pb.WatchEvent.SNAPSHOT_END:
            done.set()

    for asked in (True, False):
        snap.clear()
        done.clear()
        w = c.watch(ns, on_snapshot, key_events=asked)
        assert done.wait(10)
        w.stop()
        held = {
            k: e
            for m in snap
            if m.kind == pb.WatchEvent.SNAPSHOT
            for k, e in zip(m.keys, m.key_events or [b""] * len(m.keys), strict=True)
        }
        assert set(held) == set(keys)
        assert held == (dict(zip(keys, events, strict=True)) if asked else dict.fromkeys(keys, b""))

    # Gone with the rows; their REMOVED events carry them to a watcher that asks (an
    # engine keeps none until then), to none that does not.
    removals: dict[bool, list[pb.WatchEvent]] = {True: [], False: []}
    ended = {True: threading.Event(), False: threading.Event()}
    subscribed = {True: threading.Event(), False: threading.Event()}
    watchers = []
    for asked in (True, False):

        def on_removal(e: pb.WatchEvent, asked: bool = asked) -> None:
            if e.kind == pb.WatchEvent.SNAPSHOT_END:
                subscribed[asked].set()
            elif e.kind == pb.WatchEvent.REMOVED:
                removals[asked].append(e)
                if sum(len(m.keys) for m in removals[asked]) >= len(keys):
                    ended[asked].set()

        watchers.append(c.watch(ns, on_removal, key_events=asked))
    assert all(ev.wait(10) for ev in subscribed.values())
    res = c.admin.Evict(admin_pb2.EvictRequest(namespace_id=ns, keys=keys))
    assert res.evicted_blocks == len(keys)
    for asked in (True, False):
        assert ended[asked].wait(10)
        got_removed = {
            k: e
            for m in removals[asked]
            for k, e in zip(m.keys, m.key_events or [b""] * len(m.keys), strict=True)
        }
        assert got_removed == (
            dict(zip(keys, events, strict=True)) if asked else dict.fromkeys(keys, b"")
        )
    for w in watchers:
        w.stop()
    st = d.stats()
    assert (st.chunk_event_rows, st.chunk_event_bytes) == (0, 0)


def snapshot_events(c: DepotClient, ns: str) -> dict[bytes, bytes]:
    """What a new watcher asking for chunk events hears the pool holds: key -> event."""
    snap: list[pb.WatchEvent] = []
    done = threading.Event()

    def on_event(e: pb.WatchEvent) -> None:
        snap.append(e)
        if e.kind == pb.WatchEvent.SNAPSHOT_END:
            done.set()

    w = c.watch(ns, on_event, key_events=True)
    assert done.wait(10)
    w.stop()
    return {
        k: e
        for m in snap
        if m.kind == pb.WatchEvent.SNAPSHOT
        for k, e in zip(m.keys, m.key_events or [b""] * len(m.keys), strict=True)
    }


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_chunk_events_survive_a_restart(daemon_factory, tmp_path, how: str) -> None:
    """With --pool-file, rows back after a clean restart (the index snapshot) or a
    crash (the journal, rows verified) carry the chunk events they were stored with:
    counted again, and handed to watchers as before."""
    pool = tmp_path / "kvdepot.pool"
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(pool))
    c = DepotClient(d.target, client_name="chunk-events").start()
    assert c.wait_connected(10)
    geo = Geometry(world_size=1, namespace="chunk-events")
    eng = Engine(c, geo, 0)
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    ns = geo.layout().id
    events = [chunk_event([k[:-4]], tokens=16 + i) for i, k in enumerate(keys)]
    events[1] = b""  # a row stored without one comes back without one
    assert store(eng, keys, blocks, idx, key_events=events).success
    want = dict(zip(keys, events, strict=True))
    assert snapshot_events(c, ns) == want
    c.close()
    if how == "sigterm":
        assert d.stop() == 0
    else:
        deadline = time.monotonic() + 20
        while True:  # every row listed with its checksum (wait_sealed's check, our NS)
            rows = journal.replay(Path(str(pool) + journal.SUFFIX).read_bytes()).rows
            if all((ns, k) in rows and rows[ns, k].crc is not None for k in keys):
                break
            assert time.monotonic() < deadline, "rows never got their checksum"
            time.sleep(0.05)
        d.kill()
    d.start()
    if how == "sigkill":
        deadline = time.monotonic() + 20
        while d.stats().ready_blocks < len(keys):
            assert time.monotonic() < deadline, "rows not recovered"
            time.sleep(0.05)
        assert "crash recovery" in d.log()
    st = d.stats()
    assert st.ready_blocks == len(keys)
    held = [e for e in events if e]
    assert (st.chunk_event_rows, st.chunk_event_bytes) == (len(held), sum(map(len, held)))
    c = DepotClient(d.target, client_name="after-restart").start()
    assert c.wait_connected(10)
    assert snapshot_events(c, ns) == want
    c.close()


def disk_events(c: DepotClient, ns: str, want: int) -> dict[bytes, bytes]:
    """What a new watcher asking for chunk events hears is on the disk tier (the
    STORED event of tier DISK after its snapshot): key -> event, once `want` keys came."""
    got: dict[bytes, bytes] = {}
    done = threading.Event()

    def on_event(e: pb.WatchEvent) -> None:
        if e.kind == pb.WatchEvent.STORED and e.tier == pb.WatchEvent.TIER_DISK:
            got.update(zip(e.keys, e.key_events or [b""] * len(e.keys), strict=True))
            if len(got) >= want:
                done.set()

    w = c.watch(ns, on_event, key_events=True)
    assert done.wait(10), f"{len(got)} of {want} disk keys announced"
    w.stop()
    return got


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_disk_records_keep_chunk_events_across_a_restart(daemon_factory, tmp_path, how) -> None:
    """Records of the disk tier hold their rows' chunk events: after a clean restart
    (the disk's index checkpoint) or a crash (its header scan) they are announced with
    them, counted, and a row promoted back into the pool carries its own."""
    d = daemon_factory(
        "--pool-size", "16MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )  # fmt: skip
    c = DepotClient(d.target, client_name="chunk-events").start()
    assert c.wait_connected(10)
    geo = Geometry(world_size=1, namespace="chunk-events")
    eng = Engine(c, geo, 0)
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    ns = geo.layout().id
    events = [chunk_event([k[:-4]], tokens=16 + i) for i, k in enumerate(keys)]
    events[2] = b""  # a row stored without one: its record has none
    assert store(eng, keys, blocks, idx, key_events=events).success
    want = dict(zip(keys, events, strict=True))
    deadline = time.monotonic() + 20
    while d.stats().disk_writes < len(keys):
        assert time.monotonic() < deadline, "rows never reached the disk"
        time.sleep(0.05)
    res = c.admin.Evict(admin_pb2.EvictRequest(namespace_id=ns, keys=keys))
    assert res.evicted_blocks == len(keys)  # on disk only from now on
    c.close()
    if how == "sigterm":
        assert d.stop() == 0
    else:
        d.kill()
    d.start()
    deadline = time.monotonic() + 20
    while not (st := d.stats()).disk_recovery_complete:
        assert time.monotonic() < deadline, "the disk's index never came back"
        time.sleep(0.05)
    assert st.disk_recovery_source == ("checkpoint" if how == "sigterm" else "scan")
    held = [e for e in events if e]
    assert (st.chunk_event_rows, st.chunk_event_bytes) == (len(held), sum(map(len, held)))
    c = DepotClient(d.target, client_name="after-restart").start()
    assert c.wait_connected(10)
    Engine(c, geo, 0)  # declares the namespace again (the pool restarted empty)
    assert disk_events(c, ns, len(keys)) == want

    # Promoted back into the pool: the rows carry the records' events.
    assert all(s == pb.PrefetchResponse.FETCHING for s in c.prefetch(ns, keys).states)
    deadline = time.monotonic() + 20
    while not all(c.lookup(ns, keys)):
        assert time.monotonic() < deadline, "rows never promoted"
        time.sleep(0.05)
    assert snapshot_events(c, ns) == want
    c.close()
