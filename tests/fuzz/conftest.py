"""The fuzz tests' rig as a fixture: a fresh debug daemon per test, checked at the end."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import DaemonFactory, admin, stats
from tests.support.fuzz_rig import GUARD_ROWS, MAX_JOB_KEYS, NS, NS1, Rig, settled_fd_count


@pytest.fixture
def rig(daemon_factory: DaemonFactory) -> Iterator[Rig]:
    d = daemon_factory(
        "--pool-size",
        "16MiB",
        "--max-job-keys",
        str(MAX_JOB_KEYS),
        "--reservation-timeout",
        "3",
        env={"KVDEPOT_CHECK_INVARIANTS": "1"},
    )
    pid = d.proc.pid  # type: ignore[union-attr]
    channel, admin_channel = d.channel(), d.admin_channel()
    # Both connected: the baseline includes these channels, nothing else.
    stats(admin(admin_channel))
    grpc.channel_ready_future(channel).result(timeout=10)
    base_fds = settled_fd_count(pid)
    geo = soak.geometry(NS)
    guardian = DepotClient(d.target, client_name="guardian").start()
    assert guardian.wait_connected(10)
    guard_keys = [make_key(c, 0, b"guard") for c in range(GUARD_ROWS)]
    blocks, indices = soak.group_job(geo, 0, guard_keys, soak.STORE_BASE)
    for rank in range(geo.world_size):
        eng = Engine(guardian, geo, rank)
        eng.fill(0, guard_keys, blocks[0], 0)
        assert eng.job(pb.STORE, guard_keys, blocks, indices).stored_keys == GUARD_ROWS
    assert guardian.pin(NS, guard_keys) == [True] * GUARD_ROWS
    home = DepotClient(d.target, client_name="fuzz-home").start()
    assert home.wait_connected(10)
    home_engines = [Engine(home, geo, r) for r in range(geo.world_size)]
    # Some ready rows for lookups, pins, loads and gets to find.
    keys, blocks_, indices_ = chunk_plan(geo, range(8))
    for eng in home_engines:
        for g, b in enumerate(blocks_):
            eng.fill(g, keys[g * 8 : (g + 1) * 8], b, indices_[g])
        assert eng.job(pb.STORE, keys, blocks_, indices_).success
    geo1 = Geometry(groups=[[2048]], blocks_per_chunk=1, world_size=1, num_blocks=64, namespace=NS1)
    ns1_engine = Engine(home, geo1, 0)
    r = Rig(
        d,
        channel,
        home.stub,
        admin(admin_channel),
        home,
        guardian,
        home_engines,
        ns1_engine,
        guard_keys,
        base_fds,
        admin_channel=admin_channel,
    )
    yield r
    home.close()
    guardian.close()
    channel.close()
    admin_channel.close()
