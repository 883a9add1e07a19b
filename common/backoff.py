"""The one back-off policy of every part that retries: how long to wait before the next try.

`Backoff(initial, maximum, factor)` hands out `next_delay()`: `initial` first, then
each delay `factor` times the last, never above `maximum`; `reset()` after a
success starts again at `initial`. With `jitter`, each delay handed out is drawn
from [0.5, 1.5) times the schedule's, so that many clients that lost the same
daemon do not all come back in the same millisecond.

Users (each keeps its delays of before this module): DepotClient's session
reconnect (0.05 s doubling to 2 s, jittered), the client lanes' reopen (a fixed 5 s,
kvdepot.common.lane_keeping.LaneKeeping), the remote tier's probe (0.5 s doubling to 10 s).

A plain object without a lock: its owner calls it from one thread at a time (or
under its own lock). Standard library only.
"""

from __future__ import annotations

import random


class Backoff:
    """Delays before the next try: initial, then times `factor`, capped at `maximum`."""

    __slots__ = ("_delay", "factor", "initial", "jitter", "maximum")

    def __init__(
        self, initial: float, maximum: float, factor: float = 2.0, *, jitter: bool = False
    ) -> None:
        if initial < 0 or maximum < initial or factor < 1:
            raise ValueError(
                f"a back-off needs 0 <= initial <= maximum and factor >= 1 "
                f"(got {initial}, {maximum}, {factor})"
            )
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.jitter = jitter
        self._delay = initial

    def next_delay(self) -> float:
        """The delay before the next try (seconds); the one after grows by `factor`."""
        delay = self._delay
        self._delay = min(delay * self.factor, self.maximum)
        return delay * (0.5 + random.random()) if self.jitter else delay

    def reset(self) -> None:
        """A success: the next failure waits `initial` again."""
        self._delay = self.initial
