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
            await abort_with(context, err)
            raise AssertionError("context.abort returned") from None

    return wrapper
