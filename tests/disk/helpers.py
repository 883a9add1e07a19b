"""Real files for the disk tier's tests: page-aligned memory, blocks whose bytes
follow from their key, synchronous writes and reads, small mounted file systems."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier

NS = "ns-a"


def block(key: bytes, length: int) -> memoryview:
    """Page-aligned memory (an mmap, as the pool's) holding `length` bytes made from `key`."""
    buf = mmap.mmap(-1, max(length, 1))
    seed = hashlib.sha256(key).digest()
    pattern = (seed * (length // len(seed) + 1))[:length]
    buf[:length] = pattern
    return memoryview(buf)[:length]


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


class Waiter:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.ok: bool | None = None

    def __call__(self, ok: bool) -> None:
        self.ok = ok
        self.event.set()

    def wait(self) -> bool:
        assert self.event.wait(10), "a disk tier callback never came"
        assert self.ok is not None
        return self.ok


def write(tier: DiskTier, k: bytes, length: int, ns: str = NS) -> WriteVerdict:
    """Writes block(k) and waits for it; the verdict, or the write's failure as
    TIER_DOWN."""
    w = Waiter()
    verdict = tier.write(ns, k, block(k, length), w)
    if verdict is WriteVerdict.ACCEPTED and not w.wait():
        return WriteVerdict.TIER_DOWN
    return verdict


def read(tier: DiskTier, k: bytes, ns: str = NS) -> bytes | None:
    """The block's bytes as the tier serves them; None when it serves nothing."""
    length = tier.length_of(ns, k)
    if length is None:
        return None
    dest = memoryview(mmap.mmap(-1, length))
    w = Waiter()
    if not tier.read(ns, k, dest, w) or not w.wait():
        return None
    return bytes(dest[:length])


@contextlib.contextmanager
def opened(directory: Path, size: int, **kw: int) -> Iterator[DiskTier]:
    tier = DiskTier(directory, size, **kw)
    tier.open()
    assert tier.wait_recovered(10)
    try:
        yield tier
    finally:
        tier.close()


@contextlib.contextmanager
def mounted(fstype: str, where: Path, size: str | None = None) -> Iterator[Path]:
    """A real small file system (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root")
    where.mkdir(parents=True, exist_ok=True)
    options = ["-o", f"size={size},mode=0700"] if size else ["-o", "mode=0700"]
    proc = subprocess.run(
        ["mount", "-t", fstype, *options, fstype, str(where)], capture_output=True, text=True
    )
    if proc.returncode:
        pytest.skip(f"cannot mount {fstype}: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
