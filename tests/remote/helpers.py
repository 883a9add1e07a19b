"""Helpers for the remote-tier daemon tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvdepot.client import DepotClient
from kvdepot.v1 import admin_pb2


def prefetch(c: DepotClient, namespace: str, keys: list[bytes], timeout: float = 5.0):
    return c.prefetch(namespace, keys, timeout=timeout)  # joins the namespace first


def stats(c: DepotClient) -> admin_pb2.GetStatsResponse:
    return c.admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5)


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or cond}")
