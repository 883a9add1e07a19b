"""The disk tier on real files: bytes in are bytes out, on O_DIRECT and buffered file
systems; a block is written once; LRU eviction under the capacity; the bound on
bytes in flight drops writes instead of queueing them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server.disk.record import PAGE
from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from tests.disk.helpers import NS, block, key, mounted, opened, read, write

# Payload sizes: whole pages, one byte over, a small odd size, a large block.
LENGTHS = [PAGE, PAGE + 1, 777, (1 << 20) + 123]


@pytest.fixture(params=["ext4-or-host", "tmpfs", "ramfs"])
def tier_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    if request.param == "ext4-or-host":
        yield tmp_path / "tier", request.param
        return
    with mounted(request.param, tmp_path / "mnt", "16m" if request.param == "tmpfs" else None):
        yield tmp_path / "mnt" / "tier", request.param


def test_bytes_in_are_bytes_out_and_survive_a_clean_restart(
    tier_dir: tuple[Path, str],
) -> None:
    directory, fs = tier_dir
    with opened(directory, 8 << 20) as tier:
        for i, n in enumerate(LENGTHS):
            assert write(tier, key(i), n) is WriteVerdict.ACCEPTED
        for i, n in enumerate(LENGTHS):
            assert read(tier, key(i)) == bytes(block(key(i), n))
        stats = tier.snapshot()
        # ramfs refuses O_DIRECT: the tier falls back to buffered I/O and says so.
        assert stats["direct_io"] is (fs != "ramfs")
        assert stats["records"] == len(LENGTHS) and stats["rejected"] == 0
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / "kvdepot-disk.tier").stat().st_mode & 0o777) == "0o600"
    with opened(directory, 8 << 20) as tier:
        assert tier.snapshot()["recovered"] == len(LENGTHS)
        for i, n in enumerate(LENGTHS):
            assert read(tier, key(i)) == bytes(block(key(i), n))
        assert read(tier, key(0), ns="ns-b") is None  # same key, other namespace


def test_a_block_on_disk_is_not_written_again(tmp_path: Path) -> None:
    with opened(tmp_path, 1 << 20) as tier:
        assert write(tier, key(1), 5000) is WriteVerdict.ACCEPTED
        assert write(tier, key(1), 5000) is WriteVerdict.ON_DISK
        stats = tier.snapshot()
        assert stats["written_records"] == 1 and stats["on_disk"] == 1


def test_eviction_drops_the_least_recently_used_and_a_read_touches(tmp_path: Path) -> None:
    record = PAGE + 8 * PAGE  # one header page + 8 payload pages
    with opened(tmp_path, 4 * record + PAGE) as tier:  # + the probe's page
        for i in range(4):
            assert write(tier, key(i), 8 * PAGE) is WriteVerdict.ACCEPTED
        assert read(tier, key(0)) is not None  # key 0 is now the most recent
        assert write(tier, key(4), 8 * PAGE) is WriteVerdict.ACCEPTED
        assert not tier.contains(NS, key(1))  # the least recently used went
        assert write(tier, key(5), 8 * PAGE) is WriteVerdict.ACCEPTED
        assert not tier.contains(NS, key(2))
        for i in (0, 3, 4, 5):
            assert read(tier, key(i)) == bytes(block(key(i), 8 * PAGE))
        assert tier.snapshot()["evicted"] == 2
        # Larger than the whole tier: dropped, nothing evicted for it.
        assert write(tier, key(9), 4 * record) is WriteVerdict.NO_SPACE
        assert tier.snapshot()["evicted"] == 2


def test_writes_past_the_bound_in_flight_are_dropped_not_queued(tmp_path: Path) -> None:
    length = 1 << 20
    blocks = [block(key(i), length) for i in range(64)]
    with opened(tmp_path, 128 << 20, max_inflight_bytes=3 * (length + PAGE)) as tier:
        verdicts = [tier.write(NS, key(i), blocks[i]) for i in range(64)]
        tier.close()  # waits for the accepted writes
        stats = tier.snapshot()
        accepted = verdicts.count(WriteVerdict.ACCEPTED)
        assert verdicts.count(WriteVerdict.BACKLOG_FULL) == stats["backlog_full"] > 0
        assert accepted + stats["backlog_full"] == 64
        assert stats["written_records"] == accepted and stats["inflight_bytes"] == 0


def test_memory_that_is_not_page_aligned_is_refused(tmp_path: Path) -> None:
    with opened(tmp_path, 1 << 20) as tier:
        with pytest.raises(ValueError, match="page-aligned"):
            tier.write(NS, key(1), block(key(1), 2 * PAGE)[1:])
        assert tier.snapshot()["written_records"] == 0


def test_an_unsafe_directory_is_refused_at_open(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(PermissionError, match="writable by group or others"):
        tier.open()
    tier.close()
