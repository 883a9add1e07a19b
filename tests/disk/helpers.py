"""Real files for the disk tier's tests: page-aligned memory, blocks whose bytes
follow from their key, synchronous writes and reads, small mounted file systems
(tmpfs; ext4 on a loop device, which a test can turn read-only or freeze)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import subprocess
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvdepot.server.disk import checkpoint, files, secret
from kvdepot.server.disk.record import RecordKey
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


def record_key(directory: Path) -> RecordKey:
    """The record key a tier made in `directory` (its file read as the daemon does)."""
    return RecordKey((directory / secret.FILE_NAME).read_bytes())


def forget_records(directory: Path, keys: Collection[bytes]) -> int:
    """Rewrites the index checkpoint a clean stop left in `directory` without the
    records of `keys` (in any namespace), so that the next start knows nothing of them,
    as if they had never been written. Returns how many it left out."""
    st = (directory / files.FILE_NAME).stat()
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    path = directory / checkpoint.FILE_NAME
    items = checkpoint.decode(path.read_bytes(), identity)
    assert items is not None, "no index checkpoint of this tier file"
    kept = [item for item in items if item[1] not in keys]
    path.write_bytes(checkpoint.encode(identity, kept))
    return len(items) - len(kept)


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


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@dataclass
class LoopExt4:
    """A real ext4 on a loop device, mounted at `mnt` (see `loop_ext4`)."""

    image: Path
    mnt: Path
    options: str

    @property
    def device(self) -> str:
        """The loop device now mounted at `mnt` (e.g. loop3)."""
        return Path(_run("findmnt", "-n", "-o", "SOURCE", str(self.mnt)).stdout.strip()).name

    def trigger_error(self) -> None:
        """A real file-system error (ext4's trigger_fs_error): with errors=remount-ro,
        the file system turns read-only at once; every write then fails with EROFS."""
        knob = Path("/sys/fs/ext4") / self.device / "trigger_fs_error"
        if not knob.exists():
            pytest.skip(f"this kernel has no {knob}")
        knob.write_text("1")

    def freeze(self) -> None:
        """fsfreeze: every write blocks in the kernel until `thaw` (reads go on)."""
        proc = _run("fsfreeze", "-f", str(self.mnt))
        if proc.returncode:
            pytest.skip(f"cannot freeze ext4: {proc.stderr.strip()}")

    def thaw(self) -> None:
        _run("fsfreeze", "-u", str(self.mnt))  # EINVAL when not frozen: fine

    def mount_again(self) -> None:
        """The operator's repair: unmount (lazily: the daemon still has its file
        open), fsck, mount again (another loop device, so another st_dev)."""
        _run("umount", "-l", str(self.mnt))
        fsck = _run("e2fsck", "-f", "-y", str(self.image))
        assert fsck.returncode in (0, 1), fsck.stdout + fsck.stderr  # 1: errors fixed
        _mount(self)


def _mount(fs: LoopExt4) -> None:
    options = ",".join(filter(None, ["loop", fs.options]))
    proc = _run("mount", "-o", options, str(fs.image), str(fs.mnt))
    if proc.returncode:
        pytest.skip(f"cannot loop-mount ext4: {proc.stderr.strip()}")


@contextlib.contextmanager
def loop_ext4(where: Path, size: str = "64M", options: str = "") -> Iterator[LoopExt4]:
    """A real ext4 on a loop device (root only, mount options `options`); always
    thawed and unmounted afterwards, so no test leaves a frozen mount behind."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not shutil.which("losetup"):
        pytest.skip("a loop-mounted ext4 needs root, mkfs.ext4 and losetup")
    if not any(Path("/dev").glob("loop*")):
        pytest.skip("no loop devices on this machine")
    fs = LoopExt4(where / "ext4.img", where / "mnt", options)
    fs.mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["truncate", "-s", size, str(fs.image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(fs.image)], check=True)
    _mount(fs)
    try:
        yield fs
    finally:
        fs.thaw()
        _run("umount", "-l", str(fs.mnt))
