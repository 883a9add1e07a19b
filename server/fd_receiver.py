"""The daemon's fd socket: receives memfds over SCM_RIGHTS, hands out tokens.

Runs on its own thread with blocking sockets (asyncio has no recvmsg for Unix
sockets with ancillary data). A received fd waits under a random token until a
RegisterKV of the same session claims it; unclaimed fds are closed after
`ttl` seconds, and a session's fds are closed when it ends, so nothing leaks.
See kvdepot.client.fdpass for the protocol.
"""

from __future__ import annotations

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

from kvdepot.client.fdpass import FdPassError, encode, read_message

log = logging.getLogger("kvdepot.fd")

MAX_PENDING_PER_SESSION = 64


@dataclass
class PendingFd:
    fd: int
    session_id: str
    received: float
    peer_pid: int


class FdReceiver:
    def __init__(self, path: str, session_exists: Callable[[str], bool], ttl: float = 60.0):
        self.path = path
        self.ttl = ttl
        self._session_exists = session_exists
        self._lock = threading.Lock()
        self._pending: dict[str, PendingFd] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvdepot-fd", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        with self._lock:
            for p in self._pending.values():
                os.close(p.fd)
            self._pending.clear()

    @property
    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def claim(self, token: str, session_id: str) -> int:
        """Takes ownership of the fd behind `token`; raises KeyError with why."""
        with self._lock:
            p = self._pending.get(token)
            if p is None or p.session_id != session_id:
                raise KeyError(
                    f"unknown fd_token {token!r}: send the memfd to the fd socket first, with "
                    f"this session's id, and use the token within {self.ttl:.0f} s"
                )
            del self._pending[token]
            return p.fd

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
            with conn:
                conn.settimeout(2.0)
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_pid = struct.unpack("3i", creds)[0]
            msg, fds = read_message(conn, max_fds=4)
            reply = self._accept(msg, fds, peer_pid)
            fds = []  # ownership moved (or closed) by _accept
        except (FdPassError, OSError) as exc:
            reply = {"error": f"bad fd message: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):  # the client gave up: nothing to tell it
            conn.sendall(encode(reply))

    def _accept(self, msg: dict, fds: list[int], peer_pid: int) -> dict:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return {"error": f"attach exactly one fd with SCM_RIGHTS (got {len(fds)})"}
        fd = fds[0]
        session_id = msg.get("session_id")
        if not isinstance(session_id, str) or not self._session_exists(session_id):
            os.close(fd)
            return {"error": "unknown session_id: open a Session first and send its id"}
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
            self._pending[token] = PendingFd(fd, session_id, time.monotonic(), peer_pid)
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
