"""BlockIndex's eviction: room for a store from the LRU list, and Evict/Clear.

`IndexEviction` is a mixin of `kvdepot.server.core.index.BlockIndex`, its only
subclass: the methods here read and change the index's own state (its LRU list,
namespaces, allocator and counters), declared below for type checkers only. A
row leaves the index here only when READY and unheld (no pin, no reader); each
removal is announced (REMOVED) with its reason.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.index_types import IndexEvent, IndexStats, Namespace, Slot
from kvdepot.server.core.kinds import EventKind, EvictionReason, SlotState


class IndexEviction:
    """BlockIndex's eviction methods (see the module docstring)."""

    if TYPE_CHECKING:  # BlockIndex's, set in its __init__ or defined there
        allocator: ExtentAllocator
        namespaces: dict[str, Namespace]
        stats: IndexStats
        _lru: OrderedDict[Slot, None]
        _clock: Callable[[], float]
        _emit: Callable[[IndexEvent], None]

        def namespace(self, namespace_id: str) -> Namespace: ...

        @staticmethod
        def _detach(ns: Namespace, slot: Slot) -> None: ...

        def _release_extent(self, slot: Slot) -> None: ...

    def _reserve(self, need: int, removed: list[Slot]) -> Extent | None:
        """An extent of `need` bytes (a multiple of the granularity), evicting LRU
        rows until one fits; each row evicted is appended to `removed`, for the
        caller to count and announce. None when no room is left to make."""
        alloc, lru = self.allocator, self._lru
        while alloc.largest_free_extent < need:
            if not lru:
                return None
            victim = lru.popitem(last=False)[0]  # the least recently used
            ns = self.namespaces[victim.namespace]
            self._detach(ns, victim)
            removed.append(victim)
            if victim.extent.size == need:  # hand the extent on: no free, no allocate
                ns.used_bytes -= need
                return victim.extent
            self._release_extent(victim)
        return alloc.allocate(need)

    def _remove_ready(self, slot: Slot, reason: EvictionReason) -> None:
        self._lru.pop(slot, None)
        self._detach(self.namespaces[slot.namespace], slot)
        self._release_extent(slot)
        self.stats.evictions[reason] += 1
        self._emit(IndexEvent(slot.namespace, EventKind.REMOVED, (slot.key,), reason))

    def evict(
        self,
        namespace_id: str,
        keys: Iterable[bytes] | None = None,
        reason: EvictionReason = EvictionReason.ADMIN,
    ) -> tuple[int, int]:
        """Evicts READY, unheld blocks (all of the namespace, or `keys`).

        Returns (evicted, skipped): skipped blocks are pinned, being read, or
        still being written.
        """
        ns = self.namespace(namespace_id)
        # dict.fromkeys: a key named twice must not be removed (and freed) twice.
        candidates = (
            list(ns.slots.values())
            if keys is None
            else [s for k in dict.fromkeys(keys) if (s := ns.slots.get(k)) is not None]
        )
        evicted = skipped = 0
        for slot in candidates:
            if slot.state is SlotState.READY and not slot.held:
                self._remove_ready(slot, reason)
                evicted += 1
            else:
                skipped += 1
        return evicted, skipped

    def evict_slice(
        self,
        namespace_id: str,
        after: bytes | None,
        limit: int,
        reason: EvictionReason = EvictionReason.ADMIN,
        budget_s: float | None = None,
    ) -> tuple[int, int, bytes | None]:
        """One slice of a whole-namespace eviction: the READY, unheld blocks among
        the next `limit` keys (in key order) after `after` (None: from the first),
        stopping early once `budget_s` seconds are spent (the cost of freeing an
        extent grows with the pool's fragmentation, so a count alone does not
        bound a slice's time).

        Returns (evicted, skipped, the last key looked at, or None when the walk
        is done). Callers yield to the event loop between slices, so a Clear of
        10^6 blocks never holds the loop for more than one slice; blocks stored
        behind the walk's position meanwhile are left alone.
        """
        ns = self.namespace(namespace_id)
        keys = ns.sorted_keys.after(after, limit)
        deadline = None if budget_s is None else self._clock() + budget_s
        evicted = skipped = 0
        for n, key in enumerate(keys):
            slot = ns.slots.get(key)
            if slot is not None and slot.state is SlotState.READY and not slot.held:
                self._remove_ready(slot, reason)
                evicted += 1
            else:
                skipped += slot is not None
            if deadline is not None and n % 32 == 31 and self._clock() > deadline:
                return evicted, skipped, key
        return evicted, skipped, (keys[-1] if len(keys) == limit else None)

    def evict_cold_slice(
        self, limit: int, budget_s: float, reason: EvictionReason = EvictionReason.CLEAR
    ) -> int:
        """Evicts up to `limit` blocks from the LRU list's cold end, stopping early
        after `budget_s` seconds: one slice of a Clear, which walks the LRU list
        (the evictable blocks, every namespace) rather than the keys, because
        blocks freed in the order they were stored coalesce in the allocator.
        Returns how many it evicted."""
        deadline = self._clock() + budget_s
        n = 0
        while self._lru and n < limit:
            self._remove_ready(next(iter(self._lru)), reason)
            n += 1
            if n % 32 == 0 and self._clock() > deadline:
                break
        return n

    @property
    def evictable_blocks(self) -> int:
        """READY blocks nobody pins, reads or writes (the LRU list's length)."""
        return len(self._lru)

    def unevictable_blocks(self) -> int:
        """Blocks pinned, being read or being written: what a Clear leaves."""
        total = sum(ns.ready_blocks + ns.writing_blocks for ns in self.namespaces.values())
        return total - len(self._lru)

    def clear(self) -> tuple[int, int]:
        evicted = skipped = 0
        for ns_id in list(self.namespaces):
            e, s = self.evict(ns_id, reason=EvictionReason.CLEAR)
            evicted += e
            skipped += s
        return evicted, skipped
