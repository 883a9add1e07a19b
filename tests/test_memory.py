"""kvdepot.server.memory: regions and the arena unmap when closed, and the
arena's hooks (warm-up chunks, close) run where they are documented to."""

from __future__ import annotations

import mmap
import os

from kvdepot.server.memory.arena import Arena
from kvdepot.server.memory.regions import SharedMemoryRegion, buffer_address


def mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_buffer_address_leaves_no_export_behind() -> None:
    m = mmap.mmap(-1, 4096)
    address = buffer_address(m)
    assert mapped(address)
    m.close()  # would raise BufferError if the address still held an export
    assert not mapped(address)


def test_closing_a_shared_memory_region_unmaps_it_at_once() -> None:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 1 << 20)
        os.posix_fallocate(fd, 0, 1 << 20)  # a sparse memfd is refused
        region = SharedMemoryRegion.from_passed_fd(fd, 1 << 20)
    finally:
        os.close(fd)
    assert mapped(region.address) and mapped(region.address + (1 << 20) - 1)
    region.close()
    region.close()  # idempotent
    assert not mapped(region.address)


def test_arena_runs_its_hooks_then_unmaps() -> None:
    arena = Arena(4 << 20)
    chunks: list[tuple[int, int]] = []
    arena.add_warmup_hook(lambda off, n: chunks.append((off, n)))
    events: list[str] = []
    arena.on_close(lambda: events.append(f"first added, mapped={mapped(arena.address)}"))
    arena.on_close(lambda: events.append(f"last added, mapped={mapped(arena.address)}"))
    arena.start_warmup(chunk_bytes=1 << 20)
    assert arena.wait_warmup(30) and arena.warmup_started
    assert chunks == [(i << 20, 1 << 20) for i in range(4)]
    arena.view(0, 4)[:] = b"abcd"
    assert bytes(arena.view(0, 4)) == b"abcd"
    arena.close()
    # Last added runs first (like a stack), both while the pool is still mapped.
    assert events == ["last added, mapped=True", "first added, mapped=True"]
    assert not mapped(arena.address)
    arena.close()  # idempotent: the hooks do not run twice
    assert len(events) == 2
