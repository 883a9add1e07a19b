"""Write modes, the bound on bytes in flight, and the Prometheus series."""

from __future__ import annotations

import time
import urllib.request

import redis

from kvdepot.testing.waiting import wait_for
from tests.remote.test_remote_daemons import node, store_on
from tests.support.daemon import stats
from tests.support.engine import Geometry
from tests.support.fleet_key import shared_codec, shared_key_args
from tests.support.redis_servers import free_ports


def test_evict_mode_writes_rows_only_when_lru_evicts_them(redis_standalone, daemon_factory) -> None:
    """A pool of 1 MiB: later rows evict earlier ones, which are written then, with
    the bytes they had (fetched back on another node, byte for byte)."""
    geo = Geometry(namespace=f"evict-{time.monotonic_ns()}")
    d = daemon_factory(
        "--pool-size",
        "1MiB",
        "--remote",
        redis_standalone.url,
        *shared_key_args(),
        "--remote-write",
        "evict",
    )
    from kvdepot.client import DepotClient

    a = DepotClient(d.target).start()
    assert a.wait_connected(10)
    _, first = store_on(a, geo, range(0, 4))
    # Ready is not enough in evict mode. The rows' STORED events reached the writer
    # before the stores answered (the event bus calls it synchronously): a row it had
    # queued would show now as in flight, written, present or dropped.
    s = stats(a)
    assert (s.remote_inflight_bytes, s.remote_writes, s.remote_write_present) == (0, 0, 0)
    assert s.remote_write_drops == 0
    r = redis.Redis(port=redis_standalone.port)
    for start in range(10, 60, 4):  # enough rows to cycle the pool
        store_on(a, geo, range(start, start + 4))
    wait_for(lambda: stats(a).remote_writes >= len(first), what="evicted rows written")
    evicted = [k for k, ok in zip(first, a.lookup(geo.namespace, first), strict=True) if not ok]
    assert evicted
    codec = shared_codec()
    for key in evicted:
        value = r.get(codec.remote_key(geo.namespace, key))
        assert value is not None
        size = len(value) - codec.header_bytes - len(geo.namespace) - len(key)
        codec.decode(value, geo.namespace, key, size)  # intact, with the fleet's MAC
    _, b = node(daemon_factory, redis_standalone.url)
    from tests.remote.helpers import prefetch
    from tests.remote.test_remote_daemons import load_and_compare
    from tests.support.engine import Engine

    engines_b = [Engine(b, geo, rk) for rk in range(geo.world_size)]
    prefetch(b, geo.namespace, first)
    wait_for(lambda: all(b.lookup(geo.namespace, first)), what="rows on B")
    assert load_and_compare(engines_b, geo, range(0, 4), first) == 0
    a.close()
    b.close()


def test_a_tier_slower_than_the_pool_drops_writes_and_counts_them(
    redis_standalone, daemon_factory
) -> None:
    """--remote-max-inflight-bytes below one batch: stores still succeed at once;
    the writes past the bound are dropped and counted, never queued without end."""
    geo = Geometry(namespace=f"bound-{time.monotonic_ns()}")
    port = free_ports(1)[0]
    d, a = node(
        daemon_factory,
        redis_standalone.url,
        "--remote-max-inflight-bytes",
        "40KiB",
        "--metrics-port",
        str(port),
    )
    _, keys = store_on(a, geo, range(0, 16))
    wait_for(
        lambda: stats(a).remote_writes + stats(a).remote_write_drops == len(keys),
        what="every row written or dropped",
    )
    s = stats(a)
    assert s.remote_write_drops > 0 and s.remote_writes > 0
    assert s.remote_inflight_bytes == 0
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert f"kvdepot_remote_writes_total {float(s.remote_writes)}" in body
    assert 'kvdepot_remote_write_drops_total{reason="backlog_full"}' in body
    assert "kvdepot_remote_up 1.0" in body
    assert "kvdepot_remote_write_seconds_bucket" in body
    assert "row(s) not written (backlog full)" in d.log()
    a.close()
