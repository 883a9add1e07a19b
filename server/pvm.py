"""The "pvm" memory path: copies straight from and into an engine's ordinary memory.

A CPU engine's KV cache is one plain allocation (`torch.zeros(int8)`), which no
other process can map. The daemon reaches it with `process_vm_readv` (STORE:
engine -> pool) and `process_vm_writev` (LOAD: pool -> engine), one system call
per batch of up to IOV_MAX runs, with the GIL released. The batches' iovec arrays
are built with numpy when the copy is prepared, on the event loop, so a copy
thread only makes the system calls.

    enable_pvm(state)      # at start-up: adds the "pvm" memory path

The path is off unless the operator turns it on (`--pvm`, KVDEPOT_PVM=1): the
daemon then answers pvm registrations with FAILED_PRECONDITION naming the
setting, and kvdepot's connector moves pages inline instead.

Who may be read (the security contract). The daemon usually holds more ptrace
rights than its clients (it runs as the engines' uid), so a client must never
make it copy another process's memory. A pid in a message proves nothing (it is
ignored; a mismatch is refused as a client bug); the kernel's credentials do:
- the client sends one end of a Unix socketpair it created over the fd socket
  (SCM_RIGHTS); its fd_token is `ProcessMemory.pid_token`. The fd socket names
  the *sender* of that message (SO_PEERCRED of its connection, pinned by
  SO_PEERPIDFD, kvdepot.server.peer), and the session must belong to it;
- the passed socket must be an unnamed socketpair end (no bound or peer path:
  a socket connected to a listener names the *listener*, which is how a
  process could point the daemon at another) whose own SO_PEERCRED, its
  creator, is that same sender. Copies go to the sender and no one else;
- the region holds a pidfd of the sender and its identity (start time, uids):
  every copy re-checks them before it starts (pidfd alive, same start time and
  uids in /proc), the pidfd again before every system call batch, and a STORE
  once more after the bytes moved, so a pid reused by another process is never
  read into the pool. (A LOAD could still land in a reused pid if the engine
  exited and its pid were recycled in the microseconds between that check and
  the system call; the engine's session ends with the process and its
  registration with it.)

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
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from kvdepot.common.kinds import MemoryPath
from kvdepot.common.ptrace import ptrace_scope
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.copy_engine import (
    LOAD,
    STORE,
    CopyEngine,
    MappedRegion,
    PreparedCopy,
    check_runs,
)
from kvdepot.server.memory.paths import MemoryPaths, PassedFds
from kvdepot.server.peer import Peer, PeerGone, pidfd_alive, socket_creator, start_time, uids

log = logging.getLogger("kvdepot.pvm")

IOV_MAX = 1024  # iovecs per process_vm_* call (UIO_MAXIOV)
# Bytes per call: the kernel caps one call at MAX_RW_COUNT (about 2 GiB) and
# reports a short count beyond it, which would read as a failed copy.
MAX_CALL_BYTES = 1 << 30
PROBE_BYTES = 4096
# Jobs of at least this many bytes are copied by several threads at once.
PARALLEL_MIN_BYTES = 16 << 20
PARALLEL_THREADS = min(4, os.cpu_count() or 1)
CAP_SYS_PTRACE = 19

_libc = ctypes.CDLL(None, use_errno=True)
_RW_ARGTYPES: list[type[ctypes.c_int | ctypes.c_void_p | ctypes.c_ulong]] = [
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
            f"{os.geteuid()}). Giving it CAP_SYS_PTRACE instead is not advised: it would "
            f"reach every process on the node; use shared memory rather"
        )
    scope = ptrace_scope()
    if scope == 1:
        fixes.append(
            f"Yama ptrace_scope is 1: the engine must allow the daemon with "
            f"prctl(PR_SET_PTRACER, <daemon pid {os.getpid()}>) (kvdepot's connector does "
            f"this itself)"
        )
    elif scope == 2:
        fixes.append(
            "Yama ptrace_scope is 2: only CAP_SYS_PTRACE would do, which is not advised; "
            "use shared memory (kvdepot.client.SharedKVBuffer)"
        )
    elif scope == 3:
        fixes.append(
            "Yama ptrace_scope is 3: no process may read another's memory; use shared "
            "memory (kvdepot.client.SharedKVBuffer) instead"
        )
    fixes.append(
        "a process that made itself non-dumpable (prctl PR_SET_DUMPABLE 0, setuid "
        "binaries) cannot be read: use shared memory for it"
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


def copy_batches(
    pid: int, direction: int, batches: Sequence[Batch], pidfd: int | None = None
) -> int:
    """Moves every batch between this process (the pool) and `pid`; returns the bytes.

    STORE reads the remote ranges into the pool (process_vm_readv); LOAD writes
    the pool into them (process_vm_writev). Raises ProcessGone when the kernel
    moves fewer bytes than asked (the process exited or unmapped the memory),
    or, with `pidfd`, when that process has exited before a batch (its pid may
    name another process now), and PermissionError when the access was refused.
    """
    if direction == STORE:
        fn, name = _readv, "process_vm_readv"
    elif direction == LOAD:
        fn, name = _writev, "process_vm_writev"
    else:
        raise ValueError(f"unknown direction {direction}")
    done = 0
    for local, remote, count, want in batches:
        if pidfd is not None and not pidfd_alive(pidfd):
            raise ProcessGone(f"process {pid} exited: its registration is void")
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

    def __init__(
        self,
        pid: int,
        pidfd: int,
        address: int,
        size: int,
        started: int | None = None,
        uid_set: tuple[int, ...] | None = None,
    ) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self.address = address
        self.size = size
        # The identity checked before every copy (None: pidfd only, tests).
        self.started = started
        self.uid_set = uid_set

    @property
    def pidfd(self) -> int:
        return self._pidfd

    def alive(self) -> bool:
        """False once the process has exited (its pidfd polls readable)."""
        fd = self._pidfd
        if fd < 0:
            return False
        return pidfd_alive(fd)

    def identity_holds(self) -> bool:
        """The registered process still runs, as the same program's owner: pidfd
        alive, same start time and same (real, effective, saved, fs) uids. Read
        before the pidfd check, so the /proc files read were that process's."""
        try:
            same = (self.started is None or start_time(self.pid) == self.started) and (
                self.uid_set is None or uids(self.pid) == self.uid_set
            )
        except (OSError, ValueError, IndexError, PeerGone):
            return False
        return same and self.alive()

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
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> PreparedCopy:
        procs = [r for r in regions if isinstance(r, ProcessMemoryRegion)]
        if len(procs) != len(regions) or not procs:
            raise ValueError("the pvm engine copies only process-memory regions")
        pid = procs[0].pid
        if any(r.pid != pid for r in procs):
            raise ValueError("one registration's regions belong to one process")
        if direction not in (STORE, LOAD):
            raise ValueError(f"unknown direction {direction}")
        check_runs(procs, plan, pool_size)
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
        self._check_identity(procs)
        if not shares:
            return
        pidfd = procs[0].pidfd
        futures = [
            # shares beyond the first come only with a copy pool (`parts` is 1 without)
            self._pool.submit(copy_batches, pid, direction, s, pidfd)  # type: ignore[union-attr]
            for s in shares[1:]
        ]
        failure: BaseException | None = None
        try:
            copy_batches(pid, direction, shares[0], pidfd)
        except (ProcessGone, PermissionError) as exc:
            failure = exc
        for f in futures:  # wait for every share, failed or not
            failure = failure or f.exception()
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

    @staticmethod
    def _check_identity(procs: Sequence[ProcessMemoryRegion]) -> None:
        """Before a copy: the process is the one that registered (see identity_holds)."""
        for r in procs:
            if not r.identity_holds():
                raise errors.precondition(
                    f"process {r.pid} has exited or changed its identity (start time, "
                    f"uids): its registration is void"
                )


