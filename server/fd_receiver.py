"""The daemon's fd socket: receives memfds over SCM_RIGHTS, hands out tokens.

Blocking sockets on threads (asyncio has no recvmsg for Unix sockets with
ancillary data): one thread accepts, and each connection is read on a thread of
its own, so a peer that stalls never delays another. Bounds, so that no peer can
take the socket from the others: a whole-message deadline (`message_deadline`
seconds from accept; then the connection is shut down), at most
`max_per_peer` connections open per peer process (SO_PEERCRED) and
`max_connections` in all (beyond them a peer is told so at once), and no fd
is taken while the process is near its open-file limit (`headroom`).

A received fd waits under a random token until a RegisterKV of the same session
claims it; unclaimed fds are closed after `ttl` seconds, and a session's fds are
closed when it ends, so nothing leaks. See kvdepot.common.fd_protocol for the protocol.

Identity: every message names a session, and the kernel names its sender
(kvdepot.server.peer: SO_PEERCRED, start time). `authorize(session_id, peer)`,
run on the daemon's event loop, binds the session to the first process that
speaks for it (an "attest" message, which carries no fd, or its first fd) and
refuses every other process (PERMISSION_DENIED). A pending fd remembers its
sender, so a pvm registration copies from that process and no other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvdepot.common.fd_protocol import FdPassError, encode, read_message
from kvdepot.server import errors
from kvdepot.server.peer import Peer, PeerGone, peer_of
from kvdepot.server.resources import Headroom, ResourceLow
from kvdepot.server.state.sessions import ForeignToken

log = logging.getLogger("kvdepot.fd")

MAX_PENDING_PER_SESSION = 64
MESSAGE_DEADLINE = 3.0  # seconds for a whole message; a healthy client needs milliseconds
MAX_CONNECTIONS = 64
MAX_PER_PEER = 8
AUTHORIZE_TIMEOUT = 5.0  # seconds for the event loop to answer an identity check

# authorize(session_id, sender): returns when `sender` may speak for the session;
# raises errors.DepotError (PERMISSION_DENIED, RESOURCE_EXHAUSTED, ...) otherwise.
Authorize = Callable[[str, Peer], None]


@dataclass
class PendingFd:
    fd: int
    session_id: str
    received: float
    peer: Peer  # the process that sent it (SO_PEERCRED of the fd-socket connection)

    @property
    def peer_pid(self) -> int:
        return self.peer.pid


class FdReceiver:
    def __init__(
        self,
        path: str,
        session_exists: Callable[[str], bool],
        ttl: float = 60.0,
        *,
        headroom: Headroom | None = None,
        message_deadline: float = MESSAGE_DEADLINE,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
        authorize: Authorize | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        """`authorize` (see `Authorize`) runs on `loop` when one is given, else on
        the connection's thread; None accepts any sender (tests of the socket)."""
        self.path = path
        self.ttl = ttl
        self.headroom = headroom
        self.message_deadline = message_deadline
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._session_exists = session_exists
        self._authorize = authorize
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, PendingFd] = {}
        # Connections being read: socket -> (peer pid, deadline). Under _lock.
        self._open: dict[socket.socket, tuple[int, float]] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(128)
        self._sock.settimeout(0.25)  # also the period of the deadline check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvdepot-fd", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            for conn in self._open:  # their threads see the end of the stream
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            for p in self._pending.values():
                os.close(p.fd)
            self._pending.clear()

    def claim(self, token: str, session_id: str) -> int:
        """Takes ownership of the fd behind `token`; raises KeyError with why
        (ForeignToken when it was sent for another session)."""
        return self.claim_pending(token, session_id).fd

    def claim_pending(self, token: str, session_id: str) -> PendingFd:
        """`claim`, with who sent the fd (the caller owns `.fd`)."""
        with self._lock:
            p = self._pending.get(token)
            if p is not None and p.session_id != session_id:
                raise ForeignToken(
                    "this fd_token was sent for another session: a session uses only the "
                    "fds its own process sent"
                )
            if p is None:
                raise KeyError(
                    f"unknown fd_token {token[:8]!r}…: send the memfd to the fd socket first, "
                    f"with this session's id, and use the token within {self.ttl:.0f} s"
                )
            del self._pending[token]
            return p

    def drop_session(self, session_id: str) -> int:
        with self._lock:
            tokens = [t for t, p in self._pending.items() if p.session_id == session_id]
            for t in tokens:
                os.close(self._pending.pop(t).fd)
        return len(tokens)

    def expire(self) -> int:
        deadline = time.monotonic() - self.ttl
        with self._lock:
            stale = [t for t, p in self._pending.items() if p.received < deadline]
            for t in stale:
                os.close(self._pending.pop(t).fd)
        return len(stale)

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._enforce_deadlines()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("fd socket accept failed")
                time.sleep(0.1)
                continue
            try:
                creds = conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                )
                peer_pid = struct.unpack("3i", creds)[0]
            except OSError:
                conn.close()
                continue
            refusal = self._admit(conn, peer_pid)
            if refusal is not None:
                self._refuse(conn, refusal)
                continue
            threading.Thread(
                target=self._serve_one,
                args=(conn, peer_pid),
                name="kvdepot-fd-conn",
                daemon=True,
            ).start()

    def _admit(self, conn: socket.socket, peer_pid: int) -> str | None:
        """Files the connection (None), or says why it is refused."""
        with self._lock:
            if len(self._open) >= self.max_connections:
                return (
                    f"the fd socket is serving {len(self._open)} connections, its limit: "
                    f"retry in a moment"
                )
            mine = sum(pid == peer_pid for pid, _ in self._open.values())
            if mine >= self.max_per_peer:
                return (
                    f"process {peer_pid} already has {mine} connections open on the fd "
                    f"socket (at most {self.max_per_peer}): send one fd per connection and "
                    f"finish each message"
                )
            self._open[conn] = (peer_pid, time.monotonic() + self.message_deadline)
        return None

    @staticmethod
    def _refuse(conn: socket.socket, reason: str) -> None:
        # Never wait on a peer we refuse: a reply that does not fit now is dropped.
        with conn, contextlib.suppress(OSError):
            conn.setblocking(False)
            conn.send(encode({"error": reason}))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [c for c, (_, deadline) in self._open.items() if deadline < now]
        for conn in late:
            # Wakes the reading thread (its recv returns b""), which closes it.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _serve_one(self, conn: socket.socket, peer_pid: int) -> None:
        try:
            with conn:
                conn.settimeout(self.message_deadline)
                self._handle(conn, peer_pid)
        except Exception:  # a bug: log it, but never lose the thread's bookkeeping
            log.exception("fd socket connection from pid %d failed", peer_pid)
        finally:
            with self._lock:
                self._open.pop(conn, None)

    def _handle(self, conn: socket.socket, peer_pid: int) -> None:
        fds: list[int] = []
        try:
            # Read first (the reserve has room for it; refusing unread would break the
            # peer's send), then refuse keeping it near the limit.
            msg, fds = read_message(conn, max_fds=4)
            if self.headroom is not None:
                self.headroom.check_fds(0, "the fd")
            sender = peer_of(conn)  # the kernel's word, never the message's
            reply = self._accept(msg, fds, sender)
            fds = []  # ownership moved (or closed) by _accept
        except ResourceLow as exc:
            reply = {"error": str(exc)}
        except PeerGone as exc:
            reply = {"error": f"cannot identify the sending process: {exc}"}
        except (FdPassError, OSError) as exc:
            late = isinstance(exc, TimeoutError) or str(exc).startswith("connection closed")
            reply = {
                "error": f"bad fd message: {exc}"
                + (
                    f" (a whole message must arrive within {self.message_deadline:.0f} s)"
                    if late
                    else ""
                )
            }
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):  # the client gave up: nothing to tell it
            conn.sendall(encode(reply))

    def _check_sender(self, session_id: str, sender: Peer) -> dict | None:
        """None when `sender` may speak for the session, else the error reply."""
        if self._authorize is None:
            return None
        try:
            if self._loop is None:
                self._authorize(session_id, sender)
            else:
                done: concurrent.futures.Future[None] = concurrent.futures.Future()

                def run() -> None:
                    try:
                        # not None: checked above (the closure loses the narrowing)
                        self._authorize(session_id, sender)  # type: ignore[misc]
                        done.set_result(None)
                    except BaseException as exc:
                        done.set_exception(exc)

                self._loop.call_soon_threadsafe(run)
                done.result(AUTHORIZE_TIMEOUT)
        except errors.DepotError as exc:
            return {"error": exc.message, "code": exc.code.name}
        except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError):
            return {"error": "the daemon is busy or stopping: retry", "code": "UNAVAILABLE"}
        return None

    def _accept(self, msg: dict, fds: list[int], sender: Peer) -> dict:
        session_id = msg.get("session_id")
        if msg.get("attest"):
            # Binds the session to this process (no fd needed); see the docstring.
            for fd in fds:
                os.close(fd)
            if fds:
                return {"error": "an attest message carries no fd"}
            if not isinstance(session_id, str) or not self._session_exists(session_id):
                return {"error": "unknown session_id: open a Session first and send its id"}
            refused = self._check_sender(session_id, sender)
            return refused or {"attested": True, "pid": sender.pid}
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return {
                "error": f"attach exactly one fd with SCM_RIGHTS to the message (it carried "
                f"{len(fds)})"
            }
        fd = fds[0]
        if not isinstance(session_id, str) or not self._session_exists(session_id):
            os.close(fd)
            return {"error": "unknown session_id: open a Session first and send its id"}
        refused = self._check_sender(session_id, sender)
        if refused is not None:
            os.close(fd)
            return refused
        with self._lock:
            if sum(p.session_id == session_id for p in self._pending.values()) >= (
                MAX_PENDING_PER_SESSION
            ):
                os.close(fd)
                return {
                    "error": f"more than {MAX_PENDING_PER_SESSION} unclaimed fds for this "
                    f"session: register (RegisterKV) the ones already sent"
                }
            token = secrets.token_hex(16)
            self._pending[token] = PendingFd(fd, session_id, time.monotonic(), sender)
        # The session may have ended (on the event loop) since the check above; its
        # drop_session then ran before this fd was filed. The loop removes a session
        # before dropping its fds, so checking again after filing closes the gap.
        if not self._session_exists(session_id):
            with self._lock:
                late = self._pending.pop(token, None)
            if late is not None:
                os.close(late.fd)
            return {"error": "unknown session_id: the session ended; open a new one"}
        return {"fd_token": token}
