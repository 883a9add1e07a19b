"""`TouchesAfterWrites`: a finished request's touch applied again to a tier's order once
the rows it names are written there, so a tier below the pool keeps the pool's prefix order.

A request's touch (its chunks, group-major and ascending) makes its rows the most
recently used in the pool, its first chunk the youngest (kvdepot.server.core.eviction,
"Prefixes, not chunks"), and every tier below hears it (`Tier.touch`,
kvdepot.server.core.tier). A tier that writes behind and keeps an order of its own
(the disk) enters a row into that order when its write ends, and the touch may come
first: the connector sends it once the pool's stores are in, not the tiers'. A new
tail would then be younger in the tier than the head the touch just made young; the
tier, full, would evict the head first and keep the tail where no lookup reaches it
(the capacity bench counted up to 11 such rows on disk, benchmarks/README.md). So a
touch that names a row still to write is kept, and handed back once none of its rows
is: the tier applies it again.

Sans-I/O, owned by one tier and called on the event loop: no lock, no clock. The
disk's DiskLink and the test tier (tests/tiers/memory_tier.py) use it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

# Touches kept at most; past it, the oldest is applied as it stands (a disk that
# cannot keep up drops writes anyway).
MAX_TOUCHES = 1024

Row = tuple[str, bytes]
Touch = tuple[str, Sequence[bytes]]


class TouchesAfterWrites:
    """Rows not written yet, and the touches waiting for them."""

    def __init__(self, max_touches: int = MAX_TOUCHES) -> None:
        self._unwritten: Counter[Row] = Counter()  # noted to write, not settled yet
        self._touches: list[tuple[Touch, set[Row]]] = []  # each with its rows unwritten
        self.max_touches = max_touches

    def noted(self, row: Row) -> None:
        """`row` is to be written (waiting, or its write under way)."""
        self._unwritten[row] += 1

    def settled(self, row: Row) -> list[Touch]:
        """`row`'s write ended, or was dropped: the touches now due, oldest first."""
        n = self._unwritten[row] - 1
        if n > 0:
            self._unwritten[row] = n
            return []
        self._unwritten.pop(row, None)
        due: list[Touch] = []
        kept: list[tuple[Touch, set[Row]]] = []
        for touch, rows in self._touches:
            rows.discard(row)
            if rows:
                kept.append((touch, rows))
            else:
                due.append(touch)
        self._touches = kept
        return due

    def touched(self, namespace_id: str, keys: Sequence[bytes]) -> list[Touch]:
        """A touch the disk applied now: kept when a row it names is not written yet.
        Returns the oldest touches past the bound, due as they stand."""
        unwritten = self._unwritten
        if not unwritten:
            return []
        rows = {(namespace_id, key) for key in keys if (namespace_id, key) in unwritten}
        if not rows:
            return []
        self._touches.append(((namespace_id, list(keys)), rows))
        over = len(self._touches) - self.max_touches
        if over <= 0:
            return []
        due = [touch for touch, _ in self._touches[:over]]
        del self._touches[:over]
        return due

    @property
    def waiting(self) -> int:
        """Touches kept."""
        return len(self._touches)
