"""The client's side of the daemon's fd socket: passing memory fds, attesting a session.

The protocol (framing, messages, refusals) is kvdepot.common.fd_protocol, shared with
the daemon; its names are re-exported here. `send_fd` sends one fd and returns the
fd_token that RegisterKV names; `attest` (and `attest_async`) binds a session to
this process. DepotClient attests every session it opens; a session's first fd
attests it too. `ticket_async` attests before a session exists: its ticket, sent as
the Session call's `kvdepot-ticket` metadata, opens a session this process owns from
the start (no other client's new sessions can end it while it attests).
"""

from __future__ import annotations

import json
import socket

from kvdepot.common.fd_protocol import (
    LENGTH,
    MAX_MESSAGE,
    FdPassError,
    encode,
    read_message,
    refusal_error,
    send_message,
)

__all__ = [
    "MAX_MESSAGE",
    "FdPassError",
    "attest",
    "attest_async",
    "encode",
    "read_message",
    "refusal_error",
    "send_fd",
    "send_message",
    "ticket_async",
]


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
    message = {"session_id": session_id, "attest": True}
    return _attested(await _exchange(fd_socket_path, message, timeout))


async def ticket_async(fd_socket_path: str, timeout: float = 5.0) -> str:
    """A ticket that opens a session owned by this process (see the module
    docstring). Raises FdPassError (an older daemon: "carries no fd"...)."""
    reply = await _exchange(fd_socket_path, {"ticket": True}, timeout)
    if "error" in reply:
        raise refusal_error(reply)
    ticket = reply.get("ticket")
    if not isinstance(ticket, str):
        raise FdPassError(f"unexpected reply from the daemon: {reply}")
    return ticket


async def _exchange(fd_socket_path: str, message: dict, timeout: float) -> dict:
    """One message without an fd and its reply, on an asyncio loop."""
    import asyncio

    async def exchange() -> dict:
        reader, writer = await asyncio.open_unix_connection(fd_socket_path)
        try:
            writer.write(encode(message))
            (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
            if length > MAX_MESSAGE:
                raise FdPassError(f"message of {length} bytes is larger than {MAX_MESSAGE}")
            obj = json.loads(await reader.readexactly(length))
        finally:
            writer.close()
        if not isinstance(obj, dict):
            raise FdPassError("message must be a JSON object")
        return obj

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except (OSError, EOFError, ValueError, TimeoutError) as exc:
        raise FdPassError(f"fd socket {fd_socket_path}: {exc!r}") from exc


def _attested(reply: dict) -> int:
    if "error" in reply:
        raise refusal_error(reply)
    if reply.get("attested") is not True:
        raise FdPassError(f"unexpected reply from the daemon: {reply}")
    pid = reply.get("pid")
    return pid if isinstance(pid, int) else 0
