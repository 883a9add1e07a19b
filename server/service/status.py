"""Where errors become call statuses: the service side of the error table.

kvdepot.server.errors holds the one table from the core's exceptions to status
codes (`as_depot_error`); this module applies it to a gRPC call. Every unary
handler of Depot and Admin is wrapped in `reports_errors`; streaming handlers
call `abort_with`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvdepot.server import errors

R = TypeVar("R")


def grpc_status(code: errors.Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


async def abort_with(context: grpc.aio.ServicerContext, exc: errors.DepotError) -> None:
    await context.abort(grpc_status(exc.code), exc.message)


def reports_errors(handler: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """A unary handler whose client errors (DepotError, or a core exception in the
    error table) become the call's status and message. Anything else is a bug
    and propagates (grpcio answers UNKNOWN and logs it)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: object, context: grpc.aio.ServicerContext) -> R:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            err = errors.as_depot_error(exc)
            if err is None:
                raise
            code, message = grpc_status(err.code), err.message
            del err  # often `exc` itself, whose traceback holds this frame: a cycle
        # Not context.abort(): grpcio keeps its AbortError on the call, and that
        # error's traceback holds the frames that hold the request, a cycle that kept
        # every refused request (up to 512 MiB of Put data) until the cyclic GC ran.
        # A non-OK code set here makes grpcio discard the (empty) response.
        context.set_code(code)
        context.set_details(message)
        # no response: the code set above makes grpcio send none
        return None  # type: ignore[return-value]

    return wrapper
