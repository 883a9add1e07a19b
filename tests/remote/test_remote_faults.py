"""Faults in the remote tier: values planted with `redis-cli SET` that do not
verify, a server killed and started again, a cluster master SIGKILLed, the whole
cluster stopped and restarted. No hang, no wrong bytes, recovery without
restarting any daemon."""

from __future__ import annotations

import subprocess
import time

import redis

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.remote.helpers import prefetch
from tests.remote.test_remote_daemons import load_and_compare, node, store_on
from tests.support.daemon import stats
from tests.support.engine import Engine, Geometry
from tests.support.fleet_key import shared_codec


def plant(port: int, key: bytes, value: bytes) -> None:
    """SET through redis-cli (binary-safe: escaped on its standard input)."""

    def esc(b: bytes) -> str:
        return '"' + "".join(f"\\x{c:02x}" for c in b) + '"'

    out = subprocess.run(
        ["redis-cli", "-p", str(port)],
        input=f"SET {esc(key)} {esc(value)}\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "OK" in out.stdout, out.stdout + out.stderr


def test_values_that_do_not_verify_are_counted_and_never_loaded(
    redis_standalone, daemon_factory
) -> None:
    geo = Geometry(namespace=f"verify-{time.monotonic_ns()}")
    other = Geometry(namespace=f"others-{time.monotonic_ns()}")  # as long as geo's id
    chunks = range(0, 4)
    _, a = node(daemon_factory, redis_standalone.url)
    _, b = node(daemon_factory, redis_standalone.url)
    _, keys = store_on(a, geo, chunks)
    _, other_keys = store_on(a, other, chunks)
    n = len(keys) + len(other_keys)
    wait_for(lambda: stats(a).remote_writes == n, what="A's writes")

    r = redis.Redis(port=redis_standalone.port)
    codec = shared_codec()
    names = [codec.remote_key(geo.namespace, k) for k in keys]
    good = r.get(names[0])
    flipped = bytearray(good)
    flipped[-100] ^= 0x40
    plant(redis_standalone.port, names[0], bytes(flipped))  # corrupted
    plant(redis_standalone.port, names[1], good[: len(good) // 2])  # truncated
    # Another namespace's row (same key) under this namespace's name.
    plant(redis_standalone.port, names[2], r.get(codec.remote_key(other.namespace, keys[2])))
    plant(redis_standalone.port, names[3], b"not a kvdepot value")

    engines_b = [Engine(b, geo, rk) for rk in range(geo.world_size)]
    # One key a Prefetch: a key refused at its size ends the run a Prefetch fetches.
    states = [prefetch(b, geo.namespace, [k]).states[0] for k in keys]
    # A value of another size than this layout's rows is refused before it is downloaded
    # (the truncated one, the one not ours); the corrupted one and the other namespace's
    # row are fetched and fail their checks (MAC, namespace).
    absent, fetching = pb.PrefetchResponse.ABSENT, pb.PrefetchResponse.FETCHING
    assert list(states) == [fetching, absent, fetching, absent] + [fetching] * (len(keys) - 4)
    bad = keys[:4]
    wait_for(lambda: all(b.lookup(geo.namespace, keys[4:])), what="the intact rows")
    wait_for(lambda: stats(b).remote_verify_failures == 4, what="4 verify failures")
    assert b.lookup(geo.namespace, bad) == [False] * 4  # never loaded
    assert stats(b).remote_hits == len(keys) - 4
    # The intact rows load byte for byte.
    n_good = len(keys) - 4
    for e in engines_b:
        res = e.job(pb.LOAD, bad, [[], []], [0, 0])
        assert not res.success  # nothing of a bad row can be read
    assert n_good > 0
    a.close()
    b.close()


def test_server_down_costs_nothing_and_recovery_needs_no_restart(tmp_path, daemon_factory) -> None:
    from tests.support.redis_servers import RedisServer, free_ports

    server = RedisServer(tmp_path / "r", free_ports(1)[0]).start()
    try:
        geo = Geometry(namespace=f"down-{time.monotonic_ns()}")
        da, a = node(daemon_factory, server.url)
        _, b = node(daemon_factory, server.url)
        engines_b = [Engine(b, geo, rk) for rk in range(geo.world_size)]
        server.kill()
        # Stores on A go on at full speed; their writes are dropped and counted.
        t0 = time.monotonic()
        _, keys = store_on(a, geo, range(0, 4))
        assert time.monotonic() - t0 < 5
        wait_for(lambda: stats(a).remote_write_drops >= 1, what="dropped writes")
        # Prefetch on B answers at once: ABSENT, the tier unhealthy.
        t0 = time.monotonic()
        resp = prefetch(b, geo.namespace, keys)
        assert time.monotonic() - t0 < 1.0
        assert list(resp.states) == [pb.PrefetchResponse.ABSENT] * len(keys)
        assert "not answering" in da.log()

        server.start()  # back on the same port: both daemons resume by themselves
        wait_for(lambda: "answers again after" in da.log(), what="A noticing the tier is back")
        _, keys2 = store_on(a, geo, range(10, 14))

        def fetched() -> bool:
            prefetch(b, geo.namespace, keys2)
            return all(b.lookup(geo.namespace, keys2))

        wait_for(fetched, timeout=30, what="rows fetched after the server came back")
        assert load_and_compare(engines_b, geo, range(10, 14), keys2) == 0
        a.close()
        b.close()
    finally:
        server.kill()


def test_cluster_master_killed_then_whole_cluster_restarted(own_cluster, daemon_factory) -> None:
    geo = Geometry(namespace=f"cl-{time.monotonic_ns()}")
    da, a = node(daemon_factory, own_cluster.url)
    _, b = node(daemon_factory, own_cluster.url)
    engines_b = [Engine(b, geo, rk) for rk in range(geo.world_size)]
    _, keys = store_on(a, geo, range(0, 4))
    wait_for(lambda: stats(a).remote_writes == len(keys), what="writes")

    own_cluster.nodes[1].kill()  # a master, mid-run
    t0 = time.monotonic()
    _, keys2 = store_on(a, geo, range(20, 24))
    resp = prefetch(b, geo.namespace, keys + keys2)
    assert time.monotonic() - t0 < 10
    # Whatever B fetched meanwhile is A's bytes; nothing wrong was loaded.
    ready = [k for k, ok in zip(keys, b.lookup(geo.namespace, keys), strict=True) if ok]
    assert len(resp.states) == len(keys) + len(keys2)
    assert stats(b).remote_verify_failures == 0

    own_cluster.kill_all()  # the whole cluster down, then back (empty)
    own_cluster.restart_all()
    # A's health, not a log line: one may be left from a probe during the first outage.
    wait_for(lambda: stats(a).remote_healthy, timeout=30, what="A's tier healthy")
    _, keys3 = store_on(a, geo, range(40, 44))

    def fetched() -> bool:
        prefetch(b, geo.namespace, keys3)
        return all(b.lookup(geo.namespace, keys3))

    wait_for(fetched, timeout=40, what="rows fetched after the cluster restart")
    assert load_and_compare(engines_b, geo, range(40, 44), keys3) == 0
    assert stats(b).remote_verify_failures == 0
    del ready
    a.close()
    b.close()


def test_client_sees_remote_tier_flag(redis_standalone, daemon_factory) -> None:
    _, c = node(daemon_factory, redis_standalone.url)
    assert isinstance(c, DepotClient) and c.hello.remote_tier
    c.close()


def test_a_master_fails_over_to_its_replica(tmp_path_factory, daemon_factory) -> None:
    """Three masters with a replica each: a master SIGKILLed, its replica promoted;
    rows written before are still served, new rows flow, no daemon restarted."""
    from tests.support.redis_servers import RedisClusterProcs, require_redis

    require_redis()
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("rrepl"), replicas=1).start()
    try:
        geo = Geometry(namespace=f"failover-{time.monotonic_ns()}")
        _, a = node(daemon_factory, cluster.url)
        _, b = node(daemon_factory, cluster.url)
        engines_b = [Engine(b, geo, rk) for rk in range(geo.world_size)]
        _, keys = store_on(a, geo, range(0, 6))
        wait_for(lambda: stats(a).remote_writes == len(keys), what="writes")
        time.sleep(0.5)  # replication is asynchronous
        victim = cluster.masters()[0]
        victim.kill()
        # Past the node timeout the victim is marked failed and its replica promoted.
        wait_for(
            lambda: victim not in cluster.masters() and len(cluster.masters()) == 3,
            timeout=30,
            what="the replica's promotion",
        )
        cluster.wait_ok()

        def fetched(ks: list[bytes]) -> bool:
            prefetch(b, geo.namespace, ks)
            return all(b.lookup(geo.namespace, ks))

        wait_for(lambda: fetched(keys), timeout=30, what="rows from before the failover")
        assert load_and_compare(engines_b, geo, range(0, 6), keys) == 0
        wait_for(lambda: stats(a).remote_healthy, timeout=30, what="A's tier healthy")
        _, keys2 = store_on(a, geo, range(50, 54))
        wait_for(lambda: fetched(keys2), timeout=30, what="rows written after the failover")
        assert load_and_compare(engines_b, geo, range(50, 54), keys2) == 0
        assert stats(b).remote_verify_failures == 0
        a.close()
        b.close()
    finally:
        cluster.kill_all()
