"""Nothing is read before a session: the engines' socket's gate.

grpc reads a whole request (up to the receive limit, 512 MiB so that Put carries a
section inline) before the servicer sees it, and one limit applies to every method of
a server. So a process with no session sent four concurrent 200 MiB messages to any
method and the daemon held 1.9 GiB of them, only to refuse each afterwards.

`SessionGate` runs when grpc looks up a call's handler, when only its method and
metadata have arrived: a Depot call other than Session must name a live session in its
`kvdepot-session` metadata (kvdepot's client sends it on every call: the session id its
request carries), or it is refused there with FAILED_PRECONDITION, by a handler that
never reads the request; grpc then drops its bytes, of which HTTP/2 flow control let
only a window's worth arrive. The request's own session_id is checked as before by the
state; the metadata only says that a session is there before anything is buffered.

Session itself comes before any session: its request is never read. Its three fields
(client name, pid, engine id: display only) come from its metadata instead
(`kvdepot-client-bin`, `kvdepot-pid`, `kvdepot-engine-bin`, which kvdepot's client
sends), bounded by grpc's metadata limit (8 KiB); without them the session opens with
empty ones. Health and reflection (probes and tools, no session) are read as before,
up to the receive limit.

Not a grpc.aio server interceptor: grpc runs each interceptor as a coroutine of its own
for every call, which cost a unary call ~40 µs at p50 (two of them, the gate and the
caps: pins and lookups 6-7 % slower end to end on a 2-CPU VM). The gate is handed to
`wire.add_servicer` instead and called synchronously from grpc's handler lookup (a
generic handler), with the caps' wrapper after it; the wire is the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvdepot.common.kinds import (
    HELLO_CLIENT_METADATA,
    HELLO_ENGINE_METADATA,
    HELLO_PID_METADATA,
    SESSION_METADATA,
)
from kvdepot.server import errors
from kvdepot.server.core.log_limit import LogLimiter, held_note
from kvdepot.server.peer import session_tag
from kvdepot.server.service.status import grpc_status
from kvdepot.v1 import depot_pb2 as pb

__all__ = ["SessionGate", "refusing_handler"]

log = logging.getLogger("kvdepot.gate")

DEPOT = "kvdepot.v1.Depot"


def refusing_handler(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers `code` at once and never reads the request: a request
    stream as far as the server is concerned, whatever the client sent (the wire is the
    same), so nothing is received for it but what flow control already let through."""

    async def refuse(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(refuse)


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str:
    for item in details.invocation_metadata or ():
        if item[0] == key:
            value = item[1]
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def hello_request(details: grpc.HandlerCallDetails) -> pb.SessionRequest:
    """A Session call's request, read off its metadata (the request is never read)."""
    pid = _metadata(details, HELLO_PID_METADATA)
    return pb.SessionRequest(
        client_name=_metadata(details, HELLO_CLIENT_METADATA)[:200],
        pid=int(pid) if pid.isdigit() and len(pid) < 10 else 0,
        engine_id=_metadata(details, HELLO_ENGINE_METADATA)[:200],
    )


def _session_unread(
    handler: grpc.RpcMethodHandler, request: pb.SessionRequest
) -> grpc.RpcMethodHandler:
    """Depot/Session's own handler, given `request` instead of reading one: a request
    stream to the server (the same wire as the client's unary request), never read."""
    serve = handler.unary_stream

    async def session(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        events = serve(request, context)
        try:
            async for event in events:
                yield event
        finally:  # the session ends now that its stream does, not when collected
            await events.aclose()

    return grpc.stream_stream_rpc_method_handler(
        session, response_serializer=handler.response_serializer
    )


class SessionGate:
    """The engines' server's admission of Depot calls (see the module docstring): given
    a call's details and the handler grpc would run, the handler to run instead. Session
    is served unread; a call whose `kvdepot-session` metadata names a session `is_open`
    knows goes on to its handler, wrapped by `count` (the calls-in-flight caps,
    kvdepot.server.service.call_caps); any other is refused unread. Called by grpc's
    handler lookup (`wire.add_servicer`'s `admit`), on the event loop, synchronously."""

    def __init__(
        self,
        is_open: Callable[[str], bool],
        count: Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler],
    ) -> None:
        self._is_open = is_open
        self._count = count
        # Refusals are logged, rate-limited: callers with no session cannot be told
        # apart (one key), those naming a session by the session's tag.
        self.log_limit = LogLimiter()

    def __call__(
        self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        method = details.method.rpartition("/")[2]
        if method == "Session":
            return _session_unread(handler, hello_request(details))
        session_id = _metadata(details, SESSION_METADATA)
        if session_id and self._is_open(session_id):
            return self._count(handler, session_id)
        if session_id:
            refusal = errors.precondition(
                f"unknown session {session_tag(session_id)!r}…: open a Session first and "
                f"pass its id (after a daemon restart every session is gone: reconnect)"
            )
        else:
            refusal = errors.precondition(
                f"{method} names no session: open a Session and send its id as the "
                f"{SESSION_METADATA} metadata of every call (kvdepot's client does)"
            )
        key = session_tag(session_id) if session_id else "no session"
        held = self.log_limit.admit(key, time.monotonic())
        if held is not None:
            log.warning("refused %s, unread: %s%s", method, refusal.message, held_note(held))
        return refusing_handler(grpc_status(refusal.code), refusal.message)
