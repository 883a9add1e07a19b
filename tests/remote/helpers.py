"""Helpers for the remote-tier daemon tests."""

from __future__ import annotations

from kvdepot.client import DepotClient


def prefetch(c: DepotClient, namespace: str, keys: list[bytes], timeout: float = 5.0):
    return c.prefetch(namespace, keys, timeout=timeout)  # joins the namespace first
