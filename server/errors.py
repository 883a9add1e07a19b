"""Errors the daemon reports to clients: a status code and a message that says
what was wrong and what to do.

No gRPC here: `Code`'s names are gRPC status code names, and the service layer
(kvdepot.server.service.status) turns them into call statuses; the job runner
puts `code.name` into TransferResult.error_code. Core modules raise their own
exception types (LayoutError, UnknownNamespace, ...); `CORE_CODES` is the one
table that says which status each of them gets, and `as_depot_error` applies it.
"""

from __future__ import annotations

import enum

from kvdepot.server.core.allocator import OutOfSpace
from kvdepot.server.core.index import LayoutMismatch, UnknownNamespace
from kvdepot.server.core.layout import LayoutError


class Code(enum.Enum):
    """gRPC status codes the daemon answers with (same names)."""

    INVALID_ARGUMENT = enum.auto()
    NOT_FOUND = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    UNAVAILABLE = enum.auto()
    PERMISSION_DENIED = enum.auto()
    INTERNAL = enum.auto()


class DepotError(Exception):
    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# The core's exceptions and the status each one gets (most specific class first
# wins: the exception's own class is looked up, then its bases).
CORE_CODES: dict[type[Exception], Code] = {
    LayoutError: Code.INVALID_ARGUMENT,  # a layout, key or job that does not fit
    UnknownNamespace: Code.NOT_FOUND,  # no engine declared the namespace
    LayoutMismatch: Code.FAILED_PRECONDITION,  # a namespace id reused with other bytes
    OutOfSpace: Code.RESOURCE_EXHAUSTED,  # (the index turns it into drops; never escapes)
}


def as_depot_error(exc: BaseException) -> DepotError | None:
    """`exc` as the error a client gets, or None when it is not one (a bug)."""
    if isinstance(exc, DepotError):
        return exc
    for cls in type(exc).__mro__:
        code = CORE_CODES.get(cls)
        if code is not None:
            return DepotError(code, str(exc))
    return None


def invalid(message: str) -> DepotError:
    return DepotError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> DepotError:
    return DepotError(Code.NOT_FOUND, message)


def precondition(message: str) -> DepotError:
    return DepotError(Code.FAILED_PRECONDITION, message)


def exhausted(message: str) -> DepotError:
    return DepotError(Code.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> DepotError:
    return DepotError(Code.UNAVAILABLE, message)


def denied(message: str) -> DepotError:
    return DepotError(Code.PERMISSION_DENIED, message)


def internal(message: str) -> DepotError:
    return DepotError(Code.INTERNAL, message)
