"""The block index: (namespace, key) -> slot, with states, pins and LRU eviction.

Sans-I/O: no sockets, threads or clocks of its own (the clock is injected). Every
change that others must hear about (a key became READY, a READY key was removed)
is handed to `on_event` as it happens, so a subscriber (the daemon's event bus)
never misses one; a call that changes many keys (`begin_store_many`,
`finish_store_many`) hands over its events, one per namespace, before it
returns. The daemon calls the index from its event loop only; copies run
elsewhere, bracketed by `begin_store[_many]`/`finish_store[_many]` and
`begin_read`/`end_read`, which keep a slot's extent allocated for as long as any
copy touches it.

Slot life:
    (none) --begin_store--> WRITING --all ranks finished--> READY --evict--> (none)
A WRITING slot is invisible to lookups. It is dropped ("doomed") when a rank's
copy fails, when a writer's session ends before the row is complete, or when the
reservation outlives `reservation_timeout`; its extent is freed only once no copy
is in flight on it, so a late copy can never land in someone else's slot.
READY slots with no pins and no readers sit in the LRU list; they are the only
ones eviction may take.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.index_check import check_index
from kvdepot.server.core.index_evict import IndexEviction
from kvdepot.server.core.index_types import (
    IndexEvent,
    IndexStats,
    LayoutMismatch,
    Namespace,
    Owner,
    Slot,
    StoreClaim,
    StoreDecision,
    UnknownNamespace,
)
from kvdepot.server.core.kinds import (
    AbortReason,
    DropReason,
    EventKind,
    EvictionReason,
    SlotState,
    StoreOutcome,
)
from kvdepot.server.core.layout import (
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    LayoutError,
    NamespaceLayout,
    check_key,
)

__all__ = [
    "BlockIndex",
    "IndexEvent",
    "IndexStats",
    "LayoutMismatch",
    "Namespace",
    "Slot",
    "SlotState",
    "StoreClaim",
    "StoreDecision",
    "StoreOutcome",
    "UnknownNamespace",
]


class BlockIndex(IndexEviction):
    """Owns the allocator and every slot; emits stored/removed events. Its
    eviction (room for a store, Evict, Clear) is in kvdepot.server.core.index_evict."""

    def __init__(
        self,
        allocator: ExtentAllocator,
        *,
        reservation_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[IndexEvent], None] | None = None,
    ) -> None:
        """`on_event` receives each event as it happens; without it, events
        collect until `take_events` (direct use, tests)."""
        self.allocator = allocator
        self.reservation_timeout = reservation_timeout
        self._clock = clock
        self.namespaces: dict[str, Namespace] = {}
        self._lru: OrderedDict[Slot, None] = OrderedDict()  # evictable, oldest first
        self._doomed: set[Slot] = set()  # detached, waiting for copies to end
        self._pins_by_owner: dict[Owner, Counter] = {}  # owner -> Counter[Slot]
        self._writing: set[Slot] = set()
        self._events: list[IndexEvent] = []
        self._emit = self._events.append if on_event is None else on_event
        self.stats = IndexStats()
        self.pinned_bytes = 0
        # Per owner (session): bytes of the distinct slots it pins, and bytes of the
        # WRITING rows it reserved (Slot.reserver), for the per-session quotas.
        self._owner_pinned: dict[Owner, int] = {}
        self._owner_writing: dict[Owner, int] = {}
        # Bytes of WRITING rows one owner may reserve (None: no limit); owners in
        # `writing_quota_exempt` (the daemon's own tiers) are not limited.
        self.max_writing_per_owner: int | None = None
        self.writing_quota_exempt: set[Owner] = set()
        # Crash recovery: extents claimed for rows a journal lists, invisible until
        # their bytes are verified (adopt_recovered) or dropped (drop_recovering).
        self.recovering: dict[int, Extent] = {}

    # -- namespaces ------------------------------------------------------------------

    def declare_namespace(self, layout: NamespaceLayout) -> Namespace:
        """Creates the namespace, or checks that `layout` matches the existing one."""
        ns = self.namespaces.get(layout.id)
        if ns is None:
            for g in range(layout.num_groups):
                if self.allocator.round_up(layout.slot_bytes(g)) > self.allocator.capacity:
                    raise LayoutError(
                        f"group {g}'s block row is {layout.slot_bytes(g)} bytes, more than the "
                        f"whole pool ({self.allocator.capacity} bytes): raise --pool-size"
                    )
            ns = self.namespaces[layout.id] = Namespace(layout)
        elif not ns.layout.same_bytes_as(layout):
            raise LayoutMismatch(
                f"namespace {layout.id} exists with another layout (world_size "
                f"{ns.layout.world_size}, blocks_per_chunk {ns.layout.blocks_per_chunk}, "
                f"{ns.layout.num_groups} group(s)); a namespace id must pin down one byte "
                f"layout: derive it from every layout parameter"
            )
        return ns

    def forget_namespace(self, namespace_id: str) -> bool:
        """Drops a namespace that holds nothing (no slot, no extent still being
        freed); True if it was dropped. Its layout can be large: an unused one
        must not stay for the daemon's life."""
        ns = self.namespaces.get(namespace_id)
        if ns is None or ns.slots or ns.used_bytes:
            return False
        del self.namespaces[namespace_id]
        return True

    def owner_pinned_bytes(self, owner: Owner) -> int:
        """Bytes of the distinct slots `owner` holds at least one pin on."""
        return self._owner_pinned.get(owner, 0)

    def owner_writing_bytes(self, owner: Owner) -> int:
        """Bytes of the WRITING rows `owner` reserved and that are not settled yet."""
        return self._owner_writing.get(owner, 0)

    def namespace(self, namespace_id: str) -> Namespace:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise UnknownNamespace(
                f"unknown namespace {namespace_id!r}: no engine has registered it (RegisterKV "
                f"declares a namespace)"
            )
        return ns

    # -- lookups and pins --------------------------------------------------------------

    def lookup(self, namespace_id: str, keys: Iterable[bytes]) -> list[bool]:
        ns = self.namespace(namespace_id)
        out = []
        for key in keys:
            slot = ns.slots.get(key)
            ready = slot is not None and slot.state is SlotState.READY
            out.append(ready)
        hits = sum(out)
        self.stats.lookups += len(out)
        self.stats.hits += hits
        self.stats.misses += len(out) - hits
        return out

    def pin(self, namespace_id: str, keys: Iterable[bytes], owner: Owner) -> list[bool]:
        """Pins each READY key once more for `owner` (not evictable while pinned);
        returns, per key, whether it was pinned (False: absent or not READY)."""
        ns = self.namespace(namespace_id)
        # The per-key work inlined: a step's Pin names up to thousands of keys, and
        # the scheduler waits for it.
        get, ready, lru_pop = ns.slots.get, SlotState.READY, self._lru.pop
        owned = self._pins_by_owner.get(owner)
        if owned is None:
            owned = Counter()
        out = []
        first_pins = first_bytes = owner_bytes = 0
        for key in keys:
            slot = get(key)
            if slot is None or slot.state is not ready:
                out.append(False)
                continue
            pins = slot.pins
            if not pins:
                if not slot.readers:  # not held: it is on the LRU list
                    lru_pop(slot, None)
                first_pins += 1
                first_bytes += slot.extent.size
            pins[owner] = pins.get(owner, 0) + 1
            held = owned.get(slot, 0)  # not owned[slot]: Counter.__missing__ is Python
            owned[slot] = held + 1
            if not held:
                owner_bytes += slot.extent.size
            out.append(True)
        if owned:
            self._pins_by_owner[owner] = owned
        if owner_bytes:
            self._owner_pinned[owner] = self._owner_pinned.get(owner, 0) + owner_bytes
        self.pinned_bytes += first_bytes
        ns.pinned_blocks += first_pins
        ns.pinned_bytes += first_bytes
        pinned = len(out) - out.count(False)
        self.stats.pin_calls += 1
        self.stats.pin_keys += len(out)
        self.stats.pinned_keys += pinned
        return out

    def unpin(self, namespace_id: str, keys: Iterable[bytes], owner: Owner) -> int:
        """Drops one pin per key; returns how many keys `owner` had not pinned."""
        ns = self.namespace(namespace_id)
        owned = self._pins_by_owner.get(owner)
        missing = 0
        for key in keys:
            slot = ns.slots.get(key)
            if slot is None or owned is None or owned[slot] <= 0:
                missing += 1
                continue
            self._drop_pin(slot, owner)
        return missing

    def _drop_pin(self, slot: Slot, owner: Owner) -> None:
        slot.pins[owner] -= 1
        if slot.pins[owner] <= 0:
            del slot.pins[owner]
        owned = self._pins_by_owner[owner]
        owned[slot] -= 1
        if owned[slot] <= 0:
            del owned[slot]
            self._owner_pinned[owner] -= slot.extent.size
            if not owned:
                del self._pins_by_owner[owner]
                del self._owner_pinned[owner]
        if not slot.pins:
            self.pinned_bytes -= slot.extent.size
            ns = self.namespaces[slot.namespace]
            ns.pinned_blocks -= 1
            ns.pinned_bytes -= slot.extent.size
        self._maybe_evictable(slot)

    def _maybe_evictable(self, slot: Slot) -> None:
        if slot.state is SlotState.READY and not slot.held and not slot.doomed:
            self._lru[slot] = None
            self._lru.move_to_end(slot)

    # -- stores ----------------------------------------------------------------------

    def begin_store(self, namespace_id: str, key: bytes, rank: int, owner: Owner) -> StoreDecision:
        """Claims `rank`'s section of `key` for writing, reserving a slot if needed:
        `begin_store_many` for one key. A PRESENT decision carries the key's slot."""
        claim = self.begin_store_many(namespace_id, (key,), rank, owner)
        if claim.slots:
            return StoreDecision(StoreOutcome.WRITE, claim.slots[0])
        if claim.present:
            return StoreDecision(StoreOutcome.PRESENT, self.namespaces[namespace_id].slots[key])
        return StoreDecision(StoreOutcome.DROPPED, None, claim.drop_reason)

    def begin_store_many(
        self, namespace_id: str, keys: Sequence[bytes], rank: int, owner: Owner
    ) -> StoreClaim:
        """Claims `rank`'s section of each of `keys` for writing (a store job's keys).

        Promises:
        - The namespace, the rank and every key are checked before anything
          changes: UnknownNamespace or LayoutError leaves the index as it was.
        - Key by key, in order, the decision one `begin_store` per key would make:
          WRITE (a fresh WRITING slot, or this rank's part of a row other ranks
          are writing), PRESENT (READY, or this rank's section written or in
          flight, so a key named twice is written once), DROPPED (no room though
          every evictable row was evicted; counted in stats.dropped_stores).
        - Room comes from the LRU list's cold end, as ever; an evicted row whose
          extent is exactly the size wanted hands that extent on (no free and
          allocate), otherwise it is freed and allocation retried.
        - The rows evicted are announced before it returns (REMOVED, reason LRU,
          one event per namespace, keys in eviction order), when no copy into
          the claimed slots can have started: a listener still finds an evicted
          row's bytes in its former extent.
        - If it raises anyway, whatever it had claimed is settled as failed.

        The caller copies into `claim.offsets` and then settles `claim.slots`,
        each once, success or not (finish_store_many).
        """
        ns = self.namespace(namespace_id)
        layout = ns.layout
        if not 0 <= rank < layout.world_size:
            raise LayoutError(f"rank {rank} out of range [0, {layout.world_size})")
        num_groups = layout.num_groups
        groups: list[int] = []
        for key in keys:  # all of them, before any change
            group = int.from_bytes(key[-4:], "big")  # check_key's test, without two calls a key
            if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES or group >= num_groups:
                group = check_key(key, num_groups)  # raises, with the reason
            groups.append(group)
        bit = 1 << rank
        slots, sorted_keys, group_blocks = ns.slots, ns.sorted_keys, ns.group_blocks
        ready = SlotState.READY
        needs: dict[int, tuple[int, int]] = {}  # group -> (slot bytes, rounded up)
        # Bytes this owner may still reserve (--max-writing-per-session); None: no limit.
        budget = self.max_writing_per_owner
        if budget is not None and owner not in self.writing_quota_exempt:
            budget -= self._owner_writing.get(owner, 0)
        else:
            budget = None
        claim = StoreClaim([], [])
        offsets, writing = claim.offsets, claim.slots
        removed: list[Slot] = []
        now = self._clock()
        try:
            # The per-key path inlined (this runs for every key a store job names).
            for key, group in zip(keys, groups, strict=True):
                slot = slots.get(key)
                if slot is None:
                    sizes = needs.get(group)
                    if sizes is None:
                        size = layout.slot_bytes(group)
                        sizes = needs[group] = (size, self.allocator.round_up(size))
                    if budget is not None and sizes[1] > budget:
                        self.stats.dropped_stores[DropReason.SESSION_QUOTA] += 1
                        claim.dropped += 1
                        claim.drop_reason = DropReason.SESSION_QUOTA
                        offsets.append(None)
                        continue
                    extent = self._reserve(sizes[1], removed)
                    if extent is None:
                        reason = (
                            DropReason.POOL_FULL
                            if self.allocator.capacity >= sizes[0]
                            else DropReason.ROW_TOO_LARGE
                        )
                        self.stats.dropped_stores[reason] += 1
                        claim.dropped += 1
                        claim.drop_reason = reason
                        offsets.append(None)
                        continue
                    slot = Slot(namespace_id, key, group, extent, now)
                    # _attach, for a WRITING slot
                    slots[key] = slot
                    sorted_keys.add(key)
                    group_blocks[group] += 1
                    size = extent.size
                    # Charged at once: a failure below settles (and uncharges) it.
                    slot.reserver = owner
                    self._owner_writing[owner] = self._owner_writing.get(owner, 0) + size
                    if budget is not None:
                        budget -= size
                    ns.used_bytes += size
                    ns.writing_blocks += 1
                    ns.writing_bytes += size
                    self._writing.add(slot)
                elif slot.state is ready or (slot.written_mask | slot.copying_mask) & bit:
                    claim.present += 1
                    offsets.append(None)
                    continue
                slot.copying_mask |= bit
                slot.writers[rank] = owner
                writing.append(slot)
                offsets.append(slot.extent.offset)
        except BaseException:
            self.finish_store_many(writing, rank, False)  # the claim never reaches a caller
            raise
        finally:
            if removed:
                self.stats.evictions[EvictionReason.LRU] += len(removed)
                self._announce(EventKind.REMOVED, removed, EvictionReason.LRU)
        return claim

    def finish_store(self, slot: Slot, rank: int, ok: bool) -> bool:
        """Ends `rank`'s copy into `slot`. Returns True if the slot became READY."""
        return self.finish_store_many((slot,), rank, ok) == 1

    def finish_store_many(self, slots: Iterable[Slot], rank: int, ok: bool) -> int:
        """Ends `rank`'s copy into each of `slots` (each named once, each claimed
        by this rank and not yet finished). Returns how many became READY.

        Per slot: a doomed slot's extent is freed once no copy is left on it; on
        failure (`ok` False) the row is dropped (AbortReason.COPY_FAILED), the
        other ranks' sections with it; on success this rank's section counts as
        written, and the row becomes READY (evictable, at the LRU list's young
        end) when every rank's has. The rows that became READY are announced
        before it returns (STORED, one event per namespace, keys in order).
        """
        bit = 1 << rank
        keep = ~bit
        became_ready: list[Slot] = []
        ns: Namespace | None = None
        full = 0  # ns.full_mask
        try:
            for slot in slots:
                slot.copying_mask &= keep
                if slot.doomed:
                    self._maybe_free_doomed(slot)
                    continue
                if not ok:
                    self._doom(slot, AbortReason.COPY_FAILED)
                    continue
                slot.written_mask |= bit
                if ns is None or ns.layout.id != slot.namespace:
                    ns = self.namespaces[slot.namespace]
                    full = ns.full_mask
                if slot.written_mask == full:
                    size = slot.extent.size
                    slot.state = SlotState.READY
                    ns.writing_blocks -= 1
                    ns.writing_bytes -= size
                    ns.ready_blocks += 1
                    ns.ready_bytes += size
                    slot.writers.clear()
                    self._writing.discard(slot)
                    if slot.reserver is not None:
                        self._end_reservation(slot)
                    self._lru[slot] = None
                    became_ready.append(slot)
        finally:
            if became_ready:
                self._announce(EventKind.STORED, became_ready)
        return len(became_ready)

    def _announce(
        self, kind: EventKind, slots: list[Slot], reason: EvictionReason | None = None
    ) -> None:
        """One event per namespace for `slots`, keys in the order given."""
        namespaces = {slot.namespace for slot in slots}
        if len(namespaces) == 1:  # a job's keys: the usual case
            keys = tuple([slot.key for slot in slots])
            self._emit(IndexEvent(namespaces.pop(), kind, keys, reason))
            return
        by_ns: dict[str, list[bytes]] = {}
        for slot in slots:
            by_ns.setdefault(slot.namespace, []).append(slot.key)
        for namespace_id, keys_of_ns in by_ns.items():
            self._emit(IndexEvent(namespace_id, kind, tuple(keys_of_ns), reason))

    # -- loads -----------------------------------------------------------------------

    def begin_read(self, namespace_id: str, key: bytes) -> Slot | None:
        """A READY slot held against eviction until end_read; None if not ready."""
        ns = self.namespace(namespace_id)
        slot = ns.slots.get(key)
        if slot is None or slot.state is not SlotState.READY:
            return None
        self._lru.pop(slot, None)
        slot.readers += 1
        return slot

    def end_read(self, slot: Slot) -> None:
        slot.readers -= 1
        self._maybe_evictable(slot)  # a read counts as a use: to the LRU's young end

    # -- sessions and expiry ------------------------------------------------------------

    def release_owner(self, owner: Owner) -> tuple[int, int]:
        """Drops every pin of `owner` and every unfinished row it was writing.

        Returns (pins dropped, reservations dropped).
        """
        pins = 0
        for slot, count in list(self._pins_by_owner.get(owner, Counter()).items()):
            for _ in range(count):
                self._drop_pin(slot, owner)
                pins += 1
        dropped = 0
        for slot in [s for s in self._writing if owner in s.writers.values()]:
            self._doom(slot, AbortReason.WRITER_GONE)
            dropped += 1
        return pins, dropped

    def expire_reservations(self) -> int:
        """Drops rows that stayed WRITING longer than reservation_timeout."""
        deadline = self._clock() - self.reservation_timeout
        stale = [s for s in self._writing if s.created < deadline]
        for slot in stale:
            self._doom(slot, AbortReason.RESERVATION_TIMEOUT)
        return len(stale)

    def _end_reservation(self, slot: Slot) -> None:
        """The row is settled (READY or dropped): its reserver's charge ends."""
        owner, slot.reserver = slot.reserver, None
        left = self._owner_writing[owner] - slot.extent.size
        if left:
            self._owner_writing[owner] = left
        else:
            del self._owner_writing[owner]

    def _doom(self, slot: Slot, reason: AbortReason) -> None:
        ns = self.namespaces[slot.namespace]
        if ns.slots.get(slot.key) is slot:
            self._detach(ns, slot)
        self._writing.discard(slot)
        if slot.reserver is not None:
            self._end_reservation(slot)
        slot.doomed = True
        self.stats.aborted_writes[reason] += 1
        self._doomed.add(slot)
        self._maybe_free_doomed(slot)

    def _maybe_free_doomed(self, slot: Slot) -> None:
        if slot.copying_mask == 0 and slot.readers == 0 and slot in self._doomed:
            self._doomed.discard(slot)
            self._release_extent(slot)

    # -- slot bookkeeping ------------------------------------------------------------

    @staticmethod
    def _attach(ns: Namespace, slot: Slot) -> None:
        """Puts `slot` into `ns` and counts it (by its state)."""
        ns.slots[slot.key] = slot
        ns.sorted_keys.add(slot.key)
        ns.used_bytes += slot.extent.size
        ns.group_blocks[slot.group] += 1
        if slot.state is SlotState.READY:
            ns.ready_blocks += 1
            ns.ready_bytes += slot.extent.size
        else:
            ns.writing_blocks += 1
            ns.writing_bytes += slot.extent.size

    @staticmethod
    def _detach(ns: Namespace, slot: Slot) -> None:
        """Takes `slot` out of `ns` and its counts; used_bytes stays until the
        extent is freed."""
        del ns.slots[slot.key]
        ns.sorted_keys.remove(slot.key)
        ns.group_blocks[slot.group] -= 1
        if slot.state is SlotState.READY:
            ns.ready_blocks -= 1
            ns.ready_bytes -= slot.extent.size
        else:
            ns.writing_blocks -= 1
            ns.writing_bytes -= slot.extent.size

    def _release_extent(self, slot: Slot) -> None:
        self.namespaces[slot.namespace].used_bytes -= slot.extent.size
        self.allocator.free(slot.extent)

    # -- events and introspection --------------------------------------------------------

    def take_events(self) -> list[IndexEvent]:
        """Events collected since the last call (only without `on_event`)."""
        events = list(self._events)
        self._events.clear()  # in place: `_emit` may be this list's append
        return events

    def counts(self) -> dict[str, int]:
        """Blocks by state, from the namespaces' counters: O(namespaces)."""
        ready = writing = pinned = 0
        for ns in self.namespaces.values():
            ready += ns.ready_blocks
            writing += ns.writing_blocks
            pinned += ns.pinned_blocks
        return {"ready": ready, "writing": writing, "pinned": pinned, "doomed": len(self._doomed)}

    def pinned_slot_count(self, owner: Owner) -> int:
        """How many distinct slots `owner` holds at least one pin on (for reporting)."""
        return len(self._pins_by_owner.get(owner, ()))

    def ready_slots(self) -> list[Slot]:
        return [
            s
            for ns in self.namespaces.values()
            for s in ns.slots.values()
            if s.state is SlotState.READY
        ]

    def ready_slots_by_age(self) -> list[Slot]:
        """READY slots, least recently used first; held (pinned, read) ones last."""
        held = [s for s in self.ready_slots() if s.held]
        return [*self._lru, *held]

    # -- warm restart ----------------------------------------------------------------

    def claim_recovering(self, offset: int, size: int) -> Extent:
        """Claims `[offset, offset+size)` for a row that a crash journal lists, so
        no store lands there while its bytes are verified. Raises OutOfSpace or
        ValueError when the range is not free (the journal is inconsistent)."""
        extent = self.allocator.allocate_at(offset, size)
        self.recovering[extent.offset] = extent
        return extent

    def drop_recovering(self, extent: Extent) -> None:
        """Frees a claimed extent whose row failed verification (or was stored
        again meanwhile)."""
        del self.recovering[extent.offset]
        self.allocator.free(extent)

    def adopt_recovered(self, namespace_id: str, key: bytes, extent: Extent) -> Slot | None:
        """Makes a verified row READY and announces it (STORED), as a store
        would. Returns None, freeing the extent, when the key is present already
        (an engine stored it during the verification) or does not fit the layout."""
        del self.recovering[extent.offset]
        ns = self.namespaces.get(namespace_id)
        try:
            if ns is None or key in ns.slots:
                raise LayoutError("present already")
            slot = self.adopt_ready(namespace_id, key, extent)
        except LayoutError:
            self.allocator.free(extent)
            return None
        self._emit(IndexEvent(namespace_id, EventKind.STORED, (key,)))
        return slot

    def adopt_ready(self, namespace_id: str, key: bytes, extent: Extent) -> Slot:
        """Inserts a READY slot over `extent`, which the caller has just claimed from
        this index's allocator (`allocate_at`): a warm restart re-creating its slots.

        The slot joins the young end of the LRU list and emits no event. Raises
        LayoutError (the caller frees nothing: it discards the whole index) when
        the key does not fit the namespace, is present already, or the extent is
        not the namespace's slot size for the key's group.
        """
        ns = self.namespace(namespace_id)
        group = check_key(key, ns.layout.num_groups)
        if key in ns.slots:
            raise LayoutError(f"key {key.hex()[:16]}… appears twice in namespace {namespace_id}")
        want = self.allocator.round_up(ns.layout.slot_bytes(group))
        if extent.size != want:
            raise LayoutError(
                f"slot of {extent.size} bytes for a group-{group} row of {want} bytes"
            )
        slot = Slot(
            namespace_id,
            key,
            group,
            extent,
            self._clock(),
            state=SlotState.READY,
            written_mask=ns.full_mask,
        )
        self._attach(ns, slot)
        self._lru[slot] = None
        return slot

    def check_invariants(self) -> None:
        """Raises AssertionError when index and allocator disagree (see
        kvdepot.server.core.index_check)."""
        check_index(self)
