"""Passing memory file descriptors to the daemon (SCM_RIGHTS on a Unix socket).

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
DepotClient attests every session it opens; a session's first fd attests it too.
"""

from __future__ import annotations

import json
import os
import socket
import struct

MAX_MESSAGE = 4096
_LEN = struct.Struct(">I")


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
    return _LEN.pack(len(body)) + body


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
    while len(head) < _LEN.size:
        if max_fds:
            data, received, flags, _addr = socket.recv_fds(sock, _LEN.size - len(head), max_fds)
            fds.extend(received)
            if flags & socket.MSG_CTRUNC:  # the kernel dropped fds that did not fit
                raise FdPassError(
                    "the attached fd was discarded: the receiving process has no fd free "
                    "(RLIMIT_NOFILE), or more fds were attached than one"
                )
        else:
            data = sock.recv(_LEN.size - len(head))
        if not data:
            raise FdPassError("connection closed before a message arrived")
        head += data
    (length,) = _LEN.unpack(head)
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


def send_fd(fd_socket_path: str, session_id: str, fd: int, timeout: float = 5.0) -> str:
    """Sends `fd` to the daemon and returns the fd_token for RegisterKV."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(fd_socket_path)
            send_message(sock, {"session_id": session_id}, [fd])
            reply, _ = read_message(sock)
        except OSError as exc:
            raise FdPassError(f"fd socket {fd_socket_path}: {exc}") from exc
    if "error" in reply:
        raise refusal_error(reply)
    token = reply.get("fd_token")
    if not isinstance(token, str):
        raise FdPassError(f"unexpected reply from the daemon: {reply}")
    return token


def attest(fd_socket_path: str, session_id: str, timeout: float = 5.0) -> int:
    """Binds `session_id` to this process (see the module docstring); returns this
    process's pid as the daemon sees it. Raises FdPassError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(fd_socket_path)
            send_message(sock, {"session_id": session_id, "attest": True})
            reply, _ = read_message(sock)
        except OSError as exc:
            raise FdPassError(f"fd socket {fd_socket_path}: {exc}") from exc
    return _attested(reply)


async def attest_async(fd_socket_path: str, session_id: str, timeout: float = 5.0) -> int:
    """`attest` on an asyncio loop (no fd travels, so a plain stream does)."""
    import asyncio

    async def exchange() -> dict:
        reader, writer = await asyncio.open_unix_connection(fd_socket_path)
        try:
            writer.write(encode({"session_id": session_id, "attest": True}))
            (length,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if length > MAX_MESSAGE:
                raise FdPassError(f"message of {length} bytes is larger than {MAX_MESSAGE}")
            obj = json.loads(await reader.readexactly(length))
        finally:
            writer.close()
        if not isinstance(obj, dict):
            raise FdPassError("message must be a JSON object")
        return obj

    try:
        reply = await asyncio.wait_for(exchange(), timeout)
    except (OSError, EOFError, ValueError, TimeoutError) as exc:
        raise FdPassError(f"fd socket {fd_socket_path}: {exc!r}") from exc
    return _attested(reply)


def _attested(reply: dict) -> int:
    if "error" in reply:
        raise refusal_error(reply)
    if reply.get("attested") is not True:
        raise FdPassError(f"unexpected reply from the daemon: {reply}")
    pid = reply.get("pid")
    return pid if isinstance(pid, int) else 0
