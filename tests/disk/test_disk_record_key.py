"""The disk tier's record key, with real files: created 0600 at first use and kept
across restarts; refused when others could read it; a new key (the file removed)
and records of the format before keys are never adopted; a forged header in free
space is counted, not adopted (the daemon-level attack: tests/security/
test_disk_forgery.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvdepot.server.disk import record, secret
from kvdepot.server.disk.checkpoint import FILE_NAME as CHECKPOINT
from kvdepot.server.disk.files import FILE_NAME
from kvdepot.server.disk.record import PAGE
from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from kvdepot.server.memory.private_files import UnsafeFileError
from tests.disk.helpers import NS, Waiter, block, key, opened, read, record_key, write
from tests.disk.test_disk_recovery import patch, records_on_disk
from tests.security.disk_forger import v1_header

LENGTH = 2 * PAGE
SIZE = 1 << 20


def test_the_key_is_the_daemons_own_and_kept_across_restarts(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    with opened(directory, SIZE) as tier:
        assert write(tier, key(0), LENGTH) is WriteVerdict.ACCEPTED
    path = directory / secret.FILE_NAME
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # created by the tier
    first = path.read_bytes()
    assert len(first) == record.KEY_BYTES
    (directory / CHECKPOINT).unlink()  # as after a crash: the scan needs the same key
    with opened(directory, SIZE) as tier:
        assert tier.snapshot()["recovery_source"] == "scan"
        assert read(tier, key(0)) == bytes(block(key(0), LENGTH))
    assert path.read_bytes() == first


def test_a_key_others_may_read_is_refused_at_open(tmp_path: Path) -> None:
    with opened(tmp_path, SIZE):
        pass
    path = tmp_path / secret.FILE_NAME
    os.chmod(path, 0o644)
    tier = DiskTier(tmp_path, SIZE)
    with pytest.raises(UnsafeFileError, match=r"record key .* has mode 0644"):
        tier.open()
    tier.close()
    os.chmod(path, 0o600)
    with opened(tmp_path, SIZE) as tier:  # the legitimate key serves again
        assert tier.snapshot()["up"]


def test_records_under_another_key_are_not_adopted(tmp_path: Path) -> None:
    with opened(tmp_path, SIZE) as tier:
        for i in range(3):
            assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
    (tmp_path / secret.FILE_NAME).unlink()  # a new key at the next open
    (tmp_path / CHECKPOINT).unlink()
    with opened(tmp_path, SIZE) as tier:
        stats = tier.snapshot()
        assert (stats["recovered"], stats["recovery_refused"]) == (0, 3)
        assert read(tier, key(0)) is None
        assert write(tier, key(0), LENGTH) is WriteVerdict.ACCEPTED  # the space is free
        assert read(tier, key(0)) == bytes(block(key(0), LENGTH))


def test_a_damaged_key_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with opened(tmp_path, SIZE) as tier:
        assert write(tier, key(0), LENGTH) is WriteVerdict.ACCEPTED
    (tmp_path / secret.FILE_NAME).write_bytes(b"short")
    with opened(tmp_path, SIZE) as tier:
        assert read(tier, key(0)) is None  # the checkpoint's record: its tags fail
        assert tier.snapshot()["rejected"] == 1
    assert "has 5 bytes, not 32 (damaged)" in caplog.text
    assert len((tmp_path / secret.FILE_NAME).read_bytes()) == record.KEY_BYTES


def test_old_format_and_forged_headers_in_free_space_are_counted_not_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with opened(tmp_path, SIZE) as tier:
        for i in range(2):
            assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
    path = tmp_path / FILE_NAME
    end = max(records_on_disk(path).values()) + record.record_size(LENGTH)
    payload = b"\xee" * LENGTH
    # After the records, in free space: a version-1 record (what the format before keys
    # accepted), a current one under a guessed key, and a whole valid record copied.
    guess = record.RecordKey(bytes(32))
    forged = memoryview(bytearray(PAGE))
    at = end + 2 * record.record_size(LENGTH)
    tag = guess.payload_tag(NS, key(8), at, payload)
    record.encode_header(record.Header(NS, key(8), LENGTH, tag), forged, at, guess)
    with open(path, "rb") as f:
        f.seek(records_on_disk(path)[(NS, key(0))])
        genuine = f.read(record.record_size(LENGTH))
    patch(path, end, v1_header(NS, key(7), payload) + payload)
    patch(path, end + record.record_size(LENGTH), genuine)
    patch(path, at, bytes(forged) + payload)
    (tmp_path / CHECKPOINT).unlink()  # as after a crash: the scan walks free space
    with opened(tmp_path, SIZE) as tier:
        stats = tier.snapshot()
        assert (stats["recovered"], stats["recovery_old_format"], stats["recovery_refused"]) == (
            2,
            1,
            2,
        )
        for i in (7, 8):
            assert not tier.contains(NS, key(i))
        for i in range(2):
            assert read(tier, key(i)) == bytes(block(key(i), LENGTH))
    assert "1 record headers of an older format (before version 2) were not adopted" in (
        caplog.text
    )
    assert "2 pages that look like record headers did not authenticate" in caplog.text
    assert record_key(tmp_path).payload_tag(NS, key(8), at, payload) != tag


@pytest.mark.parametrize("source", ["checkpoint", "scan"])
def test_records_a_dropped_fleet_key_admitted_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, source: str
) -> None:
    """Rows fetched from the fleet keep the id of the key that admitted them on disk;
    an open whose held keys lack it drops them (after a clean stop or a crash), and
    keeps this node's own rows and those of a key still held."""
    old, new = b"o" * 8, b"n" * 8
    with opened(tmp_path, SIZE) as tier:
        for i, admitted_by in enumerate([b"", old, new, old]):
            w = Waiter()
            tier.write(NS, key(i), block(key(i), LENGTH), w, admitted_by)
            assert w.wait()
        assert tier.record_of(NS, key(1)) == (LENGTH, old)
    if source == "scan":
        (tmp_path / CHECKPOINT).unlink()
    tier = DiskTier(tmp_path, SIZE, held_fleet_keys=frozenset({new}))
    tier.open()
    try:
        assert tier.wait_recovered(10)
        stats = tier.snapshot()
        assert stats["recovery_source"] == source
        assert (stats["recovered"], stats["recovery_unheld"]) == (2, 2)
        assert [tier.contains(NS, key(i)) for i in range(4)] == [True, False, True, False]
        assert read(tier, key(2)) == bytes(block(key(2), LENGTH))
        assert tier.record_of(NS, key(2)) == (LENGTH, new)
        assert write(tier, key(1), LENGTH) is WriteVerdict.ACCEPTED  # its space is free
    finally:
        tier.close()
    assert "2 records of rows fetched from the fleet were dropped" in caplog.text
