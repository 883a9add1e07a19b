"""Whether the remote tier is worth calling now, and the log lines that say so.

After a failed call the tier counts as down: writes are dropped (counted) and
lookups stay local at once, instead of each paying a deadline. One call is let
through after a back-off (0.5 s doubling to 10 s) as a probe; its success brings
the tier back. Each change is logged once, in words.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("kvdepot.remote")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


class TierHealth:
    def __init__(self, description: str) -> None:
        self.description = description
        self.down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = FIRST_BACKOFF_S
        self.outages = 0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def usable(self) -> bool:
        """True when up, or when a probe is due."""
        return self.down_since is None or time.monotonic() >= self._retry_at

    def failed(self, why: str) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
            self._backoff = FIRST_BACKOFF_S
            log.warning(
                "remote tier %s is not answering (%s): writes to it are dropped and lookups "
                "stay local until it answers again; retrying in the background",
                self.description,
                why,
            )
        else:
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            log.debug("remote tier still down: %s", why)
        self._retry_at = now + self._backoff

    def succeeded(self) -> None:
        if self.down_since is not None:
            log.warning(
                "remote tier %s answers again after %.1f s: writes and fetches resume",
                self.description,
                time.monotonic() - self.down_since,
            )
            self.down_since = None
