"""An engine killed with SIGKILL in the middle of transfers costs nothing but its own
blocks in flight (docs/architecture.md §8.2: closing a session releases everything).

A real daemon, a real engine process (tests/support/soak.py victim) and a survivor
engine in this process. The victim holds everything a session can hold:
registrations of two ranks (memfd mappings), pins on its own and on the survivor's
blocks (counted twice), half-written rows (reservations), an fd sent but never
claimed, and a stream of store and load jobs in flight. After SIGKILL the daemon
must, within five seconds, be back to the survivor-only baseline: engines,
registrations, pins, reservations, open fds and memfd mappings; the pool's used
bytes equal the ready blocks; and the survivor's blocks load byte-identical.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import DaemonProcess
from tests.support.engine import Engine, make_key
from tests.support.faults import (
    DaemonFactory,
    admin,
    assert_pool_accounting,
    fd_targets,
    memfd_mappings,
    soak_process,
    stats,
)

pytestmark = pytest.mark.timeout(120)

NS = "crash-ns"
ROWS = 8
CLEANUP_SECONDS = 5.0


@pytest.fixture
def debug_daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    # Invariants are checked after every mutation; GetStats fails if one broke.
    return daemon_factory("--pool-size", "32MiB", env={"KVDEPOT_CHECK_INVARIANTS": "1"})


@pytest.fixture
def survivor(debug_daemon: DaemonProcess) -> Iterator[tuple[DepotClient, list[Engine]]]:
    client = DepotClient(debug_daemon.target, client_name="survivor").start()
    assert client.wait_connected(10)
    geo = soak.geometry(NS)
    engines = [Engine(client, geo, r) for r in range(geo.world_size)]
    yield client, engines
    client.close()


def survivor_keys() -> list[bytes]:
    return [make_key(c, 0, b"survivor") for c in range(ROWS)]


def test_sigkilled_engine_releases_everything_within_five_seconds(
    debug_daemon: DaemonProcess, survivor: tuple[DepotClient, list[Engine]]
) -> None:
    client, engines = survivor
    geo = engines[0].geo
    stub = admin(debug_daemon.admin_channel())
    pid = debug_daemon.proc.pid  # type: ignore[union-attr]

    # The survivor's rows: stored by both ranks, pinned (the victim's store flood
    # would otherwise evict them by LRU; the pins are the survivor's, and stay).
    keys = survivor_keys()
    blocks, indices = soak.group_job(geo, 0, keys, soak.STORE_BASE)
    for eng in engines:
        eng.fill(0, keys, blocks[0], 0)
        assert eng.job(pb.STORE, keys, blocks, indices).stored_keys == ROWS
    assert client.pin(NS, keys) == [True] * ROWS

    base = stats(stub)
    base_fds = sorted(fd_targets(pid))
    base_maps = memfd_mappings(pid, "kvdepot-kv")
    assert (base.sessions, base.registrations, base.pinned_blocks) == (1, 2, ROWS)

    victim = soak_process(
        "victim",
        "--target",
        debug_daemon.target,
        "--namespace",
        NS,
        "--salt",
        "victim",
        "--pin-salt",
        "survivor",
        "--rows",
        str(ROWS),
    )
    try:
        line = victim.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY "), (line, victim.stderr.read())  # type: ignore[union-attr]
        ready = json.loads(line[len("READY ") :])
        assert "fd_token" in ready["fd_reply"]

        # What the victim holds, seen from the daemon.
        engines_now = stub.ListEngines(apb.ListEnginesRequest(), timeout=5).engines
        mine = [e for e in engines_now if e.session_id == ready["session_id"][:8]]  # a tag
        assert len(mine) == 1 and len(mine[0].registrations) == 2
        held = stats(stub)
        assert held.registrations == 4
        assert held.writing_blocks >= ROWS  # its half-written rows at least
        assert memfd_mappings(pid, "kvdepot-kv") == base_maps + 2
        assert any("kvdepot-victim-pending" in t for t in fd_targets(pid))
        # Transfers are flowing: both counters move while we watch.
        wait_for(
            lambda: (s := stats(stub)).stores > held.stores + 20 and s.loads > held.loads + 20,
            timeout=10,
            what="the victim's jobs to run",
        )
    finally:
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.wait(10)

    def back_to_baseline() -> bool:
        s = stats(stub)
        engines_now = stub.ListEngines(apb.ListEnginesRequest(), timeout=5).engines
        return (
            [e.client_name for e in engines_now] == ["survivor"]
            and (s.sessions, s.registrations) == (1, 2)
            and s.pinned_blocks == ROWS
            and s.writing_blocks == 0
            and s.inflight_jobs == 0
            and memfd_mappings(pid, "kvdepot-kv") == base_maps
            and sorted(fd_targets(pid)) == base_fds
        )

    wait_for(
        back_to_baseline, timeout=CLEANUP_SECONDS, what="the daemon to release the victim's session"
    )
    took = time.monotonic() - killed
    print(f"victim cleaned up {took:.3f}s after SIGKILL")
    assert took < CLEANUP_SECONDS

    s = assert_pool_accounting(stub)
    assert s.pinned_bytes == sum(
        b.bytes
        for b in stub.ListBlocks(
            apb.ListBlocksRequest(namespace_id=NS, page_size=10000), timeout=5
        ).blocks
        if b.pins
    )
    survivor_info = stub.ListEngines(apb.ListEnginesRequest(), timeout=5).engines[0]
    assert survivor_info.pinned_blocks == ROWS  # the victim's pins on them are gone

    # The daemon says what it released, in one line.
    m = re.search(
        r"'crash-victim'.*closed: released 2 registration\(s\), (\d+) pin\(s\), "
        r"(\d+) unfinished block row\(s\), 1 pending fd\(s\)",
        debug_daemon.log(),
    )
    assert m, debug_daemon.log()[-3000:]
    assert int(m.group(1)) == ready["pins"] and int(m.group(2)) >= ROWS

    # The survivor's blocks are intact, byte for byte, on both ranks.
    lblocks, lindices = soak.group_job(geo, 0, keys, soak.LOAD_BASE)
    for eng in engines:
        res = eng.job(pb.LOAD, keys, lblocks, lindices)
        assert res.success, res.error
        assert eng.mismatches(0, keys, lblocks[0], 0) == 0
    client.unpin(NS, keys, wait=True)
    assert stats(stub).pinned_blocks == 0
