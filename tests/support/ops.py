"""Small helpers for tests against a live daemon: a free TCP port, a /metrics scrape,
an Admin stub, engines that store and load chunks (checking every byte). Connecting:
tests/support/daemon.py.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvdepot.common.jobs import JobResult
from kvdepot.v1 import admin_pb2_grpc
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

HEALTH = health_pb2.HealthCheckResponse


def free_port() -> int:
    """A TCP port free right now (the daemon binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET /metrics -> {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in metrics, f"no sample {name}{labels} in the scrape"
    return metrics[key]


def admin(d: DaemonProcess) -> tuple[grpc.Channel, admin_pb2_grpc.AdminStub]:
    """A channel to the daemon's operator socket and an Admin stub on it."""
    ch = d.admin_channel()
    return ch, admin_pb2_grpc.AdminStub(ch)


def store(eng: Engine, chunks: range, base_block: int = 0, salt: bytes = b"") -> JobResult:
    """Fills `chunks` (every group) with their expected bytes and stores them."""
    keys, group_blocks, indices = chunk_plan(eng.geo, chunks, salt=salt, base_block=base_block)
    n = len(chunks)
    for g, blocks in enumerate(group_blocks):
        eng.fill(g, keys[g * n : (g + 1) * n], blocks, indices[g])
    res = eng.job(pb.STORE, keys, group_blocks, indices)
    assert res.success, res.error
    return res


def load(eng: Engine, chunks: range, base_block: int) -> JobResult:
    """Loads `chunks` into other blocks and checks every byte."""
    keys, group_blocks, indices = chunk_plan(eng.geo, chunks, base_block=base_block)
    res = eng.job(pb.LOAD, keys, group_blocks, indices)
    assert res.success, res.error
    n = len(chunks)
    for g, blocks in enumerate(group_blocks):
        assert eng.mismatches(g, keys[g * n : (g + 1) * n], blocks, indices[g]) == 0
    return res


def rank_bytes(geo: Geometry, chunks: int) -> int:
    """Bytes one rank's job moves for `chunks` chunks of every group."""
    return chunks * geo.blocks_per_chunk * sum(geo.layer_pages)


GEO_M = Geometry(
    groups=[[4096, 4096]],
    blocks_per_chunk=2,
    world_size=1,
    num_blocks=128,
    namespace="metrics-test",
)
SLOT_M = GEO_M.blocks_per_chunk * sum(GEO_M.layer_pages)  # 16 KiB: 16 slots in 256 KiB


def keys_m(chunks: Iterable[int]) -> list[bytes]:
    """Group-0 keys of GEO_M's chunks."""
    return [make_key(c, 0) for c in chunks]
