"""Real failing devices under a serving daemon (`kvdepot serve --disk` on a loop-mounted
ext4, root only): a file system that turns read-only after a real error (EROFS) takes
the tier down, logged in words, while stores and loads to RAM go on, and the tier comes
back once the file system is repaired and mounted again; a frozen file system (every
write blocked in the kernel) fills the bound on bytes in flight, the rows past it
wait as keys (or are dropped and counted), no request waits on it, the tier writes
again after the thaw, and a stop while it is frozen ends after a bounded wait."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.disk.helpers import loop_ext4
from tests.disk.test_disk_daemon import GEO, load_mismatches, settled, store, store_until_up
from tests.support.daemon import connect, stats
from tests.support.engine import Engine

pytest.importorskip("blake3")

LOCAL = pb.PrefetchResponse.LOCAL
ABSENT = pb.PrefetchResponse.ABSENT
FETCHING = pb.PrefetchResponse.FETCHING


def serve_on(daemon_factory, mnt: Path):
    return daemon_factory(
        "--pool-size", "16MiB", "--disk", str(mnt / "disk"), "--disk-size", "32MiB"
    )  # fmt: skip


def test_a_file_system_turned_read_only_degrades_to_ram_and_recovers(
    daemon_factory, tmp_path: Path
) -> None:
    with loop_ext4(tmp_path, "64M", "errors=remount-ro") as fs:
        d = serve_on(daemon_factory, fs.mnt)
        c = connect(d, "engine")
        engine = Engine(c, GEO, 0)
        store(engine, range(40))
        assert settled(c).disk_records > 0

        fs.trigger_error()  # ext4 aborts its journal and remounts read-only
        more = store(engine, range(40, 80))  # stores to RAM succeed all the same
        s = wait_for(lambda: not (s := stats(c)).disk_healthy and s, what="disk down")
        assert "Read-only file system" in s.disk_down_reason, s.disk_down_reason
        assert s.disk_errors >= 1
        assert re.search(r"disk tier \S+ failed \(.*Read-only file system", d.log())
        assert all(c.lookup(GEO.namespace, more))
        assert load_mismatches(engine, range(40, 80)) == 0  # loads from RAM
        assert list(c.prefetch(GEO.namespace, [more[0], bytes(36)]).states) == [LOCAL, ABSENT]
        assert stats(c).disk_write_drops["tier_down"] >= 1 or stats(c).disk_errors > 1

        # The operator repairs it: unmount, fsck, mount. A probe (on a later write,
        # after its back-off, which doubles up to 10 s while the file system stays
        # read-only) opens the file there again and the tier comes back.
        fs.mount_again()
        store_until_up(engine, c, range(80, 260), 30, d.log)
        assert "works again" in d.log()
        s = wait_for(lambda: (s := stats(c)).disk_recovery_complete and s, what="index back")
        before = s.disk_writes
        store(engine, range(200, 210))
        wait_for(lambda: stats(c).disk_writes > before, what="writes to the mounted-again disk")
        c.close()
        assert d.stop() == 0


def test_a_frozen_file_system_never_holds_a_request_nor_the_stop(
    daemon_factory, tmp_path: Path
) -> None:
    with loop_ext4(tmp_path, "64M") as fs:
        d = serve_on(daemon_factory, fs.mnt)
        c = connect(d, "engine")
        engine = Engine(c, GEO, 0)
        early = store(engine, range(300))  # the 16 MiB pool holds 256: the first go
        s = settled(c)
        out_of_ram = [
            k for k, there in zip(early, c.lookup(GEO.namespace, early), strict=True) if not there
        ]
        assert out_of_ram and s.disk_records > 0

        fs.freeze()
        rows = iter(range(300, 475, 25))  # blocks for 512 rows in all
        hot: list[bytes] = []

        def past_the_bound() -> bool:  # RAM takes every row; their disk writes block
            first = next(rows)
            hot.extend(store(engine, range(first, first + 25)))
            return stats(c).disk_write_waiting > 0  # the bound is full: rows wait

        try:
            wait_for(past_the_bound, interval=0, what="rows waiting behind the bound")
            s = stats(c)
            assert s.disk_inflight_bytes > 0 and s.disk_healthy  # blocked, not failed
            written, last = s.disk_writes, len(hot) // 25 * 25 + 300
            assert load_mismatches(engine, range(last - 25, last)) == 0  # loads from RAM
            assert list(c.prefetch(GEO.namespace, hot[-2:]).states) == [LOCAL, LOCAL]
            # A row only on disk: reads go on while writes are frozen, so the Prefetch
            # answers at once and the row comes in (or, were it gone, ABSENT).
            state = c.prefetch(GEO.namespace, out_of_ram[-1:], timeout=5.0).states[0]
            if state == FETCHING:
                wait_for(lambda: c.lookup(GEO.namespace, out_of_ram[-1:])[0], what="promoted")
            else:
                assert state == ABSENT
            assert stats(c).disk_writes == written  # nothing finished while frozen
        finally:
            fs.thaw()
        s = settled(c)  # the blocked writes finish
        assert s.disk_writes > written and s.disk_healthy
        store(engine, range(475, 485))
        wait_for(lambda: stats(c).disk_writes > s.disk_writes, what="writes after the thaw")

        # A stop while frozen: the tier waits a bounded time for its blocked writes,
        # says so, and the daemon stops (the kernel holds the stuck threads until the
        # thaw; the process exits then).
        settled(c)
        fs.freeze()
        try:
            store(engine, range(485, 510))
            wait_for(lambda: stats(c).disk_inflight_bytes > 0, what="writes blocked")
            c.close()
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            d.wait_log(r"stopped; sockets removed", timeout=20)
            assert re.search(r"disk I/O still blocked after \d+ s .*frozen or hung", d.log())
        finally:
            fs.thaw()
        assert d.proc.wait(timeout=10) == 0
