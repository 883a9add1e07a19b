"""The "pvm" memory path: copies straight from and into an engine's ordinary memory.

A CPU engine's KV cache is one plain allocation (`torch.zeros(int8)`), which no
other process can map. The daemon reaches it with `process_vm_readv` (STORE:
engine -> pool) and `process_vm_writev` (LOAD: pool -> engine), one system call
per batch of up to IOV_MAX runs, with the GIL released. The batches' iovec arrays
are built with numpy when the copy is prepared, on the event loop, so a copy
thread only makes the system calls.

    enable_pvm(state)      # at start-up: adds the "pvm" memory path

Who may be read (the security contract). The daemon usually holds more ptrace
rights than its clients (it runs as the engines' uid, or with CAP_SYS_PTRACE),
so a client must never make it copy another process's memory. A pid in a
message proves nothing; the kernel's credentials do:
- the client creates a Unix socketpair and sends one end over the fd socket
  (SCM_RIGHTS); its fd_token is `ProcessMemory.pid_token`. The kernel stamps a
  socketpair with its creator's credentials, so SO_PEERCRED on the received end
  names the process that made it, in the daemon's own pid namespace;
- the daemon takes a pidfd of exactly that process (SO_PEERPIDFD, else
  pidfd_open) and refuses the registration unless the process's own view of its
  pid (the last NSpid entry) equals both `ProcessMemory.pid` and the session's
  pid. Copies go to the pid the kernel named, never to one from the message;
- the pidfd pins the process's identity: every copy checks that the process is
  still alive before it starts, and a STORE checks again after the bytes moved,
  so a pid reused by another process is never read into the pool. (A LOAD could
  still land in a reused pid if the engine exited and its pid were recycled in
  the microseconds between that check and the system call; the engine's session
  ends with the process and its registration with it.)

Access is probed at registration (a small read of the first and last page of
the range): a refusal answers PERMISSION_DENIED naming what to change (same uid
or CAP_SYS_PTRACE, Yama's ptrace_scope, Kubernetes' shareProcessNamespace). A
copy that comes up short (the engine exited, or unmapped the memory) raises, so
the job fails and no block is marked ready; the daemon itself never faults,
because the kernel checks every address for it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import logging
import os
import select
import socket
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvdepot.client.pvm import ptrace_scope
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.copy_engine import LOAD, STORE, CopyEngine, MappedRegion, PreparedCopy

log = logging.getLogger("kvdepot.pvm")

IOV_MAX = 1024  # iovecs per process_vm_* call (UIO_MAXIOV)
# Bytes per call: the kernel caps one call at MAX_RW_COUNT (about 2 GiB) and
# reports a short count beyond it, which would read as a failed copy.
MAX_CALL_BYTES = 1 << 30
PROBE_BYTES = 4096
# Jobs of at least this many bytes are copied by several threads at once.
PARALLEL_MIN_BYTES = 16 << 20
PARALLEL_THREADS = min(4, os.cpu_count() or 1)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
CAP_SYS_PTRACE = 19

_libc = ctypes.CDLL(None, use_errno=True)
_RW_ARGTYPES = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_readv = _libc.process_vm_readv
_writev = _libc.process_vm_writev
for _fn in (_readv, _writev):
    _fn.argtypes = _RW_ARGTYPES
    _fn.restype = ctypes.c_ssize_t


class ProcessGone(Exception):
    """The registered process exited, or its memory cannot be copied any more."""


def has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def access_advice(target_uid: int | None) -> str:
    """What to change so that this daemon may read and write another process's memory."""
    fixes = []
    if target_uid is not None and target_uid != os.geteuid() and not has_cap_sys_ptrace():
        fixes.append(
            f"run the daemon as the engine's uid ({target_uid}; the daemon is uid "
            f"{os.geteuid()}) or give it CAP_SYS_PTRACE"
        )
    scope = ptrace_scope()
    if scope == 1:
        fixes.append(
            f"Yama ptrace_scope is 1: the engine must allow the daemon with "
            f"prctl(PR_SET_PTRACER, <daemon pid {os.getpid()}>) (kvdepot's connector does "
            f"this itself), or give the daemon CAP_SYS_PTRACE"
        )
    elif scope == 2:
        fixes.append("Yama ptrace_scope is 2: the daemon needs CAP_SYS_PTRACE")
    elif scope == 3:
        fixes.append(
            "Yama ptrace_scope is 3: no process may read another's memory; use shared "
            "memory (kvdepot.client.SharedKVBuffer) instead"
        )
    fixes.append(
        "a process that made itself non-dumpable (prctl PR_SET_DUMPABLE 0, setuid "
        "binaries) can be read only with CAP_SYS_PTRACE"
    )
    fixes.append(
        "in Kubernetes the daemon must see the engine's processes "
        "(shareProcessNamespace: true in the pod, or hostPID for a node daemon)"
    )
    return "; ".join(fixes)


