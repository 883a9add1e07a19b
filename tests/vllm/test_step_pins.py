"""A scheduler step's pins on several shards (kvdepot.client.vllm.pins.StepPins), against
real daemons, one per shard: every shard pins the step's keys, a shard that stops
answering (SIGSTOP) costs the step one pin deadline, not one per shard, and its loads
go unpinned there (and it never applies them late) while the others' pins hold; once
it answers again, so do its pins."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from kvdepot.client import DepotClient
from kvdepot.client.vllm.pins import StepPins
from kvdepot.client.vllm.stats import StepStats
from kvdepot.testing.daemon import stats
from kvdepot.testing.waiting import wait_for
from tests.support.engine import Engine, Geometry, make_key
from tests.support.ops import store

pytestmark = pytest.mark.vllm

GEO = Geometry(world_size=1, namespace="step-pins", groups=[[4096, 4096]], num_blocks=64)
SHARDS = 3
TIMEOUT_S = 0.5


@pytest.fixture
def shards(daemon_factory):
    daemons = [daemon_factory("--pool-size", "64MiB") for _ in range(SHARDS)]
    clients = [DepotClient(d.target, client_name="pytest").start() for d in daemons]
    try:
        for client in clients:
            assert client.wait_connected(10)
            store(Engine(client, GEO, 0), range(8))  # the same 8 blocks on every shard
        yield daemons, clients
    finally:
        for d in daemons:  # never leave one stopped
            os.kill(d.proc.pid, signal.SIGCONT)
        for client in clients:
            client.close()


def pinned(daemons) -> list[int]:
    return [stats(d.admin_target).pinned_blocks for d in daemons]


def test_a_silent_shard_costs_the_step_one_deadline_and_the_others_keep_their_pins(
    shards,
) -> None:
    daemons, clients = shards
    keys = [make_key(c, 0) for c in range(8)]
    namespaces = [GEO.namespace] * SHARDS
    pins = StepPins(clients, StepStats(), TIMEOUT_S)
    for shard in range(SHARDS):
        pins.on_session(shard)
    assert wait_for(lambda: all(lane.open for lane in pins.lanes), 10), "pin lanes not open"

    # Every shard answers: each pins the step's keys, held per request and shard.
    pins.add("r1", namespaces, keys[:3])
    pins.add("r2", namespaces, keys[3:])
    assert pins.pin_step(namespaces) == []
    assert pinned(daemons) == [8, 8, 8]
    assert pins.release("r1") == [keys[:3]] * SHARDS
    assert pins.release("r1") == [None] * SHARDS  # handed back once

    # Shards 1 and 2 stop answering: the step waits one deadline for both, not one each.
    for d in daemons[1:]:
        os.kill(d.proc.pid, signal.SIGSTOP)
    pins.add("r3", namespaces, keys[:2])
    start = time.monotonic()
    assert pins.pin_step(namespaces) == []  # nothing found gone; nothing pinned there
    elapsed = time.monotonic() - start
    assert TIMEOUT_S * 0.9 <= elapsed < TIMEOUT_S * 1.6, elapsed
    assert pins.failures == SHARDS - 1
    assert pins.release("r3") == [keys[:2], None, None]  # only shard 0's to unpin
    for d in daemons[1:]:
        os.kill(d.proc.pid, signal.SIGCONT)

    # Answering again: the next step pins on every shard (lane reopened, or gRPC).
    pins.add("r4", namespaces, keys[:1])
    assert pins.pin_step(namespaces) == []
    assert pins.failures == SHARDS - 1
    assert pins.release("r4") == [keys[:1]] * SHARDS
    # What the client handed back for unpinning is all each daemon holds: the stopped
    # shards never applied the step's late pins (their lanes were closed meanwhile).
    for client in clients:
        client.unpin(GEO.namespace, keys + keys[:1], wait=True)  # r1 + r2, and r4
    assert pinned(daemons) == [2, 0, 0]  # r3's, on shard 0
