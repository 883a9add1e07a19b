"""Kernel identities of client processes: who is at the other end of a Unix socket.

A pid in a message proves nothing; the kernel's credentials do. `Peer` is what the
kernel says about a process (SO_PEERCRED: pid, uid, gid) plus its start time
(/proc/PID/stat field 22), so that a pid reused by another process never passes
for the first: (pid, start time) names one process for the life of the machine.

    peer = peer_of(conn)            # the process that connect()ed `conn`
    creator = socket_creator(fd)    # SO_PEERCRED of a passed socket; None if named
    peer.same_process(other)        # same pid and start time

Where the kernel has SO_PEERPIDFD (Linux >= 6.5) the start time is read while a
pidfd pins the process, so it is the connecting process's own even if it exited
meanwhile; older kernels fall back to pidfd_open(pid), which a pid recycled in the
microseconds between connect() and accept() could fool (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
from collections.abc import Hashable
from dataclasses import dataclass

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
_CRED = struct.Struct("3i")
TAG_CHARS = 8


def session_tag(session_id: str) -> str:
    """The part of a session id that logs and listings show (the id is a secret)."""
    return session_id[:TAG_CHARS]


class PeerGone(Exception):
    """The process exited (or is invisible here) before its identity could be read."""


@dataclass(frozen=True)
class Peer:
    """A process as the kernel names it, in the daemon's pid namespace."""

    pid: int
    uid: int
    gid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)

    @property
    def visible(self) -> bool:
        """Whether the daemon can tell this process from others: False in a sidecar
        without a shared process namespace (the kernel reports pid 0) or where
        /proc hides other users' processes (ProtectProc=invisible, hidepid)."""
        return self.pid > 0 and self.start_time > 0

    def same_process(self, other: Peer) -> bool:
        if self.visible and other.visible:
            return self.pid == other.pid and self.start_time == other.start_time
        # Processes the daemon cannot see apart: the kernel vouches for uid and gid.
        return (self.pid, self.uid, self.gid) == (other.pid, other.uid, other.gid)

    def __str__(self) -> str:
        if self.pid <= 0:
            return f"a process of uid {self.uid} outside the daemon's pid namespace"
        return f"pid {self.pid} (uid {self.uid})"


UNATTESTED = "unattested"  # the account of every session no one is known to own yet


def peer_key(peer: Peer | None) -> Hashable:
    """One process the kernel names (pid and start time), else its uid and gid
    (processes the daemon cannot see apart), else everyone not attested yet: whose
    shares and log lines are counted together."""
    if peer is None:
        return UNATTESTED
    if peer.visible:
        return ("pid", peer.pid, peer.start_time)
    return ("uid", peer.uid, peer.gid)


def start_time(pid: int) -> int:
    """Field 22 of /proc/PID/stat (the command name, field 2, may hold spaces and
    parentheses: the fields after it are counted from its last ')')."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2 :].split()[19])


def uids(pid: int) -> tuple[int, ...]:
    """(real, effective, saved, filesystem) uid of `pid`, from /proc/PID/status."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                return tuple(int(x) for x in line.split()[1:])
    raise PeerGone(f"process {pid} has no Uid line")


def pidfd_alive(pidfd: int) -> bool:
    """False once the process behind `pidfd` has exited (the pidfd polls readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


def open_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the process at the other end of `sock` (SO_PEERPIDFD where the
    kernel has it, else pidfd_open(pid)). Raises PeerGone."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        pass
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        raise PeerGone(f"process {pid} is gone ({exc.strerror})") from None


def identity(pidfd: int, pid: int, uid: int, gid: int) -> Peer:
    """The Peer of the live process behind `pidfd` (whose pid is `pid` here): its
    start time is read, then the pidfd is checked alive, so the time read is that
    process's and not a successor's. Raises PeerGone."""
    try:
        started = start_time(pid)
    except (OSError, ValueError, IndexError) as exc:
        raise PeerGone(f"process {pid} is gone ({exc})") from None
    if not pidfd_alive(pidfd):
        raise PeerGone(f"process {pid} exited")
    return Peer(pid, uid, gid, started)


def peer_of(conn: socket.socket) -> Peer:
    """The process that connected `conn` (a Unix stream socket accepted here); one
    the daemon cannot see (`Peer.visible` False) is named by its uid and gid alone.
    Raises PeerGone when it exited."""
    pid, uid, gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if pid <= 0:  # another pid namespace (a sidecar): shm works, pvm cannot
        return Peer(0, uid, gid, 0)
    pidfd = open_pidfd(conn, pid)
    try:
        return identity(pidfd, pid, uid, gid)
    except PeerGone:
        if pidfd_alive(pidfd):  # alive, its /proc entry hidden from the daemon's uid
            return Peer(pid, uid, gid, 0)
        raise
    finally:
        os.close(pidfd)


def is_unnamed(sock: socket.socket) -> bool:
    """True for an end of socketpair(): neither it nor its peer has an address.
    A socket connected to a listener has the listener's path (or abstract name)."""
    try:
        return not sock.getsockname() and not sock.getpeername()
    except OSError:  # not connected: not a socketpair end
        return False


def socket_creator(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) SO_PEERCRED names for an end of an unnamed Unix socketpair:
    the process that created the pair. None when `sock` is not one (a socket
    connected to a listener names the *listener*, which is how a process could
    point the daemon at another; such sockets are never trusted)."""
    if sock.family != socket.AF_UNIX or not is_unnamed(sock):
        return None
    with contextlib.suppress(OSError):
        pid, uid, gid = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        )
        return pid, uid, gid
    return None
