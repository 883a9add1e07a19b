"""The block index's evicting: room for a store, Admin/Evict and Admin/Clear.

`Evictions` is a part of `kvdepot.server.core.index.BlockIndex`, which makes one
and calls it (on the daemon's event loop, like every index call); it shares the
index's namespaces, allocator, counters and event sink, and asks the index's
`EvictionPolicy` (kvdepot.server.core.eviction) which row goes next. A row leaves
the index here only when READY and unheld (no pin, no reader, so admitted to the
policy) and not kept in place (`Slot.kept`: a tier is writing it behind, and
eviction passes over it); each removal is counted and announced (REMOVED) with its
reason.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvdepot.server.core.allocator import Extent
from kvdepot.server.core.index_part import IndexPart
from kvdepot.server.core.index_types import IndexEvent, Namespace, Slot
from kvdepot.server.core.kinds import EventKind, EvictionReason, SlotState

# Rows protected by their namespace's share passed over in one search for room.
MAX_SPARED = 4096


class Evictions(IndexPart):
    """Removes evictable rows: the policy's victims for room, or named ones."""

    def make_room(self, need: int, removed: list[Slot], for_namespace: str = "") -> Extent | None:
        """An extent of `need` bytes (a multiple of the granularity) for a row of
        `for_namespace`, evicting the policy's victims until one fits; each row evicted
        is appended to `removed`, for the caller to count and announce. None when no
        room is left to make.

        Rows passed over stay where they were in the policy's order:
        - a row kept in place (`Slot.kept`: a tier is writing it behind);
        - shares (`Namespace.share_bytes`, the operator's --namespace-share): a row of
          a namespace that holds no more than its share, when another namespace needs
          room. At most MAX_SPARED such rows are passed over in one call (then the
          store is dropped: room is made only from rows nobody's share protects)."""
        alloc = self._allocator
        if alloc.largest_free_extent >= need:  # room already: nothing to evict
            return alloc.allocate(need)
        pop_victim, namespaces = self._policy.pop_victim, self._namespaces
        passed: list[Slot] | None = None  # made for the first row passed over (rare)
        spared = 0
        try:
            while alloc.largest_free_extent < need:
                victim = pop_victim()
                if victim is None:
                    return None
                ns = namespaces[victim.namespace]
                if victim.kept or (
                    ns.share_bytes
                    and ns.used_bytes <= ns.share_bytes
                    and victim.namespace != for_namespace
                ):
                    if passed is None:
                        passed = []
                    passed.append(victim)
                    if not victim.kept:  # spared by its namespace's share
                        spared += 1
                        if spared >= MAX_SPARED:
                            return None
                    continue
                ns.detach(victim)
                ns.evicted_blocks += 1
                removed.append(victim)
                if victim.extent.size == need:  # hand the extent on: no free, no allocate
                    ns.used_bytes -= need
                    return victim.extent
                ns.used_bytes -= victim.extent.size
                alloc.free(victim.extent)
            return alloc.allocate(need)
        finally:
            if passed:
                self._put_back(passed)

    def _put_back(self, passed: list[Slot]) -> None:
        """Rows popped off the policy and passed over, back where they were: the
        coldest first."""
        admit_coldest = self._policy.admit_coldest
        for slot in reversed(passed):
            admit_coldest(slot)

    def _remove(self, slot: Slot, reason: EvictionReason) -> None:
        """Removes a READY row already withdrawn from (or popped off) the policy."""
        ns = self._namespaces[slot.namespace]
        ns.detach(slot)
        ns.used_bytes -= slot.extent.size
        self._allocator.free(slot.extent)
        self._stats.evictions[reason] += 1
        chunk_events = (slot.chunk_event,) if slot.chunk_event else ()
        self._emit(
            IndexEvent(
                slot.namespace, EventKind.REMOVED, (slot.key,), reason, chunk_events=chunk_events
            )
        )

    def evict(
        self, ns: Namespace, keys: Iterable[bytes] | None, reason: EvictionReason
    ) -> tuple[int, int]:
        """Evicts READY, unheld blocks of `ns` (all of them, or `keys`).

        Returns (evicted, skipped): skipped blocks are pinned, being read, or
        still being written.
        """
        # dict.fromkeys: a key named twice must not be removed (and freed) twice.
        candidates = (
            list(ns.slots.values())
            if keys is None
            else [s for k in dict.fromkeys(keys) if (s := ns.slots.get(k)) is not None]
        )
        evicted = skipped = 0
        for slot in candidates:
            if slot.state is SlotState.READY and not slot.held and not slot.kept:
                self._policy.withdraw(slot)
                self._remove(slot, reason)
                evicted += 1
            else:
                skipped += 1
        return evicted, skipped

    def evict_slice(
        self,
        ns: Namespace,
        after: bytes | None,
        limit: int,
        reason: EvictionReason,
        budget_s: float | None,
    ) -> tuple[int, int, bytes | None]:
        """One slice of a whole-namespace eviction of `ns`: the READY, unheld blocks among
        the next `limit` keys (in key order) after `after` (None: from the first),
        stopping early once `budget_s` seconds are spent (the cost of freeing an
        extent grows with the pool's fragmentation, so a count alone does not
        bound a slice's time).

        Returns (evicted, skipped, the last key looked at, or None when the walk
        is done). Callers yield to the event loop between slices, so a Clear of
        10^6 blocks never holds the loop for more than one slice; blocks stored
        behind the walk's position meanwhile are left alone.
        """
        keys = ns.sorted_keys.after(after, limit)
        deadline = None if budget_s is None else self._clock() + budget_s
        evicted = skipped = 0
        for n, key in enumerate(keys):
            slot = ns.slots.get(key)
            if (
                slot is not None
                and slot.state is SlotState.READY
                and not slot.held
                and not slot.kept
            ):
                self._policy.withdraw(slot)
                self._remove(slot, reason)
                evicted += 1
            else:
                skipped += slot is not None
            if deadline is not None and n % 32 == 31 and self._clock() > deadline:
                return evicted, skipped, key
        return evicted, skipped, (keys[-1] if len(keys) == limit else None)

    def evict_cold_slice(self, limit: int, budget_s: float, reason: EvictionReason) -> int:
        """Evicts up to `limit` of the policy's victims (least recently used
        first; rows kept in place are passed over), stopping early after
        `budget_s` seconds: one slice of a Clear, which walks the evictable blocks
        of every namespace rather than the keys, because blocks freed in the order
        they were stored coalesce in the allocator. Returns how many it evicted."""
        deadline = self._clock() + budget_s
        n = 0
        passed: list[Slot] = []
        try:
            while n < limit:
                victim = self._policy.pop_victim()
                if victim is None:
                    break
                if victim.kept:
                    passed.append(victim)
                    continue
                self._remove(victim, reason)
                n += 1
                if n % 32 == 0 and self._clock() > deadline:
                    break
        finally:
            self._put_back(passed)
        return n

    def unevictable_blocks(self) -> int:
        """Blocks pinned, being read or being written: what a Clear leaves."""
        total = sum(ns.ready_blocks + ns.writing_blocks for ns in self._namespaces.values())
        return total - len(self._policy)

    def clear(self) -> tuple[int, int]:
        evicted = skipped = 0
        for ns in list(self._namespaces.values()):
            e, s = self.evict(ns, None, EvictionReason.CLEAR)
            evicted += e
            skipped += s
        return evicted, skipped
