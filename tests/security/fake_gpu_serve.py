"""`kvdepot serve` on a fake GPU host, for the CUDA IPC sender tests.

    KVDEPOT_TEST_GPU_HOST=DIR python tests/security/fake_gpu_serve.py serve ARGS

The daemon runs on the fake CUDA driver (tests/support/fake_cuda.py: "device memory"
is host memory) with two GPUs, minors 0 and 1. Each holds one allocation of
ALLOC_BYTES, exported under `handle_of(minor)` and filled with `contents(minor)`,
so a client in another process can register it and check the bytes it stores. The
sender check reads the fake driver tree and device nodes under DIR (a
tests.support.fake_cuda.FakeGpuHost the test made); the senders' open files are
read from the real /proc, so the senders are real processes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.common.cuda_driver import DeviceInfo
from kvdepot.common.cuda_handles import parse_uuid
from tests.support.fake_cuda import PCI0, UUID0, UUID1

HOST_ENV = "KVDEPOT_TEST_GPU_HOST"
PCI1 = "0000:9A:00.0"
GPUS = ((0, UUID0, PCI0), (1, UUID1, PCI1))  # (minor, UUID, PCI address)
ALLOC_BYTES = 16 * 4096


def handle_of(minor: int) -> bytes:
    """The 64-byte IPC handle of GPU `minor`'s allocation."""
    return hashlib.sha256(b"fake-gpu-%d" % minor).digest() * 2


def contents(minor: int) -> bytes:
    """The bytes GPU `minor`'s allocation holds (distinct per 32-byte piece and GPU)."""
    return b"".join(
        hashlib.sha256(b"%d:%d" % (minor, i)).digest() for i in range(ALLOC_BYTES // 32)
    )


def main() -> int:
    from kvdepot.server import daemon
    from kvdepot.server.cli import main as cli_main
    from tests.support.fake_cuda import FakeDriver, FakeGpuHost

    root = Path(os.environ[HOST_ENV])
    drv = FakeDriver([DeviceInfo(m, parse_uuid(u), f"Fake H200 {m}", p) for m, u, p in GPUS])
    for minor, _, _ in GPUS:
        buf = (ctypes.c_char * ALLOC_BYTES).from_buffer_copy(contents(minor))
        drv.exports[handle_of(minor)] = buf
    senders = FakeGpuHost(root).senders
    daemon.enable_cuda = functools.partial(daemon.enable_cuda, driver=drv, senders=senders)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
