"""Calls in flight per owner: no client holds the server's concurrent-call limit.

grpc counts every call from its headers on against the server's limit
(`maximum_concurrent_rpcs`, 4,096 at the defaults), whoever makes it: a session holder
that opened thousands of idle Transfer streams, or Lookups whose request never came,
left every other client RESOURCE_EXHAUSTED. `CallCaps` (after the session gate, which
hands it only calls naming a live session: kvdepot.server.service.gate) counts each Depot call but
Session against its session's account and uid (`DepotState.open_call`: the owner
process, or the opener; kvdepot.server.state.sessions) from the moment it starts to
the moment it ends, and refuses one past its share with RESOURCE_EXHAUSTED before
reading it.

A unary request is read by grpc before its handler runs, so a call whose request
never comes would never reach a counter, nor leave one: each handler is served as a
request stream instead (the same wire), whose behaviour starts with the call, counts
it, reads the one request and hands it to the servicer's method.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import grpc

from kvdepot.server import errors
from kvdepot.server.service.status import abort_with

__all__ = ["CallCaps"]

Held = TypeVar("Held")  # what open_call returns and close_call takes back


async def _only_request(context: grpc.aio.ServicerContext) -> Any:
    """The call's one request. Read with `context.read()`, which keeps nothing: grpc's
    request iterator holds the last message it gave until it is read past (a refused
    64 MiB Put stayed in memory), and reading on to the end costs a second read."""
    request = await context.read()
    if request is grpc.aio.EOF:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
    return request


class CallCaps(Generic[Held]):
    """Counts every Depot call but Session while it is in flight (see the module
    docstring); `open_call(session_id)` raises DepotError to refuse one, and
    `close_call` takes what it returned. `counted` is called by the session gate when
    grpc looks up a call's handler; the handler it returns runs on the event loop."""

    def __init__(
        self, open_call: Callable[[str], Held], close_call: Callable[[Held], None]
    ) -> None:
        self._open = open_call
        self._close = close_call

    def counted(self, handler: grpc.RpcMethodHandler, session_id: str) -> grpc.RpcMethodHandler:
        """`handler`, served as a request stream counted against `session_id`'s shares
        from the call's start to its end."""
        open_call, close_call = self._open, self._close
        deserialize, serialize = handler.request_deserializer, handler.response_serializer

        async def admit(context: grpc.aio.ServicerContext) -> Held:
            try:
                return open_call(session_id)
            except errors.DepotError as exc:
                await abort_with(context, exc)
                raise AssertionError("context.abort raises") from exc

        if handler.unary_unary or handler.stream_unary:
            unary_in = handler.unary_unary is not None
            answer = handler.unary_unary or handler.stream_unary

            async def unary_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext):
                held = await admit(context)
                try:
                    request = await _only_request(context) if unary_in else requests
                    return await answer(request, context)
                finally:
                    close_call(held)

            return grpc.stream_unary_rpc_method_handler(unary_out, deserialize, serialize)

        stream_in = handler.stream_stream is not None
        answers = handler.stream_stream or handler.unary_stream

        async def stream_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext):
            held = await admit(context)
            try:
                request = requests if stream_in else await _only_request(context)
                async for reply in answers(request, context):
                    yield reply
            finally:
                close_call(held)

        return grpc.stream_stream_rpc_method_handler(stream_out, deserialize, serialize)
