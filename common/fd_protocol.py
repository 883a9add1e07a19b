"""The fd socket's protocol, both ends: framing, refusals, fds over SCM_RIGHTS.

gRPC cannot carry file descriptors, so the daemon listens on a second Unix
socket (its path is in SessionHello.fd_socket). Protocol, one exchange per
connection:

    client -> daemon: 4-byte big-endian length + JSON {"session_id": ...},
                      with exactly one fd attached (SCM_RIGHTS)
    daemon -> client: 4-byte big-endian length + JSON {"fd_token": ...}
                      or {"error": "what was wrong and what to do",
                          "code": "PERMISSION_DENIED" (a gRPC code name; optional)}

The client then names `fd_token` in RegisterKV (SharedMemoryHandle). The daemon
keeps an unclaimed fd for a short while only. Works between unrelated processes.

Attest: {"session_id": ..., "attest": true} with no fd binds the session to the
sending process (the kernel's SO_PEERCRED of the connection); the daemon answers
{"attested": true, "pid": <this process as the daemon sees it>}. From then on it
takes fds, lanes and pvm registrations of that session from this process only.

The client's calls are in kvdepot.client.fdpass, the daemon's socket in
kvdepot.server.fd_receiver; both frame and read messages with this module.
"""

from __future__ import annotations

import json
import os
import socket
import struct

MAX_MESSAGE = 4096
LENGTH = struct.Struct(">I")  # the length before each JSON message


class FdPassError(RuntimeError):
    """The daemon refused the fd, or the exchange broke. `code`: the daemon's gRPC
    status code name for a refusal ("PERMISSION_DENIED", ...), or "" ."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def refusal_error(reply: dict) -> FdPassError:
    code = reply.get("code")
    return FdPassError(str(reply["error"]), code if isinstance(code, str) else "")


def encode(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return LENGTH.pack(len(body)) + body


def read_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """Reads one framed message (and up to `max_fds` attached fds).

    The caller owns the returned fds. When the message is malformed or the peer
    goes away, the fds received so far are closed before the error propagates:
    a peer must not be able to leak fds into the daemon with bad messages.
    (Fds beyond `max_fds` never arrive: the kernel discards what does not fit.)
    """
    fds: list[int] = []
    try:
        return _read_framed(sock, max_fds, fds), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_framed(sock: socket.socket, max_fds: int, fds: list[int]) -> dict:
    """read_message's body: appends received fds to `fds` as they arrive."""
    head = b""
    while len(head) < LENGTH.size:
        if max_fds:
            data, received, flags, _addr = socket.recv_fds(sock, LENGTH.size - len(head), max_fds)
            fds.extend(received)
            if flags & socket.MSG_CTRUNC:  # the kernel dropped fds that did not fit
                raise FdPassError(
                    "the attached fd was discarded: the receiving process has no fd free "
                    "(RLIMIT_NOFILE), or more fds were attached than one"
                )
        else:
            data = sock.recv(LENGTH.size - len(head))
        if not data:
            raise FdPassError("connection closed before a message arrived")
        head += data
    (length,) = LENGTH.unpack(head)
    if length > MAX_MESSAGE:
        raise FdPassError(f"message of {length} bytes is larger than {MAX_MESSAGE}")
    body = b""
    while len(body) < length:
        data = sock.recv(length - len(body))
        if not data:
            raise FdPassError("connection closed in the middle of a message")
        body += data
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise FdPassError(f"message is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FdPassError("message must be a JSON object")
    return obj


def send_message(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    """Sends one framed message with `fds` attached (SCM_RIGHTS)."""
    data = encode(obj)
    sent = socket.send_fds(sock, [data], fds) if fds else sock.send(data)
    if sent < len(data):  # the fds went with the first bytes; the rest plainly
        sock.sendall(data[sent:])
