"""Two daemons (two nodes) sharing rows through a real Redis: stored on A, fetched
on B through Depot/Prefetch, loaded into B's engines byte for byte."""

from __future__ import annotations

import time

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.remote.helpers import prefetch
from tests.support.daemon import stats
from tests.support.engine import Engine, Geometry, chunk_plan
from tests.support.fleet_key import shared_key_args

FETCHING = pb.PrefetchResponse.FETCHING
ABSENT = pb.PrefetchResponse.ABSENT
LOCAL = pb.PrefetchResponse.LOCAL


def node(daemon_factory, url: str, *extra: str):
    d = daemon_factory("--pool-size", "64MiB", "--remote", url, *shared_key_args(), *extra)
    c = DepotClient(d.target, client_name="node").start()
    assert c.wait_connected(10)
    return d, c


def store_on(c: DepotClient, geo: Geometry, chunks: range) -> tuple[list[Engine], list[bytes]]:
    engines = [Engine(c, geo, r) for r in range(geo.world_size)]
    keys, blocks, idx = chunk_plan(geo, chunks)
    for e in engines:
        for g in range(len(geo.groups)):
            n = len(chunks)
            e.fill(g, keys[g * n : (g + 1) * n], blocks[g], idx[g])
        res = e.job(pb.STORE, keys, blocks, idx)
        assert res.success, res.error
    return engines, keys


def load_and_compare(engines: list[Engine], geo: Geometry, chunks: range, keys: list[bytes]) -> int:
    _, blocks, idx = chunk_plan(geo, chunks, base_block=256)
    bad = 0
    for e in engines:
        res = e.job(pb.LOAD, keys, blocks, idx)
        assert res.success, res.error
        n = len(chunks)
        for g in range(len(geo.groups)):
            bad += e.mismatches(g, keys[g * n : (g + 1) * n], blocks[g], idx[g])
    return bad


@pytest.mark.parametrize("which", ["standalone", "cluster"])
def test_rows_stored_on_a_are_loaded_on_b_byte_for_byte(which, request, daemon_factory) -> None:
    """TP=2, two groups of different page sizes: every rank's section travels."""
    server = request.getfixturevalue(
        "redis_standalone" if which == "standalone" else "redis_cluster"
    )
    url = server.url if which == "standalone" else server.seed_url
    geo = Geometry(namespace=f"share-{which}-{time.monotonic_ns()}")
    chunks = range(0, 6)
    _, a = node(daemon_factory, url)
    _, b = node(daemon_factory, url)
    assert b.hello.remote_tier
    _, keys = store_on(a, geo, chunks)
    wait_for(lambda: stats(a).remote_writes >= len(keys), what="A's writes")

    engines_b = [Engine(b, geo, r) for r in range(geo.world_size)]  # declares the namespace
    assert b.lookup(geo.namespace, keys) == [False] * len(keys)
    resp = prefetch(b, geo.namespace, keys)
    assert list(resp.states) == [FETCHING] * len(keys) and resp.remote_healthy
    wait_for(lambda: all(b.lookup(geo.namespace, keys)), what="rows ready on B")
    assert load_and_compare(engines_b, geo, chunks, keys) == 0

    sb = stats(b)
    assert sb.remote_hits == len(keys) and sb.remote_verify_failures == 0
    # B does not write back what it fetched: the rows' STORED events (announced before
    # they were ready) queued nothing. Once B's writer and fetcher are idle, a row
    # queued would show as written, present, dropped or still in flight. A wrote each
    # row once.
    sb = wait_for(lambda: (s := stats(b)).remote_inflight_bytes == 0 and s, what="B idle")
    assert (sb.remote_writes, sb.remote_write_present, sb.remote_write_drops) == (0, 0, 0)
    assert stats(a).remote_writes == len(keys)
    # Asked again: the rows are local now; unknown keys are absent.
    other = [bytes(32) + b"\0\0\0\0"]
    assert list(prefetch(b, geo.namespace, keys[:2] + other).states) == [LOCAL, LOCAL, ABSENT]
    a.close()
    b.close()


