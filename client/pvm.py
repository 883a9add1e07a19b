"""The client side of the "pvm" path: KV tensors in ordinary process memory.

A CPU engine's KV cache is a plain allocation no other process can map. The
daemon can still copy it, with process_vm_readv/process_vm_writev, once it
knows the address range and trusts who registers it:

    regions, tensors = describe_tensors(kv_tensors)    # 2-D (blocks, page) CPU tensors
    resp, how = register_process_kv(client, layout, rank, regions, tensors, groups)

`register_process_kv` proves this process's identity the way the daemon
requires (see kvdepot.server.pvm): it creates a Unix socketpair, which the
kernel stamps with this process's credentials, and sends one end over the
daemon's fd socket; the fd_token it gets back goes into `ProcessMemory`.

Ptrace access: the daemon needs the same uid or CAP_SYS_PTRACE. Under Yama
`ptrace_scope=1` only a process's ancestors may read it, so this process names
the daemon with prctl(PR_SET_PTRACER, daemon pid). The daemon's pid comes from
SO_PEERCRED on the fd socket connection, which gives it in *this* process's pid
namespace (the pid the kernel compares); if the daemon's process is not visible
from here (pid 0) the only way left is PR_SET_PTRACER_ANY, which lets any
process of the same uid read this one: it is used only under scope 1, and said
in the log. Under scope 2 the daemon needs CAP_SYS_PTRACE; scope 3 forbids the
path. The daemon probes the access at registration and refuses it with
PERMISSION_DENIED naming what to change; the connector then moves pages inline.

Ownership: the memory must stay mapped while registered; unregister (or end the
session) before freeing it. A LOAD writes into it from the daemon's threads.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdepot.client.fdpass import FdPassError, encode, read_message, refusal_error
from kvdepot.common.libc import libc
from kvdepot.common.ptrace import ptrace_scope
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    import torch

    from kvdepot.client.depot_client import DepotClient

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def unusable_reason() -> str | None:
    """Why this host can never use the pvm path, or None when it may."""
    if not hasattr(os, "pidfd_open"):
        return "this Python has no os.pidfd_open (Linux >= 5.3 is needed)"
    if ptrace_scope() == 3:
        return (
            "Yama ptrace_scope is 3 (/proc/sys/kernel/yama/ptrace_scope): no process may "
            "read another's memory; set it to 0 or 1, or allocate the KV cache in shared "
            "memory (kvdepot.client.SharedKVBuffer)"
        )
    return None


def allow_ptracer(daemon_pid: int) -> str:
    """Under Yama ptrace_scope=1, lets the daemon read this process; returns what
    was done, for the log ("" when nothing was needed)."""
    if ptrace_scope() != 1:
        return ""
    target = daemon_pid if daemon_pid > 0 else PR_SET_PTRACER_ANY
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(target), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        return f"prctl(PR_SET_PTRACER) failed: {os.strerror(err)}"
    if daemon_pid > 0:
        return f"Yama ptrace_scope=1: allowed the daemon (pid {daemon_pid}) to read this process"
    return (
        "Yama ptrace_scope=1 and the daemon's pid is not visible from here: allowed ANY "
        "process of this uid to read this process (PR_SET_PTRACER_ANY)"
    )


def use_huge_pages(regions: Sequence[tuple[int, int]]) -> str:
    """Backs these ranges of our anonymous memory with transparent huge pages.

    The daemon's process_vm_readv/writev pins our pages for every copy; with 2 MiB
    pages that costs a fraction of what 4 KiB pages do (about twice the copy
    speed). MADV_HUGEPAGE makes later faults huge; MADV_COLLAPSE (Linux >= 6.1)
    rebuilds what is mapped already, in place: the contents do not change, and
    concurrent use of the memory is safe (khugepaged does the same in the
    background). Returns a note for the log; never raises.
    """
    collapsed = failed = 0
    why = ""
    for address, size in regions:
        lo = (address + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        hi = (address + size) & ~(HUGE_PAGE - 1)
        if hi <= lo:
            continue
        libc.madvise(lo, hi - lo, MADV_HUGEPAGE)
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
        else:
            failed += hi - lo
            why = os.strerror(ctypes.get_errno())
    if failed:
        return (
            f"{failed >> 20} MiB of the KV memory stay in 4 KiB pages (MADV_COLLAPSE: {why}); "
            f"copies of it are slower"
        )
    return f"{collapsed >> 20} MiB of KV memory in transparent huge pages" if collapsed else ""


@dataclass(frozen=True)
class Identity:
    """The fd_token naming this process to the daemon, and the daemon's pid here."""

    pid_token: str
    daemon_pid: int


