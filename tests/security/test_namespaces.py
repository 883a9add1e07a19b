"""Namespaces are joined, not named; quotas per session (docs/security.md).

Against a real `kvdepot serve`, with tenant B a separate process
(tests/security/tenant.py) that names tenant A's namespace with raw stubs: every
call is refused with PERMISSION_DENIED, and A's own store and load stay
byte-exact. A second engine of A's namespace (another process) joins by
registering and loads A's blocks. The per-session quotas (pinned bytes, bytes
being written, Watch streams) refuse the session past them and nobody else; a
namespace nothing uses any more is forgotten.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvdepot.client import DepotClient, session_stub
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import connect
from tests.support.engine import Engine, Geometry, make_key
from tests.support.ops import admin, load, store

HERE = Path(__file__).parent
JOIN_FIRST = "RegisterKV into the namespace first"
# One group of two 4 KiB layers, 2 blocks a chunk: 16 KiB a rank's section.
GEO_A = Geometry(groups=[[4096, 4096]], world_size=1, num_blocks=128, namespace="tenant-a")
SECTION = GEO_A.blocks_per_chunk * sum(GEO_A.layer_pages)


def namespaces(d) -> int:
    ch, stub = admin(d)
    with ch:
        return stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).namespaces


def tenant_b(target: str, namespace: str, key: bytes, registration: int, *flags: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "tenant.py"),
            "--target",
            target,
            "--namespace",
            namespace,
            "--key",
            key.hex(),
            "--section",
            str(SECTION),
            "--registration",
            str(registration),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_tenant_that_never_joined_is_refused_every_call(daemon) -> None:
    a = connect(daemon.target, "tenant-a")
    eng = Engine(a, GEO_A, 0)
    store(eng, range(4))
    keys = [make_key(c, 0) for c in range(4)]
    got = tenant_b(daemon.target, GEO_A.namespace, keys[0], eng.registration.registration_id)
    for call in ("get", "lookup", "watch", "pin", "unpin", "put", "prefetch"):
        assert got[call]["code"] == "PERMISSION_DENIED", (call, got[call])
        assert JOIN_FIRST in got[call]["message"], (call, got[call])
    for job in ("transfer_load", "lane_load"):  # a LOAD job naming A's registration
        assert got[job]["code"] == "PERMISSION_DENIED", (job, got[job])
        assert JOIN_FIRST in got[job]["message"]
        # B named a registration, not a namespace: the refusal must not tell which.
        assert GEO_A.namespace not in got[job]["message"], got[job]
    assert got["pin_lane_closed"] and got["unpin_lane_closed"]
    # A's blocks are untouched (B's Put wrote nothing) and A's own calls work.
    assert a.lookup(GEO_A.namespace, keys) == [True] * 4
    assert a.pin(GEO_A.namespace, keys) == [True] * 4
    load(eng, range(4), base_block=32)
    a.close()


def test_an_observer_may_watch_lookup_and_pin_but_never_read_or_write(daemon) -> None:
    a = connect(daemon.target, "tenant-a")
    eng = Engine(a, GEO_A, 0)
    store(eng, range(2))
    key = make_key(0, 0)
    got = tenant_b(daemon.target, GEO_A.namespace, key, eng.registration.registration_id, "--join")
    assert got["join"]["code"] == "OK" and "observer" in got["join"]["message"]
    for call in ("lookup", "pin", "unpin", "watch", "prefetch"):
        assert got[call]["code"] == "OK", (call, got[call])
    assert "true" in got["lookup"]["message"]  # the key is ready
    for call in ("get", "put"):  # an observer maps no memory
        assert got[call]["code"] == "PERMISSION_DENIED", (call, got[call])
        assert "observer" in got[call]["message"]
    # A's registration stays A's session's own (the job runner refuses it).
    assert got["transfer_load"]["code"] == "FAILED_PRECONDITION"
    assert not got["pin_lane_closed"] and not got["unpin_lane_closed"]
    load(eng, range(2), base_block=32)
    a.close()


def test_a_second_engine_of_the_namespace_joins_and_loads_its_blocks(daemon) -> None:
    geo = Geometry(world_size=1, namespace="shared-model")  # engine.py's default groups
    a = connect(daemon.target, "engine-a")
    store(Engine(a, geo, 0), range(10))
    loader = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "support" / "engine.py"),
            "verify",
            "--target",
            daemon.target,
            "--ranks",
            "0",
            "--world-size",
            "1",
            "--namespace",
            geo.namespace,
            "--chunks",
            "10",
            "--base-block",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(loader.stdout)
    assert report["failed"] == 0 and report["jobs"] == 1, report
    assert report["mismatched_pages"] == 0, report
    a.close()


def test_pins_past_the_quota_are_refused_for_every_session_of_the_process(
    daemon_factory,
) -> None:
    d = daemon_factory("--pool-size", "4MiB", "--max-pinned-per-session", "256KiB")
    a, b = connect(d.target, "engine-a"), connect(d.target, "engine-b")
    store(Engine(a, GEO_A, 0), range(40))
    keys = [make_key(c, 0) for c in range(40)]
    assert a.pin(GEO_A.namespace, keys[:16]) == [True] * 16  # 16 x 16 KiB: the quota
    with pytest.raises(grpc.RpcError) as err:
        a.pin(GEO_A.namespace, keys[16:18])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-pinned-per-session" in (err.value.details() or "")
    ch, stub = admin(d)
    with ch:
        assert stub.GetStats(admin_pb2.GetStatsRequest()).pinned_blocks == 16  # none more
    # Another session of the same process shares the process's quota (each used to
    # have one of its own: two sessions held the pool whole); tests/security/
    # test_shares.py has another process store and load beside them.
    with pytest.raises(grpc.RpcError) as err:
        b.pin(GEO_A.namespace, keys[16:18])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert a.pin(GEO_A.namespace, keys[:4]) == [True] * 4  # pinned again: costs nothing
    a.unpin(GEO_A.namespace, keys[:8], wait=True)  # keys 4..7 free up, 0..3 still held once
    assert b.pin(GEO_A.namespace, keys[32:36]) == [True] * 4
    a.close()
    b.close()


def test_rows_being_written_past_the_quota_are_dropped(daemon_factory) -> None:
    # World size 2: a rank-0 store leaves its rows WRITING until rank 1 writes too.
    geo = Geometry(groups=[[4096, 4096]], world_size=2, num_blocks=64, namespace="half-written")
    slot = 2 * SECTION  # both ranks' sections
    d = daemon_factory("--pool-size", "4MiB", "--max-writing-per-session", str(3 * slot))
    a, b = connect(d.target, "rank0"), connect(d.target, "rank1")
    rank0 = Engine(a, geo, 0)
    res = store(rank0, range(5))
    assert (res.stored_keys, res.dropped_keys) == (3, 2)
    assert "--max-writing-per-session" in res.drop_reason
    # The other session of this process shares its quota: no fresh row of its own.
    rank1 = Engine(b, geo, 1)
    res = store(rank1, range(10, 12))
    assert (res.stored_keys, res.dropped_keys) == (0, 2)
    # Rank 1 completes rows 0..2; rows 3 and 4, which rank 0 gave up, it drops too
    # rather than begin rows rank 0 will not write (they would hold the pool).
    res = store(rank1, range(5))
    assert (res.stored_keys, res.dropped_keys) == (3, 2)
    assert "another rank of this block row dropped it" in res.drop_reason
    assert a.lookup(geo.namespace, [make_key(c, 0) for c in range(3)]) == [True] * 3
    # Completed rows are charged to nobody: the quota is free again, and rank 0's new
    # attempt at rows 3 and 4 (and one more: its whole quota) is stored, which rank 1
    # then completes.
    res = store(rank0, range(3, 6))
    assert (res.stored_keys, res.dropped_keys) == (3, 0)
    res = store(rank1, range(3, 6))
    assert (res.stored_keys, res.dropped_keys) == (3, 0)
    assert a.lookup(geo.namespace, [make_key(c, 0) for c in range(6)]) == [True] * 6
    a.close()
    b.close()


def test_watch_streams_past_the_session_limit_are_refused(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB", "--max-watches-per-session", "2")
    a, b = connect(d.target, "watcher-a"), connect(d.target, "watcher-b")
    a.join(GEO_A.namespace)
    req = pb.WatchRequest(session_id=a.session_id, namespace_id=GEO_A.namespace)
    calls = [a.stub.Watch(req) for _ in range(2)]
    for call in calls:
        assert next(iter(call)).kind == pb.WatchEvent.SNAPSHOT  # open
    third = a.stub.Watch(req, timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        next(iter(third))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-watches-per-session" in (err.value.details() or "")
    # Another session watches as ever; and an ended stream frees its place.
    events: list[pb.WatchEvent] = []
    watch_b = b.watch(GEO_A.namespace, events.append)
    assert wait_for(lambda: any(e.kind == pb.WatchEvent.SNAPSHOT_END for e in events))
    calls.pop().cancel()

    def reopened() -> bool:
        call = a.stub.Watch(req, timeout=10)
        try:
            return next(iter(call)).kind == pb.WatchEvent.SNAPSHOT
        except grpc.RpcError:
            return False
        finally:
            call.cancel()

    assert wait_for(reopened)
    watch_b.stop()
    for c in calls:
        c.cancel()
    a.close()
    b.close()


def test_membership_and_its_watch_streams_end_with_the_session(daemon) -> None:
    with grpc.insecure_channel(daemon.target) as session_ch, daemon.channel() as watch_ch:
        stub = session_stub(session_ch)
        session = stub.Session(pb.SessionRequest(client_name="short-lived"))
        sid = next(iter(session)).hello.session_id
        layout = pb.NamespaceLayout(id="observed")
        stub.RegisterKV(pb.RegisterKVRequest(session_id=sid, namespace=layout), timeout=10)
        watch = session_stub(watch_ch).Watch(
            pb.WatchRequest(session_id=sid, namespace_id="observed")
        )
        it = iter(watch)
        assert next(it).kind == pb.WatchEvent.SNAPSHOT
        assert next(it).kind == pb.WatchEvent.SNAPSHOT_END
        session.cancel()  # the session ends: its Watch stream (another channel) ends too
        with pytest.raises(StopIteration):
            next(it)
        with pytest.raises(grpc.RpcError) as err:  # and its membership is gone
            session_stub(watch_ch).Lookup(
                pb.LookupRequest(session_id=sid, namespace_id="observed"), timeout=10
            )
        assert err.value.code() in (
            grpc.StatusCode.FAILED_PRECONDITION,  # the session is unknown now
            grpc.StatusCode.PERMISSION_DENIED,
        )


def test_the_client_joins_again_after_a_daemon_restart(daemon) -> None:
    c = DepotClient(daemon.target, client_name="rejoiner").start()
    assert c.wait_connected(10)
    events: list[pb.WatchEvent] = []
    watch = c.watch("rejoined", events.append)
    ends = lambda: sum(e.kind == pb.WatchEvent.SNAPSHOT_END for e in events)  # noqa: E731
    assert wait_for(lambda: ends() == 1)
    boot = c.boot_id
    daemon.restart()
    assert wait_for(lambda: c.connected and c.boot_id != boot, 20)
    # The Watch stream is back in the new session (joined again before it resumed),
    # and the library's calls join by themselves.
    assert wait_for(lambda: ends() == 2, 20)
    geo = Geometry(groups=[[4096, 4096]], world_size=1, num_blocks=64, namespace="rejoined")
    store(Engine(c, geo, 0), range(2))
    assert c.lookup("rejoined", [make_key(0, 0), make_key(1, 0)]) == [True, True]
    watch.stop()
    c.close()


def test_a_namespace_nothing_uses_is_forgotten(daemon) -> None:
    before = namespaces(daemon)
    c = connect(daemon.target, "many-namespaces")
    for i in range(20):  # registered and dropped: layouts only, no blocks
        geo = Geometry(groups=[[4096] * 64] * 8, world_size=1, namespace=f"dropped-{i}")
        c.register_kv(geo.layout(), 0, None, [], [])
    kept = Geometry(groups=[[4096, 4096]], world_size=1, num_blocks=64, namespace="kept")
    store(Engine(c, kept, 0), range(1))
    assert namespaces(daemon) == before + 21
    c.close()
    # The session's end drops its registrations: the empty namespaces go, the one
    # with a block stays (the cache outlives its engines).
    assert wait_for(lambda: namespaces(daemon) == before + 1), namespaces(daemon)
    ch, stub = admin(daemon)
    with ch:
        stub.Clear(admin_pb2.ClearRequest(), timeout=10)  # its block goes: it goes too
    assert wait_for(lambda: namespaces(daemon) == before), namespaces(daemon)
    # An UnregisterKV forgets it too, while the session lives on.
    c = connect(daemon.target, "unregisters")
    reg = c.register_kv(kept.layout(), 0, None, [], [])
    assert namespaces(daemon) == before + 1
    c.unregister_kv(reg.registration_id)
    assert namespaces(daemon) == before
    c.close()
