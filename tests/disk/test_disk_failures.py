"""A full, truncated or vanished disk degrades the tier to RAM only, logged in words,
never raised into the caller, and the tier comes back when the disk does (real
file systems: a small tmpfs; the directory removed while writing)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.server.disk.files import FILE_NAME
from kvdepot.server.disk.record import PAGE
from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from tests.disk.helpers import NS, block, key, mounted, read, write

LENGTH = 64 * PAGE


def until(check: Callable[[], bool], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the disk tier did not come back"
        time.sleep(0.05)


def fill(directory: Path) -> Path:
    """Fills the file system of `directory` to the last byte."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\x01" * (64 << 10)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_no_space_at_open_leaves_the_tier_down_until_space_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvdepot.disk")
    with mounted("tmpfs", tmp_path / "mnt", "8m") as mnt:
        filler = fill(mnt)
        tier = DiskTier(mnt / "tier", 4 << 20)
        try:
            tier.open()  # never raises for a full disk
            stats = tier.snapshot()
            assert not stats["up"] and "No space" in str(stats["down_reason"])
            assert tier.write(NS, key(1), block(key(1), LENGTH)) is WriteVerdict.TIER_DOWN
            assert read(tier, key(1)) is None
            filler.unlink()
            until(lambda: write(tier, key(1), LENGTH) is WriteVerdict.ACCEPTED)
            assert read(tier, key(1)) == bytes(block(key(1), LENGTH))
            assert tier.snapshot()["dropped_down"] >= 1
        finally:
            tier.close()
    assert "failed" in caplog.text and "works again" in caplog.text


def test_enospc_while_writing_degrades_and_recovers_without_a_wrong_byte(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvdepot.disk")
    with mounted("tmpfs", tmp_path / "mnt", "8m") as mnt:
        tier = DiskTier(mnt / "tier", 4 << 20)
        tier.open()
        try:
            for i in range(3):
                assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
            # The reservation is lost (the file truncated) and the file system filled.
            os.truncate(mnt / "tier" / FILE_NAME, 0)
            filler = fill(mnt)
            assert write(tier, key(7), LENGTH) is WriteVerdict.TIER_DOWN  # ENOSPC
            stats = tier.snapshot()
            assert not stats["up"] and stats["write_errors"] == 1
            assert "No space" in str(stats["down_reason"])
            assert write(tier, key(8), LENGTH) is WriteVerdict.TIER_DOWN  # dropped
            filler.unlink()
            until(lambda: write(tier, key(7), LENGTH) is WriteVerdict.ACCEPTED)
            assert read(tier, key(7)) == bytes(block(key(7), LENGTH))
            for i in range(3):  # their bytes are gone: never served
                assert read(tier, key(i)) is None
            assert tier.snapshot()["rejected"] == 3
        finally:
            tier.close()
    assert "No space left on device" in caplog.text and "works again" in caplog.text


def test_the_directory_removed_while_writing(tmp_path: Path) -> None:
    directory = tmp_path / "tier"
    tier = DiskTier(directory, 16 << 20)
    tier.open()
    try:
        blocks = [block(key(i), LENGTH) for i in range(40)]
        verdicts = []
        for i in range(40):
            if i == 20:
                shutil.rmtree(directory)
            verdicts.append(tier.write(NS, key(i), blocks[i]))
        until(lambda: not tier.snapshot()["up"])
        stats = tier.snapshot()
        assert stats["write_errors"] >= 1 and "removed" in str(stats["down_reason"])
        assert read(tier, key(0)) is None  # the file is gone, and its index with it
        # The next write after the back-off creates the directory and file anew.
        until(lambda: write(tier, key(50), LENGTH) is WriteVerdict.ACCEPTED)
        assert read(tier, key(50)) == bytes(block(key(50), LENGTH))
        assert (directory / FILE_NAME).stat().st_size == 16 << 20
        assert tier.snapshot()["outages"] == 1 and tier.contains(NS, key(50))
        assert not tier.contains(NS, key(0))
    finally:
        tier.close()
