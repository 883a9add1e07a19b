"""Waiting for something a test or a benchmark expects to happen: one polling loop,
one failure message (what was awaited, for how long, and whatever `detail` says),
instead of a sleep that hopes the moment has come.

Standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class HasLog(Protocol):
    def log(self) -> str: ...


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> T:
    """Polls `predicate` until it returns something truthy, and returns that. After
    `timeout` seconds raises AssertionError naming `what`, with `detail()` (e.g. the
    daemon's log) below it. Exceptions of `predicate` propagate: a daemon that died
    fails the wait at once rather than at its end."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what or predicate}{more}"
            )
        time.sleep(interval)


def log_tails(*processes: HasLog, chars: int = 6000) -> Callable[[], str]:
    """A `detail` for wait_for: the end of each process's log (daemons, engines)."""
    return lambda: "\n\n".join(p.log()[-chars:] for p in processes)
