"""A crash keeps the cache: a --pool-file daemon killed with SIGKILL is recovered
from its journal (docs/architecture.md §9), with real daemons and real signals.

The next start serves again every block whose row was READY and checksummed,
byte-identical, verified in the background while the daemon already serves;
it never serves a row that was being written, nor one whose bytes no longer
match their checksum. Progress shows in GetStats. Records and replay:
test_journal.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from kvdepot.client import DepotClient
from kvdepot.server.core import journal
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import connect
from tests.support.engine import Engine, chunk_plan
from tests.support.faults import DaemonFactory, admin, all_blocks, stats
from tests.support.ops import free_port, sample, scrape
from tests.test_warm_restart import NS, store_rows, verify_rows, wait_recovered

pytestmark = pytest.mark.timeout(180)


def wait_sealed(pool: Path, keys: list[bytes], timeout: float = 20.0) -> None:
    """Until the journal lists every key with its checksum (computed in the
    background right after the store)."""
    deadline = time.monotonic() + timeout
    want = {(NS, k) for k in keys}
    while True:
        rows = journal.replay(Path(str(pool) + journal.SUFFIX).read_bytes()).rows
        if all(ident in rows and rows[ident].crc is not None for ident in want):
            return
        assert time.monotonic() < deadline, "rows never got their checksum in the journal"
        time.sleep(0.05)


def served_rows_are_intact(client: DepotClient, keys: list[bytes]) -> int:
    """Every key that looks up ready reads back exactly what both ranks stored;
    returns how many were served."""
    geo = soak.geometry(NS)
    served = [k for k, hit in zip(keys, client.lookup(NS, keys), strict=True) if hit]
    for key in served:
        for rank in range(geo.world_size):
            assert client.get(NS, key, rank) == soak.section_bytes(geo, key, rank), (
                f"block {key.hex()[:16]} rank {rank} served with other bytes"
            )
    return len(served)


def test_sigkill_mid_store_and_load_keeps_every_ready_block(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    pool = tmp_path / "kvdepot.pool"
    d = daemon_factory("--pool-size", "32MiB", "--pool-file", str(pool))
    client = connect(d, "writer")
    keys, half = store_rows(client)  # READY rows, and rows only rank 0 wrote
    wait_sealed(pool, keys)

    # Stores of new rows (rank 0, then rank 1) and loads of the old ones run
    # until the daemon is killed under them.
    geo = soak.geometry(NS)
    engines = [Engine(client, geo, r) for r in range(geo.world_size)]
    stored: list[bytes] = []  # rows both ranks finished before the kill
    attempted: list[bytes] = []
    rounds = threading.Semaphore(0)
    stop = threading.Event()
    failures: list[str] = []

    def churn() -> None:
        c = 100
        try:
            while not stop.is_set():
                new, blocks, indices = chunk_plan(geo, range(c, c + 2))
                attempted.extend(new)
                ok = True
                for eng in engines:
                    for g, b in enumerate(blocks):
                        eng.fill(g, new[g * 2 : (g + 1) * 2], b, indices[g])
                    ok = eng.job(pb.STORE, new, blocks, indices).success and ok
                if ok:
                    stored.extend(new)
                lkeys, lblocks, lindices = chunk_plan(geo, range(0, 4), base_block=64)
                engines[c % 2].job(pb.LOAD, lkeys, lblocks, lindices)
                c += 2
                rounds.release()
        except (AssertionError, grpc.RpcError, OSError) as exc:
            failures.append(repr(exc))

    worker = threading.Thread(target=churn, daemon=True)
    worker.start()
    for _ in range(5):
        assert rounds.acquire(timeout=30), failures
    d.kill()  # mid-store, mid-load
    stop.set()
    worker.join(timeout=90)
    assert not worker.is_alive()
    client.close()

    d.start()
    stub = admin(d.admin_channel())
    s = stats(stub)
    assert s.recovery_blocks_total >= len(keys)
    s = wait_recovered(stub)
    assert s.recovery_blocks_verified + s.recovery_blocks_rejected == s.recovery_blocks_total
    assert s.ready_blocks == s.recovery_blocks_verified
    assert "crash recovery: the previous daemon was killed" in d.log()

    client = connect(d, "reader")
    # Every row that was ready and checksummed before the churn is back, intact.
    assert client.lookup(NS, keys) == [True] * len(keys)
    verify_rows(client, keys)
    # Rows only rank 0 wrote were being written: never served.
    assert client.lookup(NS, half) == [False] * len(half)
    # Rows stored during the churn: whatever is served is exactly what was stored
    # (a row cut off mid-store is not served at all).
    served = served_rows_are_intact(client, attempted)
    assert served >= len(stored) - 4 * len(soak.geometry(NS).groups), (served, len(stored))
    # Nothing listed twice, accounting exact.
    blocks = all_blocks(stub)
    assert len({b.key for b in blocks}) == len(blocks) == s.ready_blocks
    assert sum(b.bytes for b in blocks) == stats(stub).used_bytes
    client.close()


def test_a_damaged_block_is_not_served(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    pool = tmp_path / "kvdepot.pool"
    port = free_port()
    d = daemon_factory(
        "--pool-size", "32MiB", "--pool-file", str(pool), "--metrics-port", str(port)
    )  # fmt: skip
    client = connect(d, "writer")
    keys, _ = store_rows(client)
    wait_sealed(pool, keys)
    victim = next(b for b in all_blocks(admin(d.admin_channel())) if b.key == keys[3])
    d.kill()
    client.close()
    with open(pool, "r+b") as f:  # one byte flipped in the middle of the row
        f.seek(victim.pool_offset + victim.bytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))

    d.start()
    stub = admin(d.admin_channel())
    s = wait_recovered(stub)
    assert (s.recovery_blocks_total, s.recovery_blocks_verified, s.recovery_blocks_rejected) == (
        len(keys),
        len(keys) - 1,
        1,
    )
    assert "does not match its checksum" in d.log()
    # Prometheus tells the same story.
    m = scrape(port)
    assert sample(m, "kvdepot_recovery_journal_blocks") == len(keys)
    assert sample(m, "kvdepot_recovery_blocks_total", outcome="verified") == len(keys) - 1
    assert sample(m, "kvdepot_recovery_blocks_total", outcome="rejected") == 1
    assert sample(m, "kvdepot_recovery_complete") == 1
    client = connect(d, "reader")
    geo = soak.geometry(NS)
    # Put and Get need a registration of the namespace (an inline one: no memory).
    client.register_kv(geo.layout(), 0, None, [], [])
    assert client.lookup(NS, keys) == [k != keys[3] for k in keys]
    with pytest.raises(grpc.RpcError) as info:
        client.get(NS, keys[3], 0)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert served_rows_are_intact(client, keys) == len(keys) - 1
    # The dropped row's room is free again: it can be stored anew, and is served.
    for rank in range(geo.world_size):
        assert client.put(NS, keys[3], rank, soak.section_bytes(geo, keys[3], rank)).ready == (
            rank == geo.world_size - 1
        )
    assert served_rows_are_intact(client, keys) == len(keys)
    client.close()
    # A clean stop now, then a start: the snapshot path, with the journal's
    # checksums carried over, still serves the same rows.
    assert d.stop() == 0
    d.start()
    s = stats(admin(d.admin_channel()))
    assert s.warm_restarted and s.ready_blocks == len(keys)
    assert s.recovery_blocks_total == 0 and s.recovery_complete
