"""`RemoteTier`: the small interface a shared store below the node's pool offers.

The daemon's writer (kvdepot.server.remote.writer) and reader
(kvdepot.server.remote.reader) speak only this interface, so another store (a
local NVMe directory, Mooncake Store) is one more subclass.

Contract for implementations:
- Every call is a coroutine on the daemon's event loop and finishes by its
  `deadline` (an absolute `time.monotonic()` value): it returns, or raises
  `TierUnavailable`. It never hangs, whatever the store does (down, failing
  over, stalled); a slow store costs the caller at most the deadline.
- Calls take batches; answers come in request order. Keys and values are
  opaque bytes (the framing is kvdepot.server.remote.codec's job).
- `put_many` writes each value only where its key is absent (set-if-not-exists)
  with a time to live; it answers per key whether this call wrote it
  (False: the key was there already). Writing the same key twice is harmless.
- `get_many` answers the value or None (absent) per key; given `limits`, at
  most `limits[i]` bytes of key i are read (its first ones): a value planted
  too large is never pulled whole into the daemon. `exists_many` answers
  whether each key is present, `sizes_many` each value's size (0: absent).
- A failure of the store (refused, timed out, moved, failed over) is
  `TierUnavailable` with a sentence for the log; the implementation reconnects
  by itself on later calls. Nothing else escapes.
- `close` releases connections; later calls raise TierUnavailable.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence


class TierUnavailable(Exception):
    """The store did not answer in time, or answered with an error."""


class RemoteTier(abc.ABC):
    """A batch key-value store with deadlines (see the module docstring)."""

    #: Shown in logs and stats ("redis cluster 127.0.0.1:7000 (+2 seeds)").
    description: str = "remote tier"

    @abc.abstractmethod
    async def put_many(
        self, items: Sequence[tuple[bytes, bytes]], ttl_s: int | None, deadline: float
    ) -> list[bool]:
        """Writes absent keys (with `ttl_s` seconds to live, None = no expiry)."""

    @abc.abstractmethod
    async def get_many(
        self, keys: Sequence[bytes], deadline: float, limits: Sequence[int] | None = None
    ) -> list[bytes | None]:
        """The value of each key (at most `limits[i]` bytes of it), None where absent."""

    @abc.abstractmethod
    async def sizes_many(self, keys: Sequence[bytes], deadline: float) -> list[int]:
        """The size in bytes of each key's value, 0 where absent."""

    @abc.abstractmethod
    async def exists_many(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        """Whether each key is present."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections. Idempotent."""
