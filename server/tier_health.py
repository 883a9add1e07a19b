"""Whether a tier below the pool (the fleet's Redis, the local disk) is usable now, and
the log lines that say so in words.

After a failed call the tier counts as down: its writes are dropped (counted) and
reads stay in RAM at once, instead of each paying a deadline or an error. One call is
let through after a back-off (0.5 s doubling to 10 s, kvdepot.common.backoff) as a
probe; its success brings the tier back. Each change is logged once, in words.

Not thread-safe: the remote tier calls it on the event loop, the disk tier under its
own lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvdepot.common.backoff import Backoff

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class HealthWords:
    """How a tier's log lines say it went down and came back, e.g. "is not answering"
    / "writes to it are dropped ..." and "answers again" / "writes ... resume"."""

    tier: str
    down: str
    while_down: str
    back: str
    when_back: str


class TierHealth:
    def __init__(self, description: str, words: HealthWords, log: logging.Logger) -> None:
        self.description = description
        self.down_since: float | None = None
        self.outages = 0
        self.reason = ""  # why it is down; "" while up
        self._words = words
        self._log = log
        self._retry_at = 0.0
        self._backoff = Backoff(FIRST_BACKOFF_S, MAX_BACKOFF_S)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def probe_due(self) -> bool:
        """Down, and the back-off has passed: the next call is a probe."""
        return self.down_since is not None and time.monotonic() >= self._retry_at

    def usable(self) -> bool:
        """True when up, or when a probe is due."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self, why: str) -> None:
        now = time.monotonic()
        self.reason = why
        w = self._words
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
            self._backoff.reset()
            self._log.warning(
                "%s %s %s (%s): %s; retrying in the background",
                w.tier,
                self.description,
                w.down,
                why,
                w.while_down,
            )
        else:
            self._log.debug("%s still down: %s", w.tier, why)
        self._retry_at = now + self._backoff.next_delay()

    def succeeded(self) -> None:
        if self.down_since is not None:
            w = self._words
            self._log.warning(
                "%s %s %s after %.1f s: %s",
                w.tier,
                self.description,
                w.back,
                time.monotonic() - self.down_since,
                w.when_back,
            )
            self.down_since = None
            self.reason = ""
