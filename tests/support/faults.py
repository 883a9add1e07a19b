"""Helpers shared by the fault, fuzz and soak tests: reading a live daemon from the
outside (/proc and the Admin service)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import admin_pb2_grpc
from tests.support.daemon import DaemonProcess, stats

REPO = Path(__file__).resolve().parents[2]
SOAK = REPO / "tests" / "support" / "soak.py"
DaemonFactory = Callable[..., DaemonProcess]  # the daemon_factory fixture (tests/conftest.py)

# Every status a kvdepot call may end with (docs/architecture.md §8.2); UNKNOWN and INTERNAL never.
DOCUMENTED_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
DOCUMENTED_CODE_NAMES = frozenset(c.name for c in DOCUMENTED_CODES)


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points at (socket:[..], /memfd:..., anon_inode:...)."""
    out = []
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        with contextlib.suppress(FileNotFoundError):  # closed while we looked
            out.append(os.readlink(f"{fd_dir}/{name}"))
    return out


def memfd_mappings(pid: int, name: str) -> int:
    """Mappings of memfds called `name` in `pid` (one per mapped region)."""
    needle = f"/memfd:{name}"
    with open(f"/proc/{pid}/maps") as f:
        return sum(needle in line for line in f)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    """The resident set of `pid` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def rss_mib(pid: int) -> float:
    return rss_bytes(pid) / (1 << 20)


def admin(channel: grpc.Channel) -> admin_pb2_grpc.AdminStub:
    """An Admin stub on `channel`: a DaemonProcess's admin_channel() (the operator socket)."""
    return admin_pb2_grpc.AdminStub(channel)


def all_blocks(stub: admin_pb2_grpc.AdminStub, namespace_id: str = "") -> list[apb.BlockInfo]:
    blocks: list[apb.BlockInfo] = []
    token = ""
    while True:
        resp = stub.ListBlocks(
            apb.ListBlocksRequest(namespace_id=namespace_id, page_size=10000, page_token=token),
            timeout=5,
        )
        blocks.extend(resp.blocks)
        token = resp.next_page_token
        if not token:
            return blocks


def assert_pool_accounting(stub: admin_pb2_grpc.AdminStub) -> apb.GetStatsResponse:
    """Quiescent daemon: nothing being written, used bytes are exactly the ready blocks."""
    s = stats(stub)
    blocks = all_blocks(stub)
    assert all(b.state == "ready" for b in blocks), [b.state for b in blocks]
    assert s.writing_blocks == 0
    assert s.used_bytes == sum(b.bytes for b in blocks), (s.used_bytes, len(blocks))
    assert s.ready_blocks == len(blocks)
    return s


def soak_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SOAK), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