# -- registration ------------------------------------------------------------------------


def _pidfd_pids(pidfd: int) -> list[int]:
    """The NSpid line of a pidfd: its pid in the daemon's namespace first, the
    process's own view last ([-1] once it exited)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    line = fields.get("NSpid") or fields.get("Pid") or "-1"
    return [int(x) for x in line.split()]


def check_creator(sock_fd: int, sender: Peer) -> None:
    """Refuses (DepotError) unless `sock_fd` is an end of an unnamed Unix socketpair
    that `sender` (the process that passed it over the fd socket) created itself."""
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
        creator = socket_creator(sock)
    if creator is None:
        raise errors.denied(
            "pid_token names a socket with an address (bound, or connected to a listener): "
            "only an unnamed socketpair the registering process made proves who it is"
        )
    if creator[0] != sender.pid or creator[1] != sender.uid:
        raise errors.denied(
            f"the pid_token socketpair was made by pid {creator[0]}, not by {sender}, "
            f"which sent it: a process may register only its own memory"
        )


def sender_pidfd(sender: Peer) -> tuple[int, tuple[int, ...]]:
    """A pidfd of `sender` and its uids, verified to be that very process (same
    start time, read while the pidfd pins it). Raises DepotError."""
    if not sender.visible:
        raise errors.precondition(
            f"the pvm path copies only from processes the daemon can see, and {sender} is "
            f"not one (another pid namespace, or /proc hidden): use the shm path"
        )
    try:
        pidfd = os.pidfd_open(sender.pid)
    except OSError as exc:
        raise errors.precondition(
            f"cannot open a pidfd of process {sender.pid} ({exc.strerror}): the pvm path "
            f"needs Linux >= 5.3 and a live process"
        ) from None
    try:
        same = start_time(sender.pid) == sender.start_time
        uid_set = uids(sender.pid)
        if not (same and pidfd_alive(pidfd)):
            raise PeerGone(f"process {sender.pid} exited during registration")
    except (OSError, ValueError, IndexError, PeerGone) as exc:
        os.close(pidfd)
        raise errors.precondition(f"{exc}: register again") from None
    return pidfd, uid_set


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


class ProcessMemoryHandle(Protocol):
    """RegisterKV's ProcessMemory handle (depot.proto)."""

    pid_token: str
    pid: int
    address: int
    size: int


