"""How many log lines a client may cause: a token bucket per peer, and one for all.

A client that opened sessions in a loop, or sent refused datagrams as fast as it could,
made the daemon log a line each: 21,800 lines in 12 s, drowning what an operator needs
and filling the journal. The daemon's lines about what clients do (sessions opened and
closed, refusals) pass through a `LogLimiter`: each key (a peer: a process, a session,
or one key for callers the daemon cannot tell apart yet) may log `burst` lines at once
and `rate` a second after that; all keys together `total_burst` and `total_rate`. A line
held back is counted against its key, and the key's next line says how many were
(`held_note`). Keys are forgotten least recently used first past `max_keys`; what they
held is told by the next line of any key.

Sans-I/O: the caller passes the time (time.monotonic()) and logs, or not, as told.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["LogLimiter", "held_note"]


@dataclass(slots=True)
class _Bucket:
    tokens: float
    last: float
    held: int = 0


class LogLimiter:
    def __init__(
        self,
        burst: int = 10,
        rate: float = 1.0,
        total_burst: int = 100,
        total_rate: float = 20.0,
        max_keys: int = 4096,
    ) -> None:
        if min(burst, rate, total_burst, total_rate, max_keys) <= 0:
            raise ValueError("a log limit must be positive")
        self.burst, self.rate = burst, rate
        self.total_burst, self.total_rate = total_burst, total_rate
        self.max_keys = max_keys
        self._keys: OrderedDict[Hashable, _Bucket] = OrderedDict()
        self._total: _Bucket | None = None
        self._forgotten = 0  # lines held by keys forgotten since: told by the next line
        self.held_total = 0  # every line held back, since start

    def admit(self, key: Hashable, now: float) -> int | None:
        """None: do not log this line (it is counted against `key`). Otherwise log
        it, saying that this many lines like it were held back before it (0: none)."""
        bucket = self._keys.get(key)
        if bucket is None:
            bucket = self._keys[key] = _Bucket(self.burst, now)
            if len(self._keys) > self.max_keys:
                _, oldest = self._keys.popitem(last=False)
                self._forgotten += oldest.held
        else:
            self._keys.move_to_end(key)
        total = self._total
        if total is None:
            total = self._total = _Bucket(self.total_burst, now)
        _refill(bucket, now, self.burst, self.rate)
        _refill(total, now, self.total_burst, self.total_rate)
        if bucket.tokens < 1 or total.tokens < 1:
            bucket.held += 1
            self.held_total += 1
            return None
        bucket.tokens -= 1
        total.tokens -= 1
        held, bucket.held = bucket.held + self._forgotten, 0
        self._forgotten = 0
        return held


def _refill(bucket: _Bucket, now: float, burst: int, rate: float) -> None:
    if now > bucket.last:
        bucket.tokens = min(burst, bucket.tokens + (now - bucket.last) * rate)
        bucket.last = now


def held_note(held: int) -> str:
    """What a line appends for the lines held back before it ("" for none)."""
    if held <= 0:
        return ""
    return f" ({held} more like it not logged: rate-limited)"
