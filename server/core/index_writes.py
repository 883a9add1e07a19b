"""The block index's writing side: reserving rows for store jobs, settling them.

`Writes` is a part of `kvdepot.server.core.index.BlockIndex`, which makes one and
calls it on the daemon's event loop. It owns the rows being written (WRITING), the
rows dropped while a copy is still in flight on them ("doomed"), and each owner's
bytes reserved for writing (the --max-writing-per-session quota); it shares the
index's namespaces, allocator, counters and event sink, makes room through the
index's `Evictions`, and admits each row that becomes READY to the index's
`EvictionPolicy`.

A row of a TP > 1 namespace is whole only when every rank has written its part, and
an engine's ranks store a key once each: a rank that drops a key (no room, its
quota) or writes into a row dropped unfinished does not come back for it. A mate
that came later would begin a row that can never be whole and holds pool space
until `reservation_timeout`; under pressure such rows filled the pool and made
every store after them drop. So the index remembers, per namespace, the keys whose
row ranks gave up (`Namespace.given_up`: which ranks, since when) and a later rank
drops such a key too (DropReason.ROW_GIVEN_UP) instead of beginning a row. A rank
that comes again for a key it gave up starts a new attempt (the mark goes), as does a
tier of the daemon's (`internal_writers`), which claims every rank's part at once. Marks
go when every rank has passed, after `reservation_timeout`, or, oldest first, past
MAX_GIVEN_UP per namespace. Marks are per rank, not per engine: where two engines
of one namespace store the same key, one's mark can drop the other's store (a
cache miss) or fail to stop a row that will not be whole (what happened before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvdepot.server.core.eviction import tail_first
from kvdepot.server.core.index_evict import Evictions
from kvdepot.server.core.index_part import IndexPart, IndexShared
from kvdepot.server.core.index_types import (
    GivenUp,
    IndexEvent,
    Namespace,
    Owner,
    Slot,
    StoreClaim,
)
from kvdepot.server.core.kinds import (
    AbortReason,
    DropReason,
    EventKind,
    EvictionReason,
    SlotState,
)
from kvdepot.server.core.layout import MAX_KEY_BYTES, MIN_KEY_BYTES, LayoutError

# Keys given up remembered per namespace (see the module docstring); past it the
# oldest mark is forgotten (~200 bytes a mark).
MAX_GIVEN_UP = 1 << 16


class Writes(IndexPart):
    """Rows from their reservation to READY or dropped (see BlockIndex's docstring)."""

    def __init__(self, shared: IndexShared, evictions: Evictions) -> None:
        super().__init__(shared)
        self._evictions = evictions
        self.reservation_timeout = 60.0  # seconds a row may stay WRITING
        self.writing: set[Slot] = set()
        self.doomed: set[Slot] = set()  # detached, waiting for copies to end
        # Per owner (session): bytes of the WRITING rows it reserved (Slot.reserver).
        self.owner_writing: dict[Owner, int] = {}
        self.writing_total = 0  # their sum: read per store call (BlockIndex.writing_bytes)
        # Bytes of WRITING rows an owner may still reserve now, its reservations so far
        # (this call's included) taken off (None: no limit): the state's quotas, which
        # count an owner's sessions together and the whole pool.
        self.room_for: Callable[[Owner], int] | None = None
        # A floor under it: room_for(owner) >= room_floor - writing_total for every
        # owner. Most store calls stay above it, and room_for (a sum over the owner's
        # sessions) is asked only when a row would not fit under the floor.
        self.room_floor = 0
        # The daemon's own tiers (not sessions): they claim every rank's section of a
        # row at once, so the quota does not limit them and given-up marks are not
        # theirs to heed or leave (a row they claim is whole when they settle it).
        self.internal_writers: set[Owner] = set()

    def begin_store_many(
        self,
        ns: Namespace,
        keys: Sequence[bytes],
        rank: int,
        owner: Owner,
        groups: Sequence[int] | None = None,
    ) -> StoreClaim:
        """Claims `rank`'s section of each of `keys` for writing (a store job's keys) in `ns`.

        Promises:
        - The namespace, the rank and every key are checked before anything
          changes: UnknownNamespace or LayoutError leaves the index as it was.
        - Key by key, in order, the decision one `begin_store` per key would make:
          WRITE (a fresh WRITING slot, or this rank's part of a row other ranks
          are writing), PRESENT (READY, or this rank's section written or in
          flight, so a key named twice is written once), DROPPED (no room though
          every evictable row was evicted; or a mate rank gave the row up:
          see the module docstring; counted in stats.dropped_stores).
        - Room comes from the eviction policy's victims (the least recently
          used first), as ever; an evicted row whose extent is exactly the size
          wanted hands that extent on (no free and allocate), otherwise it is
          freed and allocation retried.
        - The rows evicted are announced before it returns (REMOVED, reason LRU,
          one event per namespace, keys in eviction order), when no copy into
          the claimed slots can have started: a listener still finds an evicted
          row's bytes in its former extent.
        - If it raises anyway, whatever it had claimed is settled as failed.

        The caller copies into `claim.offsets` and then settles `claim.slots`,
        each once, success or not (finish_store_many). `groups`, when given, is
        each key's group as the job check found it (core.job_check.JobShape.key_groups):
        the keys are then not decoded and checked again.
        """
        layout = ns.layout
        if not 0 <= rank < layout.world_size:
            raise LayoutError(f"rank {rank} out of range [0, {layout.world_size})")
        if groups is None or len(groups) != len(keys):
            decoded: list[int] = []
            of_suffix = layout.group_of_suffix
            for key in keys:  # all of them, before any change
                group = of_suffix.get(key[-4:])  # key_group's test, without a call
                if group is None or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                    group = layout.key_group(key)  # raises, with the reason
                decoded.append(group)
            groups = decoded
        bit = 1 << rank
        namespace_id = layout.id
        slots, sorted_keys, group_blocks = ns.slots, ns.sorted_keys, ns.group_blocks
        given_up, full = ns.given_up, ns.full_mask
        internal = owner in self.internal_writers
        ready = SlotState.READY
        allocator, make_room = self._allocator, self._evictions.make_room
        needs: dict[int, tuple[int, int]] = {}  # group -> (slot bytes, rounded up)
        # Bytes this owner may still reserve (--max-writing-per-session); None: no limit.
        # Until a row would not fit, `budget` is the floor (room_floor), not room_for's
        # figure: room_for is asked then (it counts what this call reserved so far).
        room_for = self.room_for
        budget = None if internal or room_for is None else self.room_floor - self.writing_total
        exact = False  # budget is room_for's own figure
        claim = StoreClaim([], [])
        offsets, writing = claim.offsets, claim.slots
        removed: list[Slot] = []
        now = self._clock()
        try:
            # The per-key path inlined (this runs for every key a store job names).
            for key, group in zip(keys, groups, strict=True):
                slot = slots.get(key)
                if slot is None:
                    if given_up:
                        mark = given_up.get(key)
                        if mark is not None:
                            if internal or mark.mask & bit:  # a whole row, or a new attempt
                                del given_up[key]
                            else:  # a row begun now would never be whole
                                mark.mask |= bit
                                if mark.mask == full:
                                    del given_up[key]
                                self._stats.dropped_stores[DropReason.ROW_GIVEN_UP] += 1
                                claim.dropped += 1
                                claim.drop_reason = DropReason.ROW_GIVEN_UP
                                offsets.append(None)
                                continue
                    sizes = needs.get(group)
                    if sizes is None:
                        size = layout.slot_bytes(group)
                        sizes = needs[group] = (size, allocator.round_up(size))
                    if budget is not None and sizes[1] > budget:
                        if not exact:  # under the floor: the quota's own figure now
                            assert room_for is not None
                            budget, exact = room_for(owner), True
                        if sizes[1] > budget:
                            self._stats.dropped_stores[DropReason.SESSION_QUOTA] += 1
                            self._give_up(ns, key, bit, now)  # (never a tier's: no quota)
                            claim.dropped += 1
                            claim.drop_reason = DropReason.SESSION_QUOTA
                            offsets.append(None)
                            continue
                    extent = make_room(sizes[1], removed, namespace_id)
                    if extent is None:
                        reason = (
                            DropReason.POOL_FULL
                            if allocator.capacity >= sizes[0]
                            else DropReason.ROW_TOO_LARGE
                        )
                        self._stats.dropped_stores[reason] += 1
                        if not internal:
                            self._give_up(ns, key, bit, now)
                        claim.dropped += 1
                        claim.drop_reason = reason
                        offsets.append(None)
                        continue
                    slot = Slot(namespace_id, key, group, extent, now)
                    # Namespace.attach, for a WRITING slot
                    slots[key] = slot
                    sorted_keys.add(key)
                    group_blocks[group] += 1
                    size = extent.size
                    # Charged at once: a failure below settles (and uncharges) it.
                    slot.reserver = owner
                    self.owner_writing[owner] = self.owner_writing.get(owner, 0) + size
                    self.writing_total += size
                    if budget is not None:
                        budget -= size
                    ns.used_bytes += size
                    ns.writing_blocks += 1
                    ns.writing_bytes += size
                    self.writing.add(slot)
                elif slot.state is ready or (slot.written_mask | slot.copying_mask) & bit:
                    claim.present += 1
                    offsets.append(None)
                    continue
                slot.copying_mask |= bit
                if slot.writers is None:
                    slot.writers = {rank: owner}
                else:
                    slot.writers[rank] = owner
                writing.append(slot)
                offsets.append(slot.extent.offset)
        except BaseException:
            self.finish_store_many(writing, rank, False)  # the claim never reaches a caller
            raise
        finally:
            if removed:
                self._stats.evictions[EvictionReason.LRU] += len(removed)
                self._announce(EventKind.REMOVED, removed, EvictionReason.LRU)
        return claim

    def finish_store_many(self, slots: Iterable[Slot], rank: int, ok: bool) -> int:
        """Ends `rank`'s copy into each of `slots` (each named once, each claimed
        by this rank and not yet finished). Returns how many became READY.

        Per slot: a doomed slot's extent is freed once no copy is left on it; on
        failure (`ok` False) the row is dropped (AbortReason.COPY_FAILED), the
        other ranks' sections with it; on success this rank's section counts as
        written, and the row becomes READY (admitted to the eviction policy as
        its most recent use, the rows of one call tail first: eviction.tail_first)
        when every rank's has. The rows that became READY
        are announced before it returns (STORED, one event per namespace, keys
        in order).
        """
        bit = 1 << rank
        keep = ~bit
        became_ready: list[Slot] = []
        namespaces, insert = self._namespaces, self._policy.insert
        ns: Namespace | None = None
        full = 0  # ns.full_mask
        try:
            for slot in slots:
                slot.copying_mask &= keep
                if slot.doomed:
                    self._maybe_free_doomed(slot)
                    continue
                if not ok:
                    self._doom(slot, AbortReason.COPY_FAILED, bit)
                    continue
                slot.written_mask |= bit
                if ns is None or ns.layout.id != slot.namespace:
                    ns = namespaces[slot.namespace]
                    full = ns.full_mask
                if slot.written_mask == full:
                    size = slot.extent.size
                    slot.state = SlotState.READY
                    ns.writing_blocks -= 1
                    ns.writing_bytes -= size
                    ns.ready_blocks += 1
                    ns.ready_bytes += size
                    slot.writers = None
                    self.writing.discard(slot)
                    if slot.reserver is not None:
                        self._end_reservation(slot)
                    became_ready.append(slot)
        finally:
            if became_ready:
                insert(tail_first(became_ready))  # a prefix's head youngest
                self._announce(EventKind.STORED, became_ready)
        return len(became_ready)

    def _announce(
        self, kind: EventKind, slots: list[Slot], reason: EvictionReason | None = None
    ) -> None:
        """One event per namespace for `slots`, keys in the order given (a REMOVED
        event with the rows' chunk events)."""
        namespaces = {slot.namespace for slot in slots}
        if len(namespaces) == 1:  # a job's keys: the usual case
            self._emit(_event(namespaces.pop(), kind, slots, reason))
            return
        by_ns: dict[str, list[Slot]] = {}
        for slot in slots:
            by_ns.setdefault(slot.namespace, []).append(slot)
        for namespace_id, slots_of_ns in by_ns.items():
            self._emit(_event(namespace_id, kind, slots_of_ns, reason))

    def release(self, owner: Owner) -> int:
        """Drops every unfinished row `owner` was writing; returns how many."""
        mine = [s for s in self.writing if s.writers and owner in s.writers.values()]
        for slot in mine:
            self._doom(slot, AbortReason.WRITER_GONE)
        return len(mine)

    def expire_reservations(self) -> int:
        """Drops rows that stayed WRITING longer than reservation_timeout, and forgets
        marks of rows given up longer ago than that."""
        deadline = self._clock() - self.reservation_timeout
        stale = [s for s in self.writing if s.created < deadline]
        for slot in stale:
            self._doom(slot, AbortReason.RESERVATION_TIMEOUT)
        for ns in self._namespaces.values():
            given_up = ns.given_up
            while given_up:  # oldest first: marks are never moved
                key, mark = next(iter(given_up.items()))
                if mark.since >= deadline:
                    break
                del given_up[key]
        return len(stale)

    def _give_up(self, ns: Namespace, key: bytes, ranks: int, now: float) -> None:
        """`ranks` went through `key`'s row and will not come back for it: a mate
        that comes later drops the key (see the module docstring)."""
        if ranks == ns.full_mask:  # every rank has passed (always so at TP=1)
            return
        given_up = ns.given_up
        given_up.pop(key, None)  # (a row adopted over a mark) kept oldest first
        if len(given_up) >= MAX_GIVEN_UP:
            del given_up[next(iter(given_up))]
        given_up[key] = GivenUp(ranks, now)

    def _end_reservation(self, slot: Slot) -> None:
        """The row is settled (READY or dropped): its reserver's charge ends."""
        owner, slot.reserver = slot.reserver, None
        left = self.owner_writing[owner] - slot.extent.size
        self.writing_total -= slot.extent.size
        if left:
            self.owner_writing[owner] = left
        else:
            del self.owner_writing[owner]

    def _doom(self, slot: Slot, reason: AbortReason, failed: int = 0) -> None:
        """Drops an unfinished row (`failed`: the bit of a rank whose copy into it
        failed, already out of its copying mask)."""
        ns = self._namespaces[slot.namespace]
        if ns.slots.get(slot.key) is slot:
            ns.detach(slot)
            passed = slot.written_mask | slot.copying_mask | failed
            self._give_up(ns, slot.key, passed, self._clock())
        self.writing.discard(slot)
        if slot.reserver is not None:
            self._end_reservation(slot)
        slot.doomed = True
        self._stats.aborted_writes[reason] += 1
        self.doomed.add(slot)
        self._maybe_free_doomed(slot)

    def _maybe_free_doomed(self, slot: Slot) -> None:
        if slot.copying_mask == 0 and slot.readers == 0 and slot in self.doomed:
            self.doomed.discard(slot)
            self._namespaces[slot.namespace].used_bytes -= slot.extent.size
            self._allocator.free(slot.extent)


def _event(
    namespace_id: str, kind: EventKind, slots: list[Slot], reason: EvictionReason | None
) -> IndexEvent:
    keys = tuple([slot.key for slot in slots])
    if kind is not EventKind.REMOVED:
        return IndexEvent(namespace_id, kind, keys, reason)
    chunk_events = tuple([slot.chunk_event for slot in slots])
    return IndexEvent(
        namespace_id, kind, keys, reason, chunk_events=chunk_events if any(chunk_events) else ()
    )
