"""Back-off after failed loads: a key whose load failed misses for a while.

When a worker reports that loading a key failed (the block was evicted before its pin,
say), vLLM recomputes the request. Without a back-off the next lookup would hit the same
key again and send the next request into the same failure; with it the key misses for
`kvdepot_load_failure_backoff_s` (and the remote tier is not asked for it either).

Threads and ownership (`LoadFailureBackoff` owns `until`):
- `note`, `prune` and reads of `until` run on vLLM's scheduler thread (the connector's
  `update_connector_output`, the step's end, lookups);
- `clear` runs there too (reset_cache), or on the client's stream loop thread when a
  reset snapshot makes the mirror forget everything.
No lock: `until` is replaced, never changed in place, so every reader sees a whole dict.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

# Expired keys are dropped from `until` at most this often (seconds).
PRUNE_EVERY_S = 1.0


class LoadFailureBackoff:
    """Keys whose load failed recently -> monotonic time when they may hit again."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self.until: dict[bytes, float] = {}
        self._next_prune = 0.0

    def note(self, keys: Iterable[bytes]) -> int:
        """Backs off from `keys` from now on; returns how many there were."""
        until = time.monotonic() + self.backoff_s
        backed_off = dict(self.until)
        n = 0
        for key in keys:
            backed_off[key] = until
            n += 1
        self.until = backed_off
        return n

    def prune(self) -> None:
        """Forgets the keys whose back-off is over, once a second at most."""
        if not self.until:
            return
        now = time.monotonic()
        if now >= self._next_prune:
            self.until = {k: t for k, t in self.until.items() if t > now}
            self._next_prune = now + PRUNE_EVERY_S

    def clear(self) -> None:
        self.until = {}
