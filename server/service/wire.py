"""Registering servicers so that undecodable messages get INVALID_ARGUMENT.

grpcio deserializes a request before the servicer sees it, and when the bytes are
not a valid protobuf message it answers UNKNOWN with a traceback in the log (for
a unary request), or ends a bidirectional stream with OK after dropping the
message (the Transfer reader dies with the DecodeError). Neither is a status the
wire contract documents. `add_servicer` registers a servicer exactly as the generated
`add_*Servicer_to_server` does, but with deserializers that never raise: a
message that cannot be parsed becomes a `Malformed` marker, and the wrappers
answer INVALID_ARGUMENT for it. For a request stream, the jobs before the bad
message run to completion and are answered, then the stream ends with
INVALID_ARGUMENT.

With `max_request_bytes`, a request larger than that is refused the same way
before it is parsed: parsing runs on the event loop. (grpc's receive limit, set
from the same bound, refuses most such requests before they are even received:
bounds.receive_limit; a Put's section larger than a part goes by PutParts.)
`type_bytes` gives some message types a bound of their own below it (a TransferJob:
its largest legal job, see bounds.py), and `parsers` a parser of their own (a
TransferJob: codec.read_job, which counts its lists before decoding them), as
parsing costs by the field, not the byte.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

# A call's details and the handler grpc found for it -> the handler to run.
Admit = Callable[[grpc.HandlerCallDetails, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


class Malformed:
    """A request whose bytes did not parse as the method's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(
    deserialize: Callable[[bytes], Any], type_name: str, max_bytes: int | None = None
) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(
                f"a {type_name} of {len(data)} bytes is larger than the {max_bytes} bytes "
                f"this daemon reads (its largest legal request, from --max-job-keys, "
                f"--max-job-blocks and --max-batch-keys): split it"
            )
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a parser may raise
            return Malformed(f"the request is not a valid {type_name} message: {exc}")

    return parse


def _message_name(deserialize: Callable[[bytes], Any]) -> str:
    owner = getattr(deserialize, "__self__", None)  # Message.FromString is a classmethod
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "protobuf")


def _wrap(
    handler: grpc.RpcMethodHandler,
    max_bytes: int | None,
    type_bytes: Mapping[str, int],
    parsers: Mapping[str, Callable[[bytes], Any]],
) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler
    name = _message_name(deserialize)
    if max_bytes is not None and name in type_bytes:
        max_bytes = min(max_bytes, type_bytes[name])
    parse = _tolerant(parsers.get(name, deserialize), name, max_bytes)

    if not handler.request_streaming and not handler.response_streaming:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary,
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )

    if not handler.request_streaming:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            responses = inner_us(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                # Runs the servicer's own cleanup (Session releases what it held) now,
                # not whenever the garbage collector finalizes the generator.
                await responses.aclose()

        return grpc.unary_stream_rpc_method_handler(
            unary_stream,
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )

    if handler.response_streaming:
        inner_ss = handler.stream_stream

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator:
            bad: list[Malformed] = []

            async def parsed() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Malformed):
                        bad.append(request)
                        return  # the servicer sees the request stream end here
                    yield request

            responses = inner_ss(parsed(), context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
            if bad:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{bad[0].error}; the jobs sent before it were answered, the stream is "
                    f"closed: open a new one",
                )

        return grpc.stream_stream_rpc_method_handler(
            stream_stream,
            request_deserializer=parse,
            response_serializer=handler.response_serializer,
        )

    inner_su = handler.stream_unary  # a request stream, one answer (PutParts)

    async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        async def parsed() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Malformed):  # before the servicer acts on the rest
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
                yield request

        return await inner_su(parsed(), context)

    return grpc.stream_unary_rpc_method_handler(
        stream_unary,
        request_deserializer=parse,
        response_serializer=handler.response_serializer,
    )


class _Capture:
    """Stands in for the server while a generated add_*_to_server registers."""

    def __init__(self) -> None:
        self.service: str | None = None
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # built again below from the registered-method table

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service = service
        self.handlers = dict(handlers)


def add_servicer(
    add_to_server: Callable[[Any, Any], None],
    servicer: object,
    server: grpc.aio.Server,
    max_request_bytes: int | None = None,
    type_bytes: Mapping[str, int] | None = None,
    parsers: Mapping[str, Callable[[bytes], Any]] | None = None,
    admit: Admit | None = None,
) -> None:
    """`add_to_server(servicer, server)` (a generated function), made tolerant of
    undecodable requests, and refusing requests over `max_request_bytes`, or over
    `type_bytes[the message's full name]` where that is lower; `parsers[full name]`
    parses that type instead of protobuf's FromString (see the module docstring).
    `admit(details, handler)`, when given, is asked for every call of the service
    which handler to run (the engines' session gate, kvdepot.server.service.gate)."""
    capture = _Capture()
    add_to_server(servicer, capture)
    if capture.service is None:
        raise RuntimeError(
            f"{add_to_server.__name__} registered no method table: regenerate the gRPC code "
            f"with grpcio-tools >= 1.62"
        )
    handlers = {
        name: _wrap(h, max_request_bytes, type_bytes or {}, parsers or {})
        for name, h in capture.handlers.items()
    }
    if admit is not None:
        # Generic only: grpc serves a registered method's handler without asking.
        server.add_generic_rpc_handlers((_Admitted(capture.service, handlers, admit),))
        return
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(capture.service, handlers),)
    )
    server.add_registered_method_handlers(capture.service, handlers)


class _Admitted(grpc.GenericRpcHandler):
    """A service's handlers, each call's through `admit`. grpc calls `service` on the
    event loop, synchronously, when a call's method and metadata have arrived: a
    lookup and a plain call, where a grpc.aio server interceptor is a coroutine per
    call (about 40 µs a unary call on a 2-CPU VM)."""

    def __init__(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler], admit: Admit
    ) -> None:
        self._handlers = {f"/{service}/{name}": h for name, h in handlers.items()}
        self._admit = admit

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(details.method)
        return None if handler is None else self._admit(details, handler)
