"""Warm restart with --pool-file (docs/architecture.md §9), end to end.

SIGTERM writes the index snapshot beside the pool file; the next `kvdepot serve`
with the same file and size serves every block that was ready, byte-identical,
and none that was still being written. The snapshot is consumed at start; a
daemon SIGKILLed afterwards is recovered from its journal instead (blocks
verified against their checksums: test_crash_recovery.py). A pool file resized
or written between the runs starts empty. Unit tests of the snapshot itself:
test_snapshot.py.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import connect, kvdepot_command
from tests.support.engine import Engine, chunk_plan, make_key
from tests.support.faults import DaemonFactory, admin, all_blocks, assert_pool_accounting, stats

pytestmark = pytest.mark.timeout(120)

NS = "warm-ns"
CHUNKS = 12


def store_rows(client: DepotClient) -> tuple[list[bytes], list[bytes]]:
    """Full rows of both groups (READY), and rows of which only rank 0 is written."""
    geo = soak.geometry(NS)
    engines = [Engine(client, geo, r) for r in range(geo.world_size)]
    keys, blocks, indices = chunk_plan(geo, range(CHUNKS))
    for eng in engines:
        for g, b in enumerate(blocks):
            eng.fill(g, keys[g * CHUNKS : (g + 1) * CHUNKS], b, indices[g])
        res = eng.job(pb.STORE, keys, blocks, indices)
        assert res.success and res.stored_keys == len(keys), res
    half = [make_key(c, 0, b"half") for c in range(4)]
    hblocks, hindices = soak.group_job(geo, 0, half, soak.STORE_BASE)
    engines[0].fill(0, half, hblocks[0], 0)
    assert engines[0].job(pb.STORE, half, hblocks, hindices).stored_keys == len(half)
    return keys, half


def verify_rows(client: DepotClient, keys: list[bytes]) -> None:
    """Loads every row into both ranks and checks every byte."""
    geo = soak.geometry(NS)
    keys_, blocks, indices = chunk_plan(geo, range(CHUNKS), base_block=64)
    assert keys_ == keys
    for rank in range(geo.world_size):
        eng = Engine(client, geo, rank)
        res = eng.job(pb.LOAD, keys, blocks, indices)
        assert res.success, res.error
        bad = sum(
            eng.mismatches(g, keys[g * CHUNKS : (g + 1) * CHUNKS], b, indices[g])
            for g, b in enumerate(blocks)
        )
        assert bad == 0, f"rank {rank}: {bad} page(s) differ after the warm restart"


def test_sigterm_then_restart_serves_every_ready_block(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    pool = tmp_path / "kvdepot.pool"
    d = daemon_factory("--pool-size", "32MiB", "--pool-file", str(pool))
    client = connect(d, "writer")
    keys, half = store_rows(client)
    stub = admin(d.admin_channel())
    before = {(b.key_hex, b.pool_offset, b.bytes) for b in all_blocks(stub) if b.state == "ready"}
    assert len(before) == len(keys)
    assert stats(stub).writing_blocks == len(half)
    # The writer stays connected through SIGTERM: its half rows are still being
    # written when the daemon stops.
    assert d.stop() == 0
    client.close()
    snap = Path(str(pool) + ".index")
    assert snap.exists()
    assert f"index snapshot written: {len(keys)} block(s)" in d.log()

    d.start()
    assert not snap.exists(), "the snapshot must be consumed at start"
    stub = admin(d.admin_channel())
    s = assert_pool_accounting(stub)
    assert s.warm_restarted
    assert s.ready_blocks == len(keys) and s.writing_blocks == 0
    after = {(b.key_hex, b.pool_offset, b.bytes) for b in all_blocks(stub)}
    assert after == before, "same blocks at the same offsets"
    assert f"warm restart: re-attached {len(keys)} block(s)" in d.log()

    client = connect(d, "reader")
    # Lookups and the Watch snapshot see the re-attached blocks; the half rows are gone.
    assert client.lookup(NS, keys) == [True] * len(keys)
    assert client.lookup(NS, half) == [False] * len(half)
    snapshot_keys: set[bytes] = set()
    done = threading.Event()

    def on_event(ev: pb.WatchEvent) -> None:
        if ev.kind == pb.WatchEvent.SNAPSHOT:
            snapshot_keys.update(ev.keys)
        elif ev.kind == pb.WatchEvent.SNAPSHOT_END:
            done.set()

    watch = client.watch(NS, on_event)
    assert done.wait(10)
    watch.stop()
    assert snapshot_keys == set(keys)
    verify_rows(client, keys)

    # A half row's other rank alone does not make it readable either.
    geo = soak.geometry(NS)
    eng = Engine(client, geo, 1)
    hblocks, hindices = soak.group_job(geo, 0, half, soak.STORE_BASE)
    eng.fill(0, half, hblocks[0], 0)
    assert eng.job(pb.STORE, half, hblocks, hindices).success
    assert client.lookup(NS, half) == [False] * len(half)
    lblocks, lindices = soak.group_job(geo, 0, half, soak.LOAD_BASE)
    res = eng.job(pb.LOAD, half, lblocks, lindices)
    assert not res.success and res.error_code == "NOT_FOUND"

    # SIGKILL now: the snapshot was consumed, but the journal lists every ready
    # block with its checksum; the next start verifies and serves them again
    # (test_crash_recovery.py covers the crash path in depth).
    d.kill()
    client.close()
    d.start()
    stub = admin(d.admin_channel())
    s = wait_recovered(stub)
    assert not s.warm_restarted
    assert (s.recovery_blocks_total, s.recovery_blocks_verified) == (len(keys), len(keys))
    assert "crash recovery: the previous daemon was killed" in d.log()
    client = connect(d, "after-kill")
    assert client.lookup(NS, keys) == [True] * len(keys)
    assert client.lookup(NS, half) == [False] * len(half)
    verify_rows(client, keys)
    client.close()


def wait_recovered(stub: object, timeout: float = 30.0) -> object:
    """GetStats once the crash recovery has checked every block."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(stub)  # type: ignore[arg-type]
        if s.recovery_complete or time.monotonic() > deadline:
            assert s.recovery_complete, s
            return s
        time.sleep(0.05)


