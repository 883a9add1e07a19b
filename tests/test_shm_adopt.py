"""SharedKVBuffer.adopt: plain process memory moved into a memfd in place keeps every
byte at its address, is shared with whoever maps the memfd, and is refused (with why)
when it is not anonymous private memory."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest

from kvdepot.client.shm import AdoptError, SharedKVBuffer
from kvdepot.server.memory.regions import SharedMemoryRegion


def mapping_of(address: int) -> str:
    """The /proc/self/maps line holding `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.strip()
    raise AssertionError(f"{address:#x} is not mapped")


def test_adopted_memory_keeps_its_bytes_and_is_shared_both_ways() -> None:
    # Larger than one 64 MiB move step, not page-aligned at either end, with zero
    # and non-zero stretches (zero stretches are not copied).
    rng = np.random.default_rng(3)
    whole = np.zeros(150 << 20, dtype=np.uint8)
    data = whole[100 : 100 + (140 << 20) + 7]
    data[: 5 << 20] = rng.integers(0, 256, 5 << 20, dtype=np.uint8)
    data[-(3 << 20) :] = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    data[70 << 20] = 1
    before_whole = whole.copy()
    address = data.ctypes.data

    buf = SharedKVBuffer.adopt(address, data.nbytes)
    try:
        assert "memfd:" in mapping_of(address) and "memfd:" in mapping_of(address + data.nbytes - 1)
        assert np.array_equal(whole, before_whole)  # the bytes around it too
        assert buf.address <= address and address + data.nbytes <= buf.address + buf.size
        assert buf.address % mmap.PAGESIZE == 0 and buf.size % mmap.PAGESIZE == 0
        found = SharedKVBuffer.containing(address, data.nbytes)
        assert found is not None and found[0] is buf and found[1] == address - buf.address

        # Another mapping of the memfd (the daemon's) sees our writes, and we see its.
        other = mmap.mmap(buf.fd, buf.size)
        offset = address - buf.address
        data[12345] = 0xAB
        assert other[offset + 12345] == 0xAB
        other[offset + (100 << 20)] = 0xCD
        assert data[100 << 20] == 0xCD
        assert bytes(buf.memoryview()[offset : offset + 16]) == data[:16].tobytes()
        other.close()
    finally:
        buf.close()
    # The memory stays usable after the buffer lets go of its fd.
    data[1] = 9
    assert data[1] == 9


def test_adopt_refuses_memory_that_is_not_anonymous_private() -> None:
    with tempfile.TemporaryFile() as f:
        f.truncate(1 << 20)
        m = mmap.mmap(f.fileno(), 1 << 20)
        view = np.frombuffer(m, dtype=np.uint8)
        with pytest.raises(AdoptError, match="not anonymous private read-write memory"):
            SharedKVBuffer.adopt(view.ctypes.data, 1 << 20)
        del view
        m.close()
    shared = mmap.mmap(-1, 1 << 20)  # MAP_SHARED: already shareable, not ours to move
    view = np.frombuffer(shared, dtype=np.uint8)
    with pytest.raises(AdoptError, match="rw-s"):
        SharedKVBuffer.adopt(view.ctypes.data, 1 << 20)
    del view
    shared.close()


def test_adopt_refuses_an_unmapped_range() -> None:
    m = mmap.mmap(-1, 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    address = np.frombuffer(m, dtype=np.uint8).ctypes.data
    m.close()
    with pytest.raises(AdoptError, match="not mapped"):
        SharedKVBuffer.adopt(address, mmap.PAGESIZE)


def test_the_daemon_populates_a_fully_allocated_memfd_and_refuses_a_sparse_one() -> None:
    """The daemon's mapping of an adopted KV cache is populated ahead of the copies;
    a sparse memfd is refused (its pages would be allocated, and charged, by the
    daemon), and SharedKVBuffer.allocate's memfds are populated by their owner."""
    data = np.ones(32 << 20, dtype=np.uint8)
    buf = SharedKVBuffer.adopt(data.ctypes.data, data.nbytes)
    fresh = SharedKVBuffer.allocate(32 << 20)
    sparse = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(sparse, 32 << 20)
    try:
        assert os.fstat(fresh.fd).st_blocks * 512 >= fresh.size
        full = SharedMemoryRegion.from_passed_fd(buf.fd, buf.size)
        assert full.populated.wait(30)
        assert resident_kib(full.address) * 1024 == buf.size
        with pytest.raises(ValueError, match="populate it first"):
            SharedMemoryRegion.from_passed_fd(sparse, 32 << 20)
        assert os.fstat(sparse).st_blocks == 0  # the daemon allocated nothing
        full.close()
    finally:
        buf.close()
        fresh.close()
        os.close(sparse)


def resident_kib(address: int) -> int:
    """Rss of the mapping that starts at `address` (from /proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                inside = int(first.split("-")[0], 16) == address
            elif inside and first == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping starts at {address:#x}")
