"""The "pvm" memory path: copies straight from and into an engine's ordinary memory.

A CPU engine's KV cache is one plain allocation (`torch.zeros(int8)`), which no
other process can map. The daemon reaches it with `process_vm_readv` (STORE:
engine -> pool) and `process_vm_writev` (LOAD: pool -> engine), one system call
per batch of up to IOV_MAX runs, with the GIL released.

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

import array
import ctypes
import errno
import functools
import logging
import os
import select
import socket
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def _pieces(
    runs: Sequence[tuple[int, int, int, int]], bases: Sequence[int], pool: int
) -> list[tuple[int, int, int]]:
    """(pool address, remote address, bytes) per run, runs over MAX_CALL_BYTES split."""
    out = [(pool + po, bases[r] + ro, n) for r, ro, po, n in runs]
    if any(n > MAX_CALL_BYTES for _, _, n in out):
        split = []
        for lo, rem, n in out:
            for off in range(0, n, MAX_CALL_BYTES):
                split.append((lo + off, rem + off, min(MAX_CALL_BYTES, n - off)))
        out = split
    return out


def copy_runs(pid: int, direction: int, pieces: Sequence[tuple[int, int, int]]) -> int:
    """Moves every piece between this process (the pool) and `pid`; returns the bytes.

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
    i, total = 0, len(pieces)
    while i < total:
        # One batch: at most IOV_MAX pieces and MAX_CALL_BYTES bytes.
        j, want = i, 0
        while j < total and j - i < IOV_MAX and want + pieces[j][2] <= MAX_CALL_BYTES:
            want += pieces[j][2]
            j += 1
        batch = pieces[i:j]
        # struct iovec is {void *base; size_t len}: two machine words per entry.
        local = array.array("Q", [x for lo, _, n in batch for x in (lo, n)])
        remote = array.array("Q", [x for _, rem, n in batch for x in (rem, n)])
        got = fn(pid, local.buffer_info()[0], len(batch), remote.buffer_info()[0], len(batch), 0)
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
        i = j
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


def split_pieces(
    pieces: Sequence[tuple[int, int, int]], parts: int
) -> list[list[tuple[int, int, int]]]:
    """`pieces` cut into up to `parts` lists of about equal bytes, in order."""
    total = sum(n for _, _, n in pieces)
    share = -(-total // max(parts, 1))
    out: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for lo, rem, n in pieces:
        while n > 0:
            if room == 0:
                out.append([])
                room = share
            take = min(n, room)
            out[-1].append((lo, rem, take))
            lo, rem, n, room = lo + take, rem + take, n - take, room - take
    return [p for p in out if p]


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
        pieces = _pieces(plan.runs, [r.address for r in procs], pool_address)
        shares = [pieces]
        if self._pool is not None and plan.nbytes >= PARALLEL_MIN_BYTES:
            shares = split_pieces(pieces, self.threads)
        return functools.partial(self._copy_shares, pid, direction, procs, shares)

    def _copy_shares(
        self,
        pid: int,
        direction: int,
        procs: Sequence[ProcessMemoryRegion],
        shares: list[list[tuple[int, int, int]]],
    ) -> None:
        """Copies the shares side by side, this thread taking the first (a copy thread)."""
        self._check_alive(procs)
        futures = [self._pool.submit(copy_runs, pid, direction, s) for s in shares[1:]]  # type: ignore[union-attr]
        failure: BaseException | None = None
        try:
            copy_runs(pid, direction, shares[0])
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
            copy_runs(pid, STORE, [(base, at, n)])
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
