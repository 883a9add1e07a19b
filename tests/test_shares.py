"""`kvdepot serve --namespace-share` against a real daemon: an engine whose namespace is
given a share of the pool keeps that much while another engine floods the pool, and
ListNamespaces, Prometheus and `kvdepot status` say what each namespace holds, is
guaranteed and lost (kvdepot.server.core.shares)."""

from __future__ import annotations

from kvdepot.client import DepotClient
from kvdepot.v1 import admin_pb2
from tests.support.engine import Engine, Geometry, make_key
from tests.support.ops import admin, free_port, sample, scrape, store
from tests.support.status_cli import status

ROW = 8192
GUARDED = Geometry(
    world_size=1, namespace="guarded", groups=[[4096, 4096]], blocks_per_chunk=1, num_blocks=256
)
FLOOD = Geometry(
    world_size=1, namespace="flood", groups=[[4096, 4096]], blocks_per_chunk=1, num_blocks=256
)


def test_a_namespace_keeps_its_share_while_another_engine_floods(daemon_factory) -> None:
    port = free_port()
    d = daemon_factory(
        "--pool-size", "2MiB", "--namespace-share", "guard*=0.25", "--metrics-port", str(port)
    )  # fmt: skip
    a = DepotClient(d.target, client_name="guarded").start()
    b = DepotClient(d.target, client_name="flood").start()
    try:
        assert a.wait_connected(10) and b.wait_connected(10)
        guarded, flood = Engine(a, GUARDED, 0), Engine(b, FLOOD, 0)
        store(guarded, range(100))  # 100 rows; its share is 64 (a quarter of 256)
        for n in range(4):  # 512 rows of another engine, never used again
            store(flood, range(128 * n, 128 * n + 128))
        ready = a.lookup("guarded", [make_key(c, 0) for c in range(100)])
        assert ready == [True] * 64 + [False] * 36  # its share, its leading chunks
        ch, stub = admin(d)
        with ch:
            spaces = {
                ns.id: ns
                for ns in stub.ListNamespaces(admin_pb2.ListNamespacesRequest()).namespaces
            }
        assert (spaces["guarded"].share_bytes, spaces["guarded"].used_bytes) == (64 * ROW,) * 2
        assert spaces["guarded"].evicted_blocks == 36
        assert spaces["flood"].share_bytes == 0 and spaces["flood"].used_bytes == 192 * ROW
        m = scrape(port)
        assert sample(m, "kvdepot_namespace_share_bytes", namespace="guarded") == 64 * ROW
        assert sample(m, "kvdepot_namespace_evicted_blocks_total", namespace="guarded") == 36
        assert sample(m, "kvdepot_namespace_used_bytes", namespace="flood") == 192 * ROW
        screen = status("--socket", d.admin_socket_path, "--interval", "0").stdout
        assert "512.0 KiB of 512.0 KiB share" in screen, screen
    finally:
        a.close()
        b.close()