@pytest.mark.parametrize("change", ["resize", "write"])
def test_a_pool_file_changed_between_runs_starts_empty(
    daemon_factory: DaemonFactory, tmp_path: Path, change: str
) -> None:
    pool = tmp_path / "kvdepot.pool"
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(pool))
    client = connect(d, "writer")
    keys, _ = store_rows(client)
    client.close()
    assert d.stop() == 0
    if change == "resize":
        d.args[d.args.index("16MiB")] = "24MiB"
        expected = "pool size changed"
    else:
        with open(pool, "r+b") as f:  # someone else scribbles on the pool
            f.seek(1 << 20)
            f.write(b"\xff" * 4096)
        expected = "modified"
    d.start()
    s = stats(admin(d.admin_channel()))
    assert not s.warm_restarted and s.ready_blocks == 0
    assert expected in d.log(), d.log()[-2000:]
    assert "starting with an empty pool" in d.log()


def test_a_second_daemon_on_the_same_pool_file_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    pool = str(tmp_path / "kvdepot.pool")
    first = daemon_factory("--pool-size", "16MiB", "--pool-file", pool)
    other_socket = str(tmp_path / "other.sock")
    proc = subprocess.run(
        [
            *kvdepot_command(),
            "serve",
            "--socket",
            other_socket,
            "--pool-size",
            "16MiB",
            "--pool-file",
            pool,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert "in use by another kvdepot daemon" in proc.stderr
    assert f"pid {first.proc.pid}" in proc.stderr  # type: ignore[union-attr]
    assert not Path(other_socket).exists()
    # The first daemon is unharmed, and its clean stop still leaves a usable snapshot.
    assert stats(admin(first.admin_channel())).capacity_bytes == 16 << 20
    assert first.stop() == 0
    first.start()
    assert stats(admin(first.admin_channel())).warm_restarted