# -- the copies ---------------------------------------------------------------------------


# One process_vm_* call: the local and the remote iovec arrays ((count, 2) uint64:
# struct iovec is {void *base; size_t len}), the iovec count, and the bytes it moves.
Batch = tuple[np.ndarray, np.ndarray, int, int]


def plan_batches(
    local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, parts: int = 1
) -> list[list[Batch]]:
    """The runs (int64 columns: local address, remote address, bytes) as `parts`
    shares of about equal bytes, each a list of system-call batches in run order.

    A run longer than a share (or than MAX_CALL_BYTES) is cut, so a job of one
    large run still spreads over the shares; shares then end at run boundaries.
    A batch holds at most IOV_MAX runs and MAX_CALL_BYTES bytes. Pure numpy: it
    runs on the event loop (CopyEngine.prepare), not on a copy thread.
    """
    total = int(nbytes.sum())
    cap = min(MAX_CALL_BYTES, max(1, -(-total // max(parts, 1))))
    pieces = -(-nbytes // cap)
    if (pieces > 1).any():  # cut long runs into pieces of at most `cap` bytes
        run = np.repeat(np.arange(len(nbytes)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        off = (np.arange(len(run)) - first) * cap
        local, remote = local[run] + off, remote[run] + off
        nbytes = np.minimum(nbytes[run] - off, cap)
    keep = nbytes > 0
    if not keep.all():
        local, remote, nbytes = local[keep], remote[keep], nbytes[keep]
    ends = np.cumsum(nbytes)  # bytes up to and including each run
    cuts = np.searchsorted(ends, [total * k // parts for k in range(1, parts)], side="left") + 1
    bounds = [0, *sorted(set(min(int(c), len(ends)) for c in cuts)), len(ends)]
    shares: list[list[Batch]] = []
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            shares.append(_batches(local[lo:hi], remote[lo:hi], nbytes[lo:hi]))
    return shares


def _batches(local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray) -> list[Batch]:
    """One share's runs (each at most MAX_CALL_BYTES) cut into system-call batches."""
    ends = np.cumsum(nbytes)
    out: list[Batch] = []
    i, count = 0, len(nbytes)
    while i < count:
        before = int(ends[i - 1]) if i else 0
        fit = int(np.searchsorted(ends, before + MAX_CALL_BYTES, side="right"))
        j = max(i + 1, min(i + IOV_MAX, fit))
        out.append(
            (
                _iovecs(local[i:j], nbytes[i:j]),
                _iovecs(remote[i:j], nbytes[i:j]),
                j - i,
                int(ends[j - 1]) - before,
            )
        )
        i = j
    return out


def _iovecs(base: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    iov = np.empty((len(base), 2), dtype=np.uint64)
    iov[:, 0] = base
    iov[:, 1] = nbytes
    return iov


def copy_batches(pid: int, direction: int, batches: Sequence[Batch]) -> int:
    """Moves every batch between this process (the pool) and `pid`; returns the bytes.

    STORE reads the remote ranges into the pool (process_vm_readv); LOAD writes
    the pool into them (process_vm_writev). Raises ProcessGone when the kernel
    moves fewer bytes than asked (the process exited or unmapped the memory)
    and PermissionError when the access was refused.
    """
    if direction == STORE:
        fn, name = _readv, "process_vm_readv"
    elif direction == LOAD:
        fn, name = _writev, "process_vm_writev"
    else:
        raise ValueError(f"unknown direction {direction}")
    done = 0
    for local, remote, count, want in batches:
        got = fn(pid, local.ctypes.data, count, remote.ctypes.data, count, 0)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EPERM:
                raise PermissionError(f"{name} on pid {pid}: permission denied")
            raise ProcessGone(
                f"{name} on pid {pid} failed: {errno.errorcode.get(err, err)} "
                f"({os.strerror(err)}): the engine exited, or unmapped its KV memory"
            )
        if got != want:
            raise ProcessGone(
                f"{name} on pid {pid} moved {got} of {want} bytes: the engine exited, or "
                f"unmapped part of its KV memory"
            )
        done += got
    return done


class ProcessMemoryRegion(MappedRegion):
    """A range of another process's memory, named by a pidfd the kernel vouched for."""

    kind = MemoryPath.PVM

    def __init__(self, pid: int, pidfd: int, address: int, size: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.address = address
        self.size = size

    def alive(self) -> bool:
        """False once the process has exited (its pidfd polls readable)."""
        fd = self._pidfd
        if fd < 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)


class PvmCopyEngine(CopyEngine):
    """Executes plans with process_vm_readv/writev, IOV_MAX runs per system call.

    A large job is cut into `threads` shares copied side by side: the kernel pins
    and copies the engine's pages one at a time, so one thread moves a fraction
    of what memmove does (the shared-memory path), and the copy scales with
    threads. The calling copy thread takes one share; it returns only when every
    share has finished, so no copy outlives the job.
    """

    def __init__(self, threads: int = PARALLEL_THREADS) -> None:
        self.threads = max(1, threads)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvdepot-pvm")
            if self.threads > 1
            else None
        )

    def prepare(
        self, direction: int, regions: Sequence[MappedRegion], pool_address: int, plan: CopyPlan
    ) -> PreparedCopy:
        procs = [r for r in regions if isinstance(r, ProcessMemoryRegion)]
        if len(procs) != len(regions) or not procs:
            raise ValueError("the pvm engine copies only process-memory regions")
        pid = procs[0].pid
        if any(r.pid != pid for r in procs):
            raise ValueError("one registration's regions belong to one process")
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        mem, pool, sizes = plan.addresses([r.address for r in procs], pool_address)
        parts = self.threads if self._pool is not None and plan.nbytes >= PARALLEL_MIN_BYTES else 1
        shares = plan_batches(pool, mem, sizes, parts)
        return functools.partial(self._copy_shares, pid, direction, procs, shares)

    def _copy_shares(
        self,
        pid: int,
        direction: int,
        procs: Sequence[ProcessMemoryRegion],
        shares: list[list[Batch]],
    ) -> None:
        """Copies the shares side by side, this thread taking the first (a copy thread)."""
        self._check_alive(procs)
        if not shares:
            return
        futures = [self._pool.submit(copy_batches, pid, direction, s) for s in shares[1:]]  # type: ignore[union-attr]
        failure: BaseException | None = None
        try:
            copy_batches(pid, direction, shares[0])
        except (ProcessGone, PermissionError) as exc:
            failure = exc
        for f in futures:  # wait for every share, failed or not
            exc = f.exception()
            failure = failure or exc
        if failure is not None:
            if isinstance(failure, ProcessGone | PermissionError):
                raise errors.precondition(f"{failure}; register again") from None
            raise failure
        if direction == STORE:
            # Alive after the read: the pid named this process throughout, so the
            # bytes are the engine's and not those of a process that reused its pid.
            self._check_alive(procs)

    @staticmethod
    def _check_alive(procs: Sequence[ProcessMemoryRegion]) -> None:
        for r in procs:
            if not r.alive():
                raise errors.precondition(f"process {r.pid} has exited: its registration is void")


# -- registration ------------------------------------------------------------------------


def _pidfd_pids(pidfd: int) -> list[int]:
    """The NSpid line of a pidfd: its pid in the daemon's namespace first, the
    process's own view last ([-1] once it exited)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    line = fields.get("NSpid") or fields.get("Pid") or "-1"
    return [int(x) for x in line.split()]


def creator_of(sock_fd: int) -> tuple[int, int, int]:
    """(pid in this namespace, uid, pidfd) of the process that created the
    socketpair whose end `sock_fd` is. Raises DepotError when it is not one."""
    not_a_pair = errors.invalid(
        "pid_token must name one end of a Unix socketpair made by the registering "
        "process (see kvdepot.client.pvm)"
    )
    dup = os.dup(sock_fd)
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket (ENOTSOCK): a memfd, a file, ...
        os.close(dup)
        raise not_a_pair from None
    with sock:
        if sock.family != socket.AF_UNIX:
            raise not_a_pair
        pid, uid, _gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        if pid <= 0:
            raise errors.precondition(
                "the registering process is not visible in the daemon's pid namespace: run "
                "the daemon where it sees the engines (Kubernetes: shareProcessNamespace: "
                "true, or hostPID for a node daemon)"
            )
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:  # Linux < 6.5: a pidfd by number (see the module docstring)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError as exc:
                raise errors.precondition(
                    f"cannot open a pidfd of process {pid} ({exc.strerror}): the pvm path "
                    f"needs Linux >= 5.3 and a live process"
                ) from None
    return pid, uid, pidfd


def probe(pid: int, address: int, size: int, uid: int | None) -> None:
    """Reads the first and last bytes of the range; raises DepotError with the fix."""
    n = min(PROBE_BYTES, size)
    buf = ctypes.create_string_buffer(n)
    base = ctypes.addressof(buf)
    for at in sorted({address, address + size - n}):
        try:
            one = np.array([base]), np.array([at]), np.array([n])
            copy_batches(pid, STORE, plan_batches(*one)[0])
        except PermissionError:
            raise errors.denied(
                f"the daemon may not read process {pid}'s memory (process_vm_readv: EPERM). "
                f"Fix one of: {access_advice(uid)}. Until then the engine moves pages "
                f"inline (slow)"
            ) from None
        except ProcessGone as exc:
            raise errors.invalid(
                f"cannot read [{address:#x}, {address + size:#x}) in process {pid}: {exc}"
            ) from None


def open_region(state: Any, handle: Any, session: Any) -> tuple[MappedRegion, CopyEngine]:
    """The "pvm" region opener (see `enable_pvm`): verifies who registers, probes
    the access, and returns the region with the shared engine."""
    if state.fd_receiver is None:
        raise errors.precondition("this daemon takes no fds (no fd socket): pvm is off")
    if handle.size <= 0:
        raise errors.invalid("a pvm region needs a positive size")
    if not 0 < handle.address < 1 << 64 or handle.address + handle.size > 1 << 64:
        raise errors.invalid(f"address range [{handle.address:#x}, +{handle.size}) is invalid")
    try:
        sock_fd = state.fd_receiver.claim(handle.pid_token, session.id)
    except KeyError as exc:
        raise errors.invalid(exc.args[0]) from None
    try:
        pid, uid, pidfd = creator_of(sock_fd)
    finally:
        os.close(sock_fd)
    try:
        pids = _pidfd_pids(pidfd)
        if pids[0] != pid:
            raise errors.precondition(f"process {pid} exited during registration")
        own = pids[-1]
        if own != handle.pid or own != session.pid:
            raise errors.denied(
                f"ProcessMemory.pid {handle.pid} (session pid {session.pid}) is not the "
                f"process that made the pid_token socketpair (pid {own}): a process may "
                f"register only its own memory"
            )
        probe(pid, handle.address, handle.size, uid)
    except BaseException:
        os.close(pidfd)
        raise
    return ProcessMemoryRegion(pid, pidfd, handle.address, handle.size), _ENGINE


_ENGINE = PvmCopyEngine()


def enable_pvm(state: Any) -> None:
    """Adds the "pvm" memory path to `state` (DepotState.add_memory_path) and logs
    what the host allows. Registration-time probes decide per engine."""
    state.add_memory_path(
        MemoryPath.PVM, lambda handle, session: open_region(state, handle, session)
    )
    scope = ptrace_scope()
    cap = has_cap_sys_ptrace()
    if scope == 3:
        log.warning(
            "pvm path: Yama ptrace_scope is 3, so no engine's memory can be read; "
            "engines without shared memory will move pages inline"
        )
    elif scope == 2 and not cap:
        log.warning(
            "pvm path: Yama ptrace_scope is 2 and the daemon lacks CAP_SYS_PTRACE; "
            "engines without shared memory will move pages inline"
        )
    else:
        log.info(
            "pvm path on: engines in plain memory are copied with process_vm_readv/writev "
            "(uid %d%s%s)",
            os.geteuid(),
            ", CAP_SYS_PTRACE" if cap else "",
            f", Yama ptrace_scope {scope}" if scope is not None else "",
        )
