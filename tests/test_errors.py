"""The one error table: every core exception a client can cause gets its status,
the same for unary calls (the services' decorator) and Transfer jobs (error_code)."""

from __future__ import annotations

import grpc
import pytest

from kvdepot.server import errors
from kvdepot.server.core.index import LayoutMismatch, UnknownNamespace
from kvdepot.server.core.layout import LayoutError
from kvdepot.server.service.status import grpc_status


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (LayoutError("bad key"), "INVALID_ARGUMENT"),
        (UnknownNamespace("no such namespace"), "NOT_FOUND"),
        (LayoutMismatch("other bytes"), "FAILED_PRECONDITION"),
        (errors.denied("no"), "PERMISSION_DENIED"),
    ],
)
def test_core_exceptions_map_to_their_status(exc: Exception, code: str) -> None:
    err = errors.as_depot_error(exc)
    assert err is not None and err.code.name == code and err.message == str(exc)


def test_bugs_are_not_client_errors() -> None:
    assert errors.as_depot_error(KeyError("x")) is None
    assert errors.as_depot_error(AssertionError("x")) is None


def test_every_code_is_a_grpc_status() -> None:
    for code in errors.Code:
        assert grpc_status(code) is getattr(grpc.StatusCode, code.name)
