"""`ColdEndWriter`: `--disk-write evict`'s write-behind, the pool's coldest rows
written ahead of eviction (kvdepot.server.disk.link's docstring says when)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvdepot.server.core.index import IndexEvent, Slot
from kvdepot.server.core.kinds import EventKind, EvictionReason
from kvdepot.server.disk.space import WriteVerdict

if TYPE_CHECKING:
    from kvdepot.server.disk.link import DiskLink

# The tier's write verdicts that drop a row, as GetStats and Prometheus name them.
WRITE_DROPS = {
    WriteVerdict.BACKLOG_FULL: "backlog_full",
    WriteVerdict.NO_SPACE: "no_space",
    WriteVerdict.TIER_DOWN: "tier_down",
    WriteVerdict.RECOVERING: "recovering",
}


# Rows one walk goes over at most, so a large pool's walk (a lookup under the tier's
# lock per row) never holds the loop for long; written rows are evicted first, so the
# walks keep up as long as RAM evicts fewer rows than this between two of them.
MAX_WALK = 4096


class ColdEndWriter:
    """`--disk-write evict`: writes the pool's least recently used rows not on disk
    yet once the pool is over `high_water` full (kvdepot.server.disk.link). On the event
    loop, but for `_done` (an I/O thread, handing over to the loop)."""

    def __init__(self, link: DiskLink, high_water: float) -> None:
        self._link = link
        self._index, self._arena, self.tier = link._index, link._arena, link.tier
        self.high_water = high_water
        self._credit = 0  # rows stored or written since the last walk
        self._walk_rows = 0  # rows the last walk went over
        self._walk_due = False
        self._writing = 0  # rows being written (kept in place)

    def on_event(self, event: IndexEvent) -> None:
        """New rows count towards the next walk; a row RAM evicted before it was
        written is counted as a dropped write (`evicted`)."""
        if event.kind is EventKind.STORED:
            self._credit += len(event.keys)
            self._schedule()
        elif event.reason is EvictionReason.LRU and self.tier.health.up:
            contains, ns = self.tier.contains, event.namespace
            lost = sum(1 for key in event.keys if not contains(ns, key))
            self._link.stats.write_drops["evicted"] += lost

    def _schedule(self) -> None:
        # Amortized: a walk of N rows runs again after N/8 rows stored or written.
        if not self._walk_due and self._credit * 8 >= self._walk_rows:
            self._walk_due = True
            asyncio.get_running_loop().call_soon(self._walk)

    def _walk(self) -> None:
        """Writes the coldest rows above the high-water mark not on disk yet, until
        the bound on bytes in flight stops it (BACKLOG_FULL: not a drop, the next
        walk takes them)."""
        self._walk_due = False
        self._credit = 0
        allocator = self._index.allocator
        # The coldest bytes over the mark (rows being written among them: kept in
        # place, the walk sees them and passes over them).
        ahead = allocator.used_bytes - int(self.high_water * allocator.capacity)
        if ahead <= 0 or not self.tier.health.up:
            self._walk_rows = 0
            return
        contains, todo, walked = self.tier.contains, [], 0
        for slot in self._index.coldest():  # no index change until the loop ends
            if ahead <= 0 or walked >= MAX_WALK:
                break
            ahead -= slot.extent.size
            walked += 1
            if not slot.kept and not contains(slot.namespace, slot.key):
                todo.append(slot)
        self._walk_rows = walked
        for cold in todo:
            verdict = self._write(cold)
            if verdict is WriteVerdict.BACKLOG_FULL:
                break
            if verdict in WRITE_DROPS:
                self._link.stats.write_drops[WRITE_DROPS[verdict]] += 1

    def _write(self, cold: Slot) -> WriteVerdict | None:
        verdict, slot = self._link.write_row(cold.namespace, cold.key, self._written)
        if slot is not None and verdict is WriteVerdict.ACCEPTED:
            self._writing += 1
        return verdict

    def _written(self, slot: Slot) -> None:
        self._index.end_keep(slot)  # no use: the row is still among the coldest
        self._writing -= 1
        self._credit += 1
        if self._writing == 0:  # the bound may have stopped the last walk
            self._credit = self._walk_rows
        self._schedule()
