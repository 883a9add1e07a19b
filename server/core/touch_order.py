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

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Touches kept at most; past it, the oldest is applied as it stands (a disk that
# cannot keep up drops writes anyway).
MAX_TOUCHES = 1024

Row = tuple[str, bytes]
Touch = tuple[str, Sequence[bytes]]


@dataclass(eq=False, slots=True)
class _Kept:
    touch: Touch
    left: int  # its rows still to write
    due: bool = False  # handed back already


class TouchesAfterWrites:
    """Rows not written yet, and the touches waiting for them. Each call costs the
    rows it names (and the touches waiting for the row it settles), never a walk of
    everything kept."""

    def __init__(self, max_touches: int = MAX_TOUCHES) -> None:
        self._unwritten: dict[Row, int] = {}  # noted to write, not settled yet: how often
        self._waiting_on: dict[Row, list[_Kept]] = {}  # an unwritten row's kept touches
        # Oldest first, at most max_touches (some handed back already, behind one not).
        self._kept: deque[_Kept] = deque()
        self._count = 0  # kept touches not handed back yet
        self.max_touches = max_touches

    def noted(self, row: Row) -> None:
        """`row` is to be written (waiting, or its write under way)."""
        self._unwritten[row] = self._unwritten.get(row, 0) + 1

    def settled(self, row: Row) -> list[Touch]:
        """`row`'s write ended, or was dropped: the touches now due, oldest first."""
        n = self._unwritten.get(row, 0) - 1
        if n > 0:
            self._unwritten[row] = n
            return []
        if n < 0:
            return []  # never noted
        del self._unwritten[row]
        due: list[_Kept] = []
        for kept in self._waiting_on.pop(row, ()):
            kept.left -= 1
            if kept.left == 0 and not kept.due:
                due.append(kept)  # in the order kept: oldest first
        return self._hand_back(due)

    def touched(self, namespace_id: str, keys: Sequence[bytes]) -> list[Touch]:
        """A touch the tier applied now: kept when a row it names is not written yet.
        Returns the oldest touches past the bound, due as they stand."""
        unwritten = self._unwritten
        if not unwritten:
            return []
        rows = {(namespace_id, key) for key in keys} & unwritten.keys()
        if not rows:
            return []
        kept = _Kept((namespace_id, list(keys)), len(rows))
        for row in rows:
            self._waiting_on.setdefault(row, []).append(kept)
        self._kept.append(kept)
        self._count += 1
        over: list[_Kept] = []
        while len(self._kept) > self.max_touches:  # bounds the memory, handed back or not
            oldest = self._kept.popleft()
            if not oldest.due:
                over.append(oldest)
                oldest.due = True
                self._count -= 1
        return [k.touch for k in over]

    def _hand_back(self, due: list[_Kept]) -> list[Touch]:
        for kept in due:
            kept.due = True
        self._count -= len(due)
        kept_now = self._kept
        while kept_now and kept_now[0].due:  # drop what was handed back from the front
            kept_now.popleft()
        return [k.touch for k in due]

    @property
    def waiting(self) -> int:
        """Touches kept."""
        return self._count
