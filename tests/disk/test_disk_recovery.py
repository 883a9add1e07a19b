"""A damaged disk tier never serves a wrong byte: flipped bytes, torn records, a
truncated file, a record of another namespace; and a writer killed by SIGKILL in
the middle of its writes loses only what it had not finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvdepot.server.disk import record
from kvdepot.server.disk.checkpoint import FILE_NAME as CHECKPOINT
from kvdepot.server.disk.files import FILE_NAME, TierBusy
from kvdepot.server.disk.record import PAGE
from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from tests.disk.helpers import NS, block, key, opened, read, record_key, write

LENGTH = 3 * PAGE + 100
SIZE = 4 << 20


def records_on_disk(path: Path) -> dict[tuple[str, bytes], int]:
    """(namespace, key) -> offset of every header page in the file (that the
    directory's record key authenticates)."""
    data = path.read_bytes()
    rkey = record_key(path.parent)
    found = {}
    for off in range(0, len(data), PAGE):
        h = record.decode_header(data[off : off + PAGE], off, rkey)
        if h is not None:
            found[(h.namespace, h.key)] = off
    return found


def patch(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def filled(directory: Path, n: int) -> Path:
    with opened(directory, SIZE) as tier:
        for i in range(n):
            assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
    return directory / FILE_NAME


def test_a_flipped_byte_is_never_served_live_or_after_a_restart(tmp_path: Path) -> None:
    path = filled(tmp_path, 4)
    where = records_on_disk(path)
    with opened(tmp_path, SIZE) as tier:
        patch(path, where[(NS, key(1))] + PAGE + 1234, b"\xff")  # in the payload
        patch(path, where[(NS, key(2))] + record.NAMESPACE_AT + 1, b"\x00")  # the namespace id
        assert read(tier, key(1)) is None
        assert read(tier, key(2)) is None
        assert read(tier, key(0)) == bytes(block(key(0), LENGTH))
        stats = tier.snapshot()
        assert stats["rejected"] == 2 and stats["dropped_entries"] == 2
        assert not tier.contains(NS, key(1))  # dropped: not asked for again
    with opened(tmp_path, SIZE) as tier:  # a clean stop: its index checkpoint
        assert tier.snapshot()["recovery_source"] == "checkpoint"
        assert not tier.contains(NS, key(1)) and not tier.contains(NS, key(2))
        for i in (0, 3):
            assert read(tier, key(i)) == bytes(block(key(i), LENGTH))
    # Damage while stopped: the checkpoint no longer vouches for the file; the scan.
    patch(path, where[(NS, key(0))] + record.NAMESPACE_AT + 1, b"\x00")  # header (namespace id)
    patch(path, where[(NS, key(3))] + PAGE + 99, b"\xff")  # payload
    with opened(tmp_path, SIZE) as tier:
        assert tier.snapshot()["recovery_source"] == "scan"
        assert tier.length_of(NS, key(0)) is None  # the header's tag fails the scan
        assert read(tier, key(3)) is None  # the payload's digest fails the read
        assert tier.snapshot()["rejected"] == 1


def test_a_torn_record_is_dropped_and_its_neighbours_kept(tmp_path: Path) -> None:
    path = filled(tmp_path, 3)
    where = records_on_disk(path)
    # A crash while key 9's record went over key 1's extent: its header and the
    # first page of its payload made it, the rest is key 1's old bytes.
    payload = bytes(block(key(9), LENGTH))
    page = memoryview(bytearray(PAGE))
    at, rkey = where[(NS, key(1))], record_key(tmp_path)
    digest = rkey.payload_tag(NS, key(9), at, payload)
    record.encode_header(record.Header(NS, key(9), LENGTH, digest), page, at, rkey)
    patch(path, at, bytes(page) + payload[:PAGE])
    with opened(tmp_path, SIZE) as tier:
        assert read(tier, key(9)) is None
        assert read(tier, key(1)) is None
        assert tier.snapshot()["rejected"] == 1
        for i in (0, 2):
            assert read(tier, key(i)) == bytes(block(key(i), LENGTH))
        assert write(tier, key(9), LENGTH) is WriteVerdict.ACCEPTED  # room again
        assert read(tier, key(9)) == payload


def test_a_truncated_file_serves_what_is_left_and_is_reserved_again(tmp_path: Path) -> None:
    path = filled(tmp_path, 4)
    where = records_on_disk(path)
    cut = where[(NS, key(2))] + PAGE + 2 * PAGE  # in the middle of key 2's payload
    os.truncate(path, cut)
    with opened(tmp_path, SIZE) as tier:
        stats = tier.snapshot()
        assert stats["recovered"] == 2 and stats["recovery_total_bytes"] == cut
        assert read(tier, key(2)) is None and read(tier, key(3)) is None
        for i in (0, 1):
            assert read(tier, key(i)) == bytes(block(key(i), LENGTH))
    assert path.stat().st_size == SIZE


def test_a_record_of_another_namespace_or_offset_is_never_served(tmp_path: Path) -> None:
    """ns-b's whole record, copied byte for byte over ns-a's: refused live (its header
    names ns-b), after a clean stop, and by the scan (its tags bind the offset it was
    written at: a valid record moved elsewhere is not one)."""
    with opened(tmp_path, SIZE) as tier:
        assert write(tier, key(1), LENGTH) is WriteVerdict.ACCEPTED
        assert write(tier, key(1), LENGTH, ns="ns-b") is WriteVerdict.ACCEPTED
    path = tmp_path / FILE_NAME
    where = records_on_disk(path)
    size = record.record_size(LENGTH)
    with open(path, "rb") as f:
        f.seek(where[("ns-b", key(1))])
        other = f.read(size)
    with opened(tmp_path, SIZE) as tier:
        patch(path, where[(NS, key(1))], other)  # ns-b's record where ns-a's was
        assert read(tier, key(1)) is None  # live: the header names ns-b
        assert read(tier, key(1), ns="ns-b") == bytes(block(key(1), LENGTH))
    with opened(tmp_path, SIZE) as tier:  # a clean stop
        assert read(tier, key(1)) is None
        assert read(tier, key(1), ns="ns-b") == bytes(block(key(1), LENGTH))
    (tmp_path / CHECKPOINT).unlink()  # as after a crash: the scan refuses the copy
    with opened(tmp_path, SIZE) as tier:
        assert read(tier, key(1)) is None
        assert read(tier, key(1), ns="ns-b") == bytes(block(key(1), LENGTH))
        stats = tier.snapshot()
        assert (stats["recovery_refused"], stats["recovery_dropped"], stats["records"]) == (
            1,
            0,
            1,
        )


def test_a_clean_stop_keeps_the_index_and_its_lru_order(tmp_path: Path) -> None:
    record_size = record.record_size(LENGTH)
    size = 4 * record_size + PAGE
    with opened(tmp_path, size) as tier:
        for i in range(4):
            assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
        assert read(tier, key(0)) is not None  # key 1 is the least recently used
    assert (tmp_path / CHECKPOINT).exists()
    with opened(tmp_path, size) as tier:
        stats = tier.snapshot()
        assert stats["recovery_source"] == "checkpoint" and stats["recovered"] == 4
        assert not (tmp_path / CHECKPOINT).exists()  # consumed: a crash now scans
        assert write(tier, key(4), LENGTH) is WriteVerdict.ACCEPTED
        assert not tier.contains(NS, key(1)) and tier.contains(NS, key(0))
        for i in (0, 2, 3, 4):
            assert read(tier, key(i)) == bytes(block(key(i), LENGTH))


def test_one_daemon_per_disk_directory(tmp_path: Path) -> None:
    with opened(tmp_path, SIZE):
        other = DiskTier(tmp_path, SIZE)
        with pytest.raises(TierBusy, match="in use by another process"):
            other.open()
        other.close()


WRITER = """
import sys, time
from tests.disk.helpers import NS, block, key, write
from kvdepot.server.disk.tier import DiskTier
tier = DiskTier(sys.argv[1], int(sys.argv[2]), io_threads=4, max_inflight_bytes=1 << 30)
tier.open()
tier.wait_recovered(10)
length = int(sys.argv[3])
for i in range(8):  # acknowledged one by one
    assert write(tier, key(i), length).name == "ACCEPTED"
    print(i, flush=True)
blocks = [block(key(i), length) for i in range(8, 72)]
for i in range(8, 72):  # then 64 at once: in flight when the kill comes
    tier.write(NS, key(i), blocks[i - 8])
print("submitted", flush=True)
time.sleep(60)
"""


def test_sigkill_mid_write_keeps_the_finished_records_and_serves_no_torn_one(
    tmp_path: Path,
) -> None:
    length = (1 << 20) + 5
    size = 256 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(size), str(length)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(9)]  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lines == [*map(str, range(8)), "submitted"]
    tier = DiskTier(tmp_path, size)
    tier.open()
    try:
        assert tier.wait_recovered(10)
        assert tier.snapshot()["recovery_source"] == "scan"  # a SIGKILL leaves no checkpoint
        for i in range(8):  # what was acknowledged survives
            assert read(tier, key(i)) == bytes(block(key(i), length))
        # Each record of the writes in flight is whole (its bytes right) or never served.
        served = [i for i in range(8, 72) if read(tier, key(i)) is not None]
        for i in served:
            assert read(tier, key(i)) == bytes(block(key(i), length))
        stats = tier.snapshot()
        assert stats["records"] == 8 + len(served)
        assert stats["recovered"] == 8 + len(served) + stats["rejected"]
        assert len(served) < 64  # the kill came while writes were in flight
    finally:
        tier.close()


def test_a_clean_stop_syncs_the_records_before_its_checkpoint_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint lists records that are on stable storage: fdatasync first."""
    import kvdepot.server.disk.tier as tier_module
    from kvdepot.server.disk.files import TierFile

    order: list[str] = []
    real_sync, real_save = TierFile.sync, tier_module.save_checkpoint

    def sync(file: TierFile) -> None:
        order.append("fdatasync")
        real_sync(file)

    def save(file: TierFile, items: list) -> None:
        order.append("checkpoint")
        real_save(file, items)

    monkeypatch.setattr(TierFile, "sync", sync)
    monkeypatch.setattr(tier_module, "save_checkpoint", save)
    with opened(tmp_path, SIZE) as tier:
        for i in range(3):
            assert write(tier, key(i), LENGTH) is WriteVerdict.ACCEPTED
    assert order == ["fdatasync", "checkpoint"] and tier.snapshot()["syncs"] == 1
    order.clear()
    with opened(tmp_path, SIZE) as tier:  # nothing written since: nothing to sync
        assert tier.snapshot()["recovery_source"] == "checkpoint"
    assert order == ["checkpoint"] and tier.snapshot()["syncs"] == 0
