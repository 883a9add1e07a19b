"""Errors the daemon reports to clients: a gRPC status code and a message that
says what was wrong and what to do."""

from __future__ import annotations

import grpc


class DepotError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.NOT_FOUND, message)


def precondition(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.UNAVAILABLE, message)


def denied(message: str) -> DepotError:
    return DepotError(grpc.StatusCode.PERMISSION_DENIED, message)