class PvmHost(MemoryPaths, PassedFds, Protocol):
    """What the pvm path needs of the state (DepotState): a place to plug in, and
    the fd socket's fds."""


class ProcessMemoryPath:
    """The "pvm" memory path (see `enable_pvm`): each region verifies who registers,
    probes the access, and is copied by the shared engine."""

    kind = MemoryPath.PVM

    def __init__(self, fds: PassedFds) -> None:
        self.fds = fds

    def open(self, handle: ProcessMemoryHandle, session_id: str) -> tuple[MappedRegion, CopyEngine]:
        if not self.fds.takes_fds():
            raise errors.precondition("this daemon takes no fds (no fd socket): pvm is off")
        if handle.size <= 0:
            raise errors.invalid("a pvm region needs a positive size")
        if not 0 < handle.address < 1 << 64 or handle.address + handle.size > 1 << 64:
            raise errors.invalid(f"address range [{handle.address:#x}, +{handle.size}) is invalid")
        passed = self.fds.claim_passed(handle.pid_token, session_id)
        sender: Peer = passed.peer  # who sent the socket: the kernel's word
        try:
            try:
                check_creator(passed.fd, sender)
            except errors.DepotError as exc:
                if exc.code is errors.Code.PERMISSION_DENIED:
                    raise self.fds.deny(exc.message) from None
                raise
        finally:
            os.close(passed.fd)
        pidfd, uid_set = sender_pidfd(sender)
        try:
            own = _pidfd_pids(pidfd)[-1]  # the sender's own view of its pid
            if handle.pid and handle.pid != own:
                # The message's pid never chooses what is copied; a wrong one is a client
                # bug (or a lie), and is said so.
                raise self.fds.deny(
                    f"ProcessMemory.pid {handle.pid} is not the process that made and sent the "
                    f"pid_token socketpair (pid {own}): a process may register only its own memory"
                )
            probe(sender.pid, handle.address, handle.size, sender.uid)
        except BaseException:
            os.close(pidfd)
            raise
        region = ProcessMemoryRegion(
            sender.pid, pidfd, handle.address, handle.size, sender.start_time, uid_set
        )
        return region, _ENGINE


_ENGINE = PvmCopyEngine()


class PvmOff:
    """The pvm path of a daemon started without --pvm: refuses, saying how to turn it on."""

    kind = MemoryPath.PVM

    def open(self, handle: object, session_id: str) -> tuple[MappedRegion, CopyEngine]:
        raise errors.precondition(
            "the pvm memory path is off in this daemon: the operator enables it with --pvm "
            "(KVDEPOT_PVM=1); until then use shared memory (kvdepot.client.SharedKVBuffer) or "
            "inline Put/Get (kvdepot's connector falls back by itself)"
        )


def enable_pvm(state: PvmHost, on: bool = True) -> None:
    """Adds the "pvm" memory path to `state` (DepotState.add_memory_path) and logs
    what the host allows, or (`on` False, no --pvm) a path that refuses with how to
    turn it on. Registration-time probes decide per engine."""
    if not on:
        state.add_memory_path(PvmOff())
        log.info("pvm path off (--pvm, KVDEPOT_PVM=1 turns it on)")
        return
    state.add_memory_path(ProcessMemoryPath(state))
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