def send_identity(fd_socket_path: str, session_id: str, timeout: float = 5.0) -> Identity:
    """Sends one end of a fresh socketpair to the daemon's fd socket.

    The daemon reads the pair's creator (this process) from SO_PEERCRED; we read
    the daemon's pid from the same option on our connection.
    """
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(fd_socket_path)
                creds = sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                )
                daemon_pid = struct.unpack("3i", creds)[0]
                sock.sendmsg(
                    [encode({"session_id": session_id})],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", theirs.fileno()))],
                )
                reply, _ = read_message(sock)
            except OSError as exc:
                raise FdPassError(f"fd socket {fd_socket_path}: {exc}") from exc
    finally:
        mine.close()
        theirs.close()
    if "error" in reply:
        raise refusal_error(reply)
    token = reply.get("fd_token")
    if not isinstance(token, str):
        raise FdPassError(f"unexpected reply from the daemon: {reply}")
    return Identity(token, daemon_pid)


def _span(t: torch.Tensor) -> int:
    """Bytes from the first to the end of the last page of a (blocks, page) view."""
    elem = t.element_size()
    return ((t.shape[0] - 1) * t.stride(0) + t.shape[1]) * elem


def describe_tensors(
    kv_tensors: Sequence[torch.Tensor],
) -> tuple[list[tuple[int, int]], list[depot_pb2.KVTensor]]:
    """Address ranges ((address, size), overlapping tensors merged) and the
    KVTensor of each 2-D (num_blocks, page) CPU tensor within them."""
    spans = []
    for i, t in enumerate(kv_tensors):
        if t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                f"KV tensor {i} is not a contiguous-page (num_blocks, page) CPU tensor "
                f"(device {t.device}, shape {tuple(t.shape)}, strides {t.stride()})"
            )
        spans.append((t.data_ptr(), t.data_ptr() + _span(t)))
    regions: list[list[int]] = []
    for start, end in sorted(spans):
        if regions and start <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], end)
        else:
            regions.append([start, end])
    described = []
    for t, (start, _) in zip(kv_tensors, spans, strict=True):
        r = next(i for i, (lo, hi) in enumerate(regions) if lo <= start < hi)
        described.append(
            depot_pb2.KVTensor(
                region_index=r,
                region_offset=start - regions[r][0],
                num_blocks=t.shape[0],
                block_stride_bytes=t.stride(0) * t.element_size(),
                page_bytes=t.shape[1] * t.element_size(),
            )
        )
    return [(lo, hi - lo) for lo, hi in regions], described


def register_process_kv(
    client: DepotClient,
    layout: depot_pb2.NamespaceLayout,
    rank: int,
    regions: Sequence[tuple[int, int]],
    tensors: Sequence[depot_pb2.KVTensor],
    groups: Sequence[depot_pb2.GroupRefs],
    timeout: float = 30.0,
    huge_pages: bool = True,
    units: int = 1,
) -> tuple[depot_pb2.RegisterKVResponse, str]:
    """Registers this process's own memory ranges (as ranks [rank, rank + units));
    returns the response and what was done (ptrace access, huge pages) as a note for
    the log. Raises FdPassError, DepotUnavailable or grpc.RpcError (PERMISSION_DENIED
    with the fix when the daemon cannot read us). With `huge_pages` the ranges are
    first backed by transparent huge pages (see `use_huge_pages`)."""
    session_id = client.session_id
    hello = client.hello
    if hello is None or not hello.fd_socket:
        raise FdPassError("the daemon has no fd socket: it cannot verify a pvm registration")
    identities = [send_identity(hello.fd_socket, session_id, timeout) for _ in regions]
    access = allow_ptracer(identities[0].daemon_pid) if identities else ""
    pages = use_huge_pages(regions) if huge_pages else ""
    memory = [
        depot_pb2.MemoryRegion(
            pvm=depot_pb2.ProcessMemory(
                pid=os.getpid(), address=address, size=size, pid_token=ident.pid_token
            )
        )
        for (address, size), ident in zip(regions, identities, strict=True)
    ]
    # In the session the identities were sent in: their tokens are that session's.
    resp = client.register_memory(
        layout,
        rank,
        memory,
        tensors,
        groups,
        timeout=timeout,
        session_id=session_id,
        units=units,
    )
    return resp, "; ".join(n for n in (access, pages) if n)