def test_a_prefetch_fetches_each_groups_leading_run_and_nothing_behind_a_hole(
    redis_standalone, daemon_factory
) -> None:
    """Chunks 0-7 of two groups reach the fleet from A; group 0's chunk 3 is then gone
    from it. B's Prefetch of the 16 keys fetches group 0's chunks 0-2 and group 1's
    eight, and nothing of group 0 behind the hole: no lookup would reach those rows."""
    import redis

    from tests.support.fleet_key import shared_codec

    geo = Geometry(namespace=f"hole-{time.monotonic_ns()}")
    chunks = range(0, 8)
    _, a = node(daemon_factory, redis_standalone.url)
    _, b = node(daemon_factory, redis_standalone.url)
    _, keys = store_on(a, geo, chunks)
    wait_for(lambda: stats(a).remote_writes == len(keys), what="A's writes")
    fleet = redis.Redis(port=redis_standalone.port)
    assert fleet.delete(shared_codec().remote_key(geo.namespace, keys[3])) == 1

    engines_b = [Engine(b, geo, r) for r in range(geo.world_size)]  # declares the namespace
    states = list(prefetch(b, geo.namespace, keys).states)
    assert states == [FETCHING] * 3 + [ABSENT] * 5 + [FETCHING] * 8
    run = keys[:3] + keys[8:]
    wait_for(lambda: all(b.lookup(geo.namespace, run)), what="the leading runs on B")
    sb = wait_for(lambda: (s := stats(b)).remote_inflight_bytes == 0 and s, what="B idle")
    assert sb.remote_hits == len(run)
    assert b.lookup(geo.namespace, keys[3:8]) == [False] * 5
    lead = keys[:3] + keys[8:11]  # chunks 0-2 of both groups, byte for byte
    assert load_and_compare(engines_b, geo, range(0, 3), lead) == 0
    a.close()
    b.close()


def test_a_second_node_skips_rows_the_tier_has(redis_standalone, daemon_factory) -> None:
    geo = Geometry(namespace=f"dedupe-{time.monotonic_ns()}")
    _, a = node(daemon_factory, redis_standalone.url)
    _, b = node(daemon_factory, redis_standalone.url)
    _, keys = store_on(a, geo, range(0, 4))
    wait_for(lambda: stats(a).remote_writes == len(keys), what="A's writes")
    store_on(b, geo, range(0, 4))  # B computed the same rows itself
    wait_for(lambda: stats(b).remote_write_present == len(keys), what="B's dedupe")
    assert stats(b).remote_writes == 0
    a.close()
    b.close()


def test_without_remote_prefetch_says_so_and_nothing_changes(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    assert not c.hello.remote_tier
    geo = Geometry(namespace="plain")
    engines, keys = store_on(c, geo, range(0, 2))
    resp = prefetch(c, geo.namespace, [*keys, bytes(36)])
    assert not resp.remote_tier
    assert list(resp.states) == [ABSENT] * (len(keys) + 1)
    s = stats(c)
    assert not s.remote_enabled and s.remote_writes == 0
    c.close()


def test_prefetch_refuses_bad_input_with_reasons(redis_standalone, daemon_factory) -> None:
    import grpc

    geo = Geometry(namespace=f"bad-{time.monotonic_ns()}")
    d, c = node(
        daemon_factory, redis_standalone.url, "--max-job-keys", "2", "--max-batch-keys", "32"
    )
    Engine(c, geo, 0)  # declares the namespace

    def code_of(namespace: str, keys: list[bytes], session: str | None = None):
        with pytest.raises(grpc.RpcError) as info:
            c.stub.Prefetch(
                pb.PrefetchRequest(
                    session_id=c.session_id if session is None else session,
                    namespace_id=namespace,
                    keys=keys,
                ),
                timeout=5,
            )
        return info.value.code(), info.value.details()

    code, text = code_of("no-such-namespace", [bytes(36)])  # never joined
    assert code == grpc.StatusCode.PERMISSION_DENIED and "RegisterKV" in text
    c.join("no-such-namespace")  # joined, but no engine declared it
    code, text = code_of("no-such-namespace", [bytes(36)])
    assert code == grpc.StatusCode.NOT_FOUND and "namespace" in text
    code, text = code_of(geo.namespace, [b"short"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, text = code_of(geo.namespace, [bytes(32) + (7).to_bytes(4, "big")])  # group 7
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, text = code_of(geo.namespace, [bytes(36)] * 33)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "split" in text
    code, text = code_of(geo.namespace, [bytes(36)], session="nope")
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # as for Pin: open a session first
    # The daemon still answers.
    assert list(prefetch(c, geo.namespace, [bytes(36)]).states) == [ABSENT]
    c.close()
