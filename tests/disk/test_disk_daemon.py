"""The disk tier in the real daemon (`kvdepot serve --disk DIR`): rows evicted from a
small RAM pool come back from disk through Depot/Prefetch and load byte for byte,
across a clean restart and a SIGKILL; the directory removed while serving degrades
to RAM only, and the daemon keeps answering."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, connect, stats
from tests.support.engine import Engine, Geometry, chunk_plan
from tests.support.fleet_key import shared_key_args
from tests.support.redis_servers import RedisServer, free_ports, require_redis
from tests.support.status_cli import status, status_json

pytest.importorskip("blake3")

FETCHING = pb.PrefetchResponse.FETCHING
ABSENT = pb.PrefetchResponse.ABSENT
LOCAL = pb.PrefetchResponse.LOCAL

# One group, one rank: a row is 2 layers x 16 KiB x 2 blocks = 64 KiB, so the 16 MiB
# pool holds 256 rows and the 400 stored here push the first ones out of RAM.
GEO = Geometry(groups=[[16384, 16384]], world_size=1, num_blocks=1024, namespace="disk-ns")
ROW = 64 << 10
STORED = 400
PER_JOB = 50
LOAD_BASE = 800  # loads land in blocks the stores never used


def serve(daemon_factory, disk: Path, *more: str) -> DaemonProcess:
    return daemon_factory(
        "--pool-size", "16MiB", "--disk", str(disk), "--disk-size", "64MiB", *more
    )  # fmt: skip


def store(engine: Engine, chunks: range, paced: DepotClient | None = None) -> list[bytes]:
    """Stores `chunks`, PER_JOB rows a job. `paced`: each job's rows are on disk before
    the next job (a burst larger than the pool, stored faster than the disk writes,
    loses its oldest rows to eviction before they are written: counted, not exact)."""
    keys: list[bytes] = []
    start = stats(paced).disk_writes if paced is not None else 0
    for first in range(chunks.start, chunks.stop, PER_JOB):
        part = range(first, min(first + PER_JOB, chunks.stop))
        k, blocks, idx = chunk_plan(GEO, part, base_block=first * GEO.blocks_per_chunk)
        engine.fill(0, k, blocks[0], idx[0])
        res = engine.job(pb.STORE, k, blocks, idx)
        assert res.success, res.error
        keys += k
        if paced is not None:
            done = start + len(keys)
            wait_for(lambda n=done: stats(paced).disk_writes >= n, what="the job's rows on disk")
    return keys


def settled(c: DepotClient) -> pb.GetStatsResponse:
    """Stats once no disk write is in flight or waiting."""
    return wait_for(
        lambda: (s := stats(c)).disk_inflight_bytes == 0 and s.disk_write_waiting == 0 and s,
        what="writes done",
    )


def store_until_up(
    engine: Engine, c: DepotClient, fresh: range, timeout: float, log: Callable[[], str]
) -> None:
    """Stores rows of `fresh` one at a time (each not in RAM yet, so each makes a disk
    write, which lets the tier's probe through after its back-off) until the disk tier
    is healthy again."""
    rows = iter(fresh)

    def back_up() -> bool:
        chunk = next(rows)
        store(engine, range(chunk, chunk + 1))
        return stats(c).disk_healthy

    wait_for(back_up, timeout=timeout, what="disk back up", interval=0.2, detail=log)


def load_mismatches(engine: Engine, chunks: range) -> int:
    keys, blocks, idx = chunk_plan(GEO, chunks, base_block=LOAD_BASE)
    res = engine.job(pb.LOAD, keys, blocks, idx)
    assert res.success, res.error
    return engine.mismatches(0, keys, blocks[0], idx[0])


def promote(c: DepotClient, keys: list[bytes]) -> list[int]:
    states = list(c.prefetch(GEO.namespace, keys, timeout=5.0).states)
    wait_for(lambda: all(c.lookup(GEO.namespace, keys)), what="rows promoted from disk")
    return states


def test_evicted_rows_come_back_from_disk_across_restarts(daemon_factory, tmp_path) -> None:
    d = serve(daemon_factory, tmp_path / "disk")
    c = connect(d, "engine")
    assert c.hello.remote_tier  # a tier below the pool: the connector answers RETRY
    engine = Engine(c, GEO, 0)
    keys = store(engine, range(STORED), paced=c)
    s = wait_for(lambda: (s := stats(c)).disk_writes == STORED and s, what="rows on disk")
    assert (s.disk_enabled, s.disk_healthy, s.disk_records) == (True, True, STORED)
    assert s.disk_write_bytes == STORED * ROW and s.disk_used_bytes >= STORED * ROW
    assert s.disk_capacity_bytes == (64 << 20) - 4096 and not s.disk_write_drops
    assert s.evictions > 0
    first = range(PER_JOB)
    assert c.lookup(GEO.namespace, keys[:PER_JOB]) == [False] * PER_JOB  # out of RAM

    assert promote(c, keys[:PER_JOB]) == [FETCHING] * PER_JOB
    assert load_mismatches(engine, first) == 0
    s = stats(c)
    assert (s.disk_hits, s.disk_reads, s.disk_rejected) == (PER_JOB, PER_JOB, 0)
    # Promoted rows are not written again; rows in RAM answer LOCAL, unknown keys ABSENT.
    assert stats(c).disk_writes == STORED
    other = [bytes(36)]
    assert list(c.prefetch(GEO.namespace, keys[:1] + other).states) == [LOCAL, ABSENT]
    c.close()

    # A clean stop writes the disk's index; the next start serves it at once.
    assert d.stop() == 0
    assert "index checkpoint written" in d.log()
    d.start()
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    s = wait_for(lambda: (s := stats(c)).disk_recovery_complete and s, what="index back")
    assert (s.disk_recovery_source, s.disk_recovered, s.disk_records) == (
        "checkpoint",
        STORED,
        STORED,
    )
    assert promote(c, keys[:PER_JOB]) == [FETCHING] * PER_JOB
    assert load_mismatches(engine, first) == 0
    c.close()

    # After a SIGKILL the index comes back from the records' headers.
    d.kill()
    d.start()
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    s = wait_for(lambda: (s := stats(c)).disk_recovery_complete and s, what="index back")
    assert (s.disk_recovery_source, s.disk_records) == ("scan", STORED)
    last = range(STORED - PER_JOB, STORED)
    assert promote(c, keys[-PER_JOB:]) == [FETCHING] * PER_JOB
    assert load_mismatches(engine, last) == 0
    assert stats(c).disk_rejected == 0
    c.close()


def test_a_burst_larger_than_the_pool_is_written_or_counted_never_lost_silently(
    daemon_factory, tmp_path
) -> None:
    """400 rows stored at once into a 256-row pool, faster than the disk writes: rows
    past the bound on bytes in flight wait (as keys) and go as writes finish; one RAM
    evicts first is counted (`evicted`). Every row out of RAM is on disk, byte for
    byte, or counted: none is lost without a figure, and no store is refused."""
    d = serve(daemon_factory, tmp_path / "disk")
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    keys = store(engine, range(STORED))
    s = settled(c)
    lost = s.disk_write_drops.get("evicted", 0) + s.disk_write_drops.get("backlog_full", 0)
    assert s.disk_writes + lost == STORED and s.disk_writes > 0, s
    assert not s.dropped_stores and s.evictions > 0
    gone = [i for i, here in enumerate(c.lookup(GEO.namespace, keys)) if not here]
    absent = 0
    for part in (gone[n : n + 32] for n in range(0, len(gone), 32)):  # the promoter's share
        states = list(c.prefetch(GEO.namespace, [keys[i] for i in part], timeout=5.0).states)
        assert set(states) <= {FETCHING, ABSENT}, states
        came = [i for i, st in zip(part, states, strict=True) if st == FETCHING]
        wait_for(lambda a=came: all(c.lookup(GEO.namespace, [keys[i] for i in a])), what="back")
        assert sum(load_mismatches(engine, range(i, i + 1)) for i in came) == 0
        absent += len(part) - len(came)
    assert absent == lost
    c.close()


def test_directory_removed_while_serving_degrades_to_ram_and_recovers(
    daemon_factory, tmp_path
) -> None:
    disk = tmp_path / "disk"
    d = serve(daemon_factory, disk)
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    keys = store(engine, range(300), paced=c)
    wait_for(lambda: stats(c).disk_writes == 300, what="rows on disk")
    report = status_json(d.socket_path, "--interval", "0")["disk"]
    assert report["disk_healthy"] and report["disk_records"] == 300, report
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert re.search(r"^disk\s+healthy · 19\.9 MiB of 64\.0 MiB, 300 records", screen, re.M), screen
    shutil.rmtree(disk)

    # The next writes find the file gone: the disk is down, its index forgotten, and
    # the daemon goes on from RAM (stores succeed, evicted rows are simply absent).
    more = store(engine, range(300, 350))
    s = wait_for(lambda: not (s := stats(c)).disk_healthy and s, what="disk down")
    assert s.disk_errors >= 1 and s.disk_down_reason
    assert all(c.lookup(GEO.namespace, more))
    assert list(c.prefetch(GEO.namespace, keys[:2]).states) == [ABSENT, ABSENT]
    assert re.search(r"disk tier \S+ failed \(.*was removed", d.log())
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert re.search(r"^disk\s+DOWN:", screen, re.M) and "was removed" in screen, screen

    # A probe (on a later write, after a back-off) creates the directory and file anew.
    store_until_up(engine, c, range(350, 400), 10, d.log)
    store(engine, range(400, 410))
    wait_for(lambda: stats(c).disk_records >= 10, what="rows written to the new file")
    assert (disk / "kvdepot-disk.tier").exists()
    c.close()
    assert d.stop() == 0


def test_disk_figures_in_prometheus_and_start_refusals(daemon_factory, tmp_path) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(
        "--pool-size", "16MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "8MiB",
        "--metrics-port", str(port),
    )  # fmt: skip
    c = connect(d, "engine")
    engine = Engine(c, GEO, 0)
    store(engine, range(200))  # 12.5 MiB of rows: the 8 MiB disk evicts its oldest
    s = wait_for(
        lambda: (s := stats(c)).disk_writes + sum(s.disk_write_drops.values()) == 200 and s,
        what="every row written or dropped",
    )
    assert s.disk_evicted > 0 and s.disk_used_bytes <= s.disk_capacity_bytes
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    figures = dict(re.findall(r"^(kvdepot_disk_[a-z_]+) (\S+)$", text, re.M))
    assert figures["kvdepot_disk_up"] == "1.0"
    assert float(figures["kvdepot_disk_capacity_bytes"]) == s.disk_capacity_bytes
    assert float(figures["kvdepot_disk_writes_total"]) >= s.disk_writes
    assert float(figures["kvdepot_disk_evicted_total"]) >= s.disk_evicted > 0
    c.close()

    # A second daemon on the same directory is refused at start, in one line.
    other = daemon_factory("--pool-size", "16MiB", "--disk", str(tmp_path / "disk"), start=False)
    other.launch()
    assert other.proc is not None and other.proc.wait(timeout=30) == 2
    assert "--disk" in other.log()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_ports(1)[0]).start()
    yield server
    server.kill()


def test_with_both_tiers_the_disk_is_asked_first_and_keeps_fleet_rows(
    daemon_factory, tmp_path, redis
) -> None:
    fleet = ("--remote", redis.url, *shared_key_args())
    a = daemon_factory("--pool-size", "16MiB", *fleet)
    ca = connect(a, "engine-a")
    keys = store(Engine(ca, GEO, 0), range(PER_JOB))
    wait_for(lambda: stats(ca).remote_writes == PER_JOB, what="A's rows in the fleet")

    b = serve(daemon_factory, tmp_path / "disk", *fleet)
    cb = connect(b, "engine-b")
    engine = Engine(cb, GEO, 0)
    assert promote(cb, keys) == [FETCHING] * PER_JOB  # from the fleet: the disk lacks them
    s = wait_for(
        lambda: (s := stats(cb)).disk_writes == PER_JOB and s,
        what="kept on disk",
        detail=lambda: str(stats(cb)),
    )
    assert (s.remote_hits, s.disk_hits, s.disk_misses) == (PER_JOB, 0, PER_JOB)
    cb.close()

    b.stop()
    b.start()  # RAM empty, the disk's index back from its checkpoint
    cb = connect(b, "engine-b")
    engine = Engine(cb, GEO, 0)
    wait_for(lambda: stats(cb).disk_recovery_complete, what="index back")
    assert promote(cb, keys) == [FETCHING] * PER_JOB
    assert load_mismatches(engine, range(PER_JOB)) == 0
    s = stats(cb)
    assert (s.disk_hits, s.remote_reads, s.remote_hits) == (PER_JOB, 0, 0)  # never asked
    cb.close()
    ca.close()


@contextlib.contextmanager
def small_ext4(where: Path, size: str = "32M") -> Iterator[Path]:
    """A real ext4 file system on a loop device (root only), unmounted afterwards."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("a loop-mounted ext4 needs root and mkfs.ext4")
    image, mnt = where / "ext4.img", where / "mnt"
    mnt.mkdir(parents=True)
    subprocess.run(["truncate", "-s", size, str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    proc = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot loop-mount ext4: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_disk_too_small_leaves_the_daemon_serving_from_ram_and_the_space_free(
    daemon_factory, tmp_path
) -> None:
    with small_ext4(tmp_path) as mnt:
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        d = daemon_factory(
            "--pool-size", "16MiB", "--disk", str(mnt / "disk"), "--disk-size", "64MiB"
        )  # fmt: skip
        c = connect(d, "engine")
        s = stats(c)
        assert s.disk_enabled and not s.disk_healthy and "No space" in s.disk_down_reason
        assert re.search(r"disk tier \S+ is down at start \(.*No space", d.log())
        # ext4 keeps what a failed fallocate reserved: the tier gives it back.
        assert os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize >= free - (1 << 20)
        keys = store(Engine(c, GEO, 0), range(20))  # RAM only: stores succeed
        assert all(c.lookup(GEO.namespace, keys))
        assert stats(c).disk_write_drops["tier_down"] >= 1
        c.close()
        assert d.stop() == 0
