"""The block index: (namespace, key) -> slot, with states, pins and eviction.

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
READY slots with no pins and no readers are admitted to the eviction policy
(`kvdepot.server.core.eviction`, least recently used first); they are the only
ones eviction may take, but for those a tier is writing behind (`begin_keep`:
they keep their place in the order, and eviction passes over them).

`BlockIndex` owns the namespaces, the allocator and the policy, and hands three
jobs to parts it owns and calls: `Writes` (index_writes: reservations, stores
settling, dropped rows), `Pins` (index_pins) and `Evictions` (index_evict: room
for a store, Evict, Clear).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.eviction import EvictionPolicy, LruPolicy, tail_first
from kvdepot.server.core.index_check import check_index
from kvdepot.server.core.index_evict import Evictions
from kvdepot.server.core.index_part import IndexShared
from kvdepot.server.core.index_pins import Pins
from kvdepot.server.core.index_recovery import Recovery
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
from kvdepot.server.core.index_writes import Writes
from kvdepot.server.core.kinds import EvictionReason, SlotState, StoreOutcome
from kvdepot.server.core.layout import LayoutError, NamespaceLayout
from kvdepot.server.core.shares import NamespaceShares

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


class BlockIndex:
    """Owns the allocator, every slot and the eviction policy; emits stored/removed
    events (see the module docstring)."""

    def __init__(
        self,
        allocator: ExtentAllocator,
        *,
        reservation_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[IndexEvent], None] | None = None,
        policy: EvictionPolicy | None = None,
        shares: NamespaceShares | None = None,
    ) -> None:
        """`on_event` receives each event as it happens; without it, events
        collect until `take_events` (direct use, tests). `policy` orders the
        evictable rows (default: least recently used first); `shares`, the pool each
        namespace is guaranteed (kvdepot.server.core.shares; default: none)."""
        self.allocator = allocator
        self.shares = shares or NamespaceShares()
        self.namespaces: dict[str, Namespace] = {}
        self._policy: EvictionPolicy = LruPolicy() if policy is None else policy
        self.coldest = self._policy.__iter__  # evictable rows, next victim first, lazily
        self._events: list[IndexEvent] = []
        self._emit = self._events.append if on_event is None else on_event
        self.stats = IndexStats()
        # The parts, each sharing the namespaces dict, allocator, policy and counters.
        shared = IndexShared(
            self.namespaces, allocator, self._policy, self.stats, self._emit, clock
        )
        self._evictions = Evictions(shared)
        self._writes = Writes(shared, self._evictions)
        self._writes.reservation_timeout = reservation_timeout
        self._pins = Pins(shared)
        self._recovery = Recovery(shared)

    # -- namespaces and quotas -----------------------------------------------------

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
            ns.share_bytes = int(self.shares.fraction_for(layout.id) * self.allocator.capacity)
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

    def namespace(self, namespace_id: str) -> Namespace:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise UnknownNamespace(
                f"unknown namespace {namespace_id!r}: no engine has registered it (RegisterKV "
                f"declares a namespace)"
            )
        return ns

    @property
    def writing_room(self) -> Callable[[Owner], int] | None:
        """Bytes of WRITING rows an owner may still reserve, its reservations so far
        taken off (None: no limit); asked by a store call when a row would not fit
        under `writing_floor`, then as its rows are reserved. The state's quotas: they
        count an owner's sessions together and the whole pool
        (kvdepot.server.state.namespaces)."""
        return self._writes.room_for

    @writing_room.setter
    def writing_room(self, room_for: Callable[[Owner], int] | None) -> None:
        self._writes.room_for = room_for

    @property
    def writing_floor(self) -> int:
        """A floor under `writing_room`: writing_room(owner) >= writing_floor less the
        bytes of every WRITING row, for every owner. A store call whose rows fit under
        it does not ask writing_room (0, the default: it always asks)."""
        return self._writes.room_floor

    @writing_floor.setter
    def writing_floor(self, floor: int) -> None:
        self._writes.room_floor = floor

    @property
    def internal_writers(self) -> set[Owner]:
        """Owners that are the daemon's own tiers, not sessions: they claim every rank's
        section of a row at once; writing_room does not limit them, and they
        neither heed nor leave given-up marks (index_writes)."""
        return self._writes.internal_writers

    @internal_writers.setter
    def internal_writers(self, owners: set[Owner]) -> None:
        self._writes.internal_writers = owners

    def owner_writing_bytes(self, owner: Owner) -> int:
        """Bytes of the WRITING rows `owner` reserved and that are not settled yet."""
        return self._writes.owner_writing.get(owner, 0)

    def writing_bytes(self) -> int:
        """Bytes of the WRITING rows sessions reserved (the daemon's tiers' not counted)."""
        writes = self._writes
        total, mine = writes.writing_total, writes.owner_writing
        for owner in writes.internal_writers:  # a few: the tiers
            total -= mine.get(owner, 0)
        return total

    def owner_pinned_bytes(self, owner: Owner) -> int:
        """Bytes of the distinct slots `owner` holds at least one pin on."""
        return self._pins.owner_bytes.get(owner, 0)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the slots with at least one pin."""
        return self._pins.pinned_bytes

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
        return self._pins.pin(self.namespace(namespace_id), keys, owner)

    def unpin(self, namespace_id: str, keys: Iterable[bytes], owner: Owner) -> int:
        """Drops one pin per key; returns how many keys `owner` had not pinned."""
        return self._pins.unpin(self.namespace(namespace_id), keys, owner)

    # -- stores ----------------------------------------------------------------------

    def begin_store(self, namespace_id: str, key: bytes, rank: int, owner: Owner) -> StoreDecision:
        """Claims `rank`'s section of `key` for writing, reserving a slot if needed:
        `begin_store_many` for one key. A PRESENT decision carries the key's slot."""
        claim = self._writes.begin_store_many(self.namespace(namespace_id), (key,), rank, owner)
        if claim.slots:
            return StoreDecision(StoreOutcome.WRITE, claim.slots[0])
        if claim.present:
            return StoreDecision(StoreOutcome.PRESENT, self.namespaces[namespace_id].slots[key])
        return StoreDecision(StoreOutcome.DROPPED, None, claim.drop_reason)

    def begin_store_many(
        self,
        ns_id: str,
        keys: Sequence[bytes],
        rank: int,
        owner: Owner,
        groups: Sequence[int] | None = None,
    ) -> StoreClaim:
        """Claims `rank`'s section of each of `keys` in `ns_id` for writing (`groups`: their
        groups, as a job check found them); settled by finish_store_many. See Writes'."""
        return self._writes.begin_store_many(self.namespace(ns_id), keys, rank, owner, groups)

    def finish_store(self, slot: Slot, rank: int, ok: bool) -> bool:
        """Ends `rank`'s copy into `slot`. Returns True if the slot became READY."""
        return self._writes.finish_store_many((slot,), rank, ok) == 1

    def finish_store_many(self, slots: Iterable[Slot], rank: int, ok: bool) -> int:
        """Ends `rank`'s copy into each of `slots` (each named once, each claimed
        by this rank and not yet finished); returns how many became READY. Its
        promises: Writes.finish_store_many."""
        return self._writes.finish_store_many(slots, rank, ok)

    # -- chunk events (what routers index: kvdepot.v1.ChunkEvent) ---------------------

    def keep_chunk_events(
        self, namespace_id: str, slots: Iterable[Slot], events: Mapping[bytes, bytes]
    ) -> None:
        """Keeps `events[slot.key]` beside each of `slots` (a store claim's) that has
        none yet; counted in the namespace, dropped with the row."""
        ns = self.namespace(namespace_id)
        for slot in slots:
            if not slot.doomed:
                ns.set_chunk_event(slot, events.get(slot.key, b""))

    def chunk_events(self, namespace_id: str, keys: Iterable[bytes]) -> list[bytes]:
        """Each key's chunk event, b"" where its row is gone or has none."""
        ns = self.namespaces.get(namespace_id)
        slots = ns.slots if ns is not None else {}
        return [slot.chunk_event if (slot := slots.get(k)) is not None else b"" for k in keys]

    def chunk_event_totals(self) -> tuple[int, int]:
        """Rows holding a chunk event, and those events' bytes: O(namespaces)."""
        rows = size = 0
        for ns in self.namespaces.values():
            rows += ns.chunk_event_rows
            size += ns.chunk_event_bytes
        return rows, size

    # -- loads -----------------------------------------------------------------------

    def begin_read(self, namespace_id: str, key: bytes) -> Slot | None:
        """A READY slot held against eviction until end_read; None if not ready."""
        return next(iter(_hold_ready(self.namespace(namespace_id), self._policy, (key,))), None)

    def begin_read_many(self, namespace_id: str, keys: Sequence[bytes]) -> list[Slot]:
        """`begin_read` of `keys` in order up to the first not READY (a load job's: _hold_ready)."""
        return _hold_ready(self.namespace(namespace_id), self._policy, keys)

    def end_read(self, slot: Slot) -> None:
        """Ends a hold of `begin_read`: a use, so a row no longer held becomes the
        most recently used."""
        slot.readers -= 1
        if not slot.readers and not slot.pins and slot.state is SlotState.READY:
            self._policy.admit(slot)

    def end_read_many(self, slots: Sequence[Slot]) -> None:
        """`end_read` of a load's slots (in the load's order), admitting those no
        longer held tail first (eviction.tail_first)."""
        unheld = []
        for slot in slots:
            slot.readers -= 1
            if not slot.readers and not slot.pins and slot.state is SlotState.READY:
                unheld.append(slot)
        admit = self._policy.admit
        for slot in tail_first(unheld):
            admit(slot)

    def begin_keep(self, namespace_id: str, key: bytes) -> Slot | None:
        """Holds a READY row against eviction where it stands, for a tier writing it
        behind (no use): it keeps its place in the eviction order (touches still move
        it) and eviction passes over it until `end_keep`, so that the order of the
        writes' ends never reorders a prefix. None if the key is not READY."""
        slot = self.namespace(namespace_id).slots.get(key)
        if slot is None or slot.state is not SlotState.READY:
            return None
        slot.kept += 1
        return slot

    def end_keep(self, slot: Slot) -> None:
        """Ends a hold of `begin_keep` (the row is still READY: nothing evicts a row
        kept in place)."""
        slot.kept -= 1

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> int:
        """A request used `keys` again (a finished request's chunks, group-major and
        chunks ascending, as the connector names them): each READY row nobody holds
        becomes the most recently used, tail first (eviction.tail_first). Rows held
        are made young when their hold ends; keys not READY are skipped. Returns
        how many rows were refreshed."""
        ns = self.namespace(namespace_id)
        get, ready = ns.slots.get, SlotState.READY
        used = [
            slot
            for key in keys
            if (slot := get(key)) is not None and slot.state is ready and not slot.held
        ]
        refresh = self._policy.refresh
        for slot in tail_first(used):
            refresh(slot)
        self.stats.touched_keys += len(used)
        return len(used)

    # -- sessions and expiry ------------------------------------------------------------

    def release_owner(self, owner: Owner) -> tuple[int, int]:
        """Drops every pin of `owner` and every unfinished row it was writing;
        returns (pins dropped, reservations dropped)."""
        return self._pins.release(owner), self._writes.release(owner)

    def expire_reservations(self) -> int:
        """Drops rows that stayed WRITING longer than reservation_timeout."""
        return self._writes.expire_reservations()

    # -- eviction (Evictions) --------------------------------------------------------

    def evict(
        self,
        namespace_id: str,
        keys: Iterable[bytes] | None = None,
        reason: EvictionReason = EvictionReason.ADMIN,
    ) -> tuple[int, int]:
        """Evicts READY, unheld blocks (all of the namespace, or `keys`); returns
        (evicted, skipped) (Evictions.evict)."""
        return self._evictions.evict(self.namespace(namespace_id), keys, reason)

    def evict_slice(
        self,
        namespace_id: str,
        after: bytes | None,
        limit: int,
        reason: EvictionReason = EvictionReason.ADMIN,
        budget_s: float | None = None,
    ) -> tuple[int, int, bytes | None]:
        """One slice of a whole-namespace eviction, in key order after `after`;
        returns (evicted, skipped, where to go on or None) (Evictions.evict_slice)."""
        ns = self.namespace(namespace_id)
        return self._evictions.evict_slice(ns, after, limit, reason, budget_s)

    def evict_cold_slice(
        self, limit: int, budget_s: float, reason: EvictionReason = EvictionReason.CLEAR
    ) -> int:
        """Evicts up to `limit` of the policy's victims, within about `budget_s`
        seconds: one slice of a Clear (Evictions.evict_cold_slice)."""
        return self._evictions.evict_cold_slice(limit, budget_s, reason)

    @property
    def evictable_blocks(self) -> int:
        """READY blocks nobody pins, reads or writes (the policy's length)."""
        return len(self._policy)

    def unevictable_blocks(self) -> int:
        """Blocks pinned, being read or being written: what a Clear leaves."""
        return self._evictions.unevictable_blocks()

    def clear(self) -> tuple[int, int]:
        """Evicts every READY, unheld block; returns (evicted, skipped)."""
        return self._evictions.clear()

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
        doomed = len(self._writes.doomed)
        return {"ready": ready, "writing": writing, "pinned": pinned, "doomed": doomed}

    def pinned_slot_count(self, owner: Owner) -> int:
        """How many distinct slots `owner` holds at least one pin on (for reporting)."""
        return len(self._pins.by_owner.get(owner, ()))

    def ready_slots(self) -> list[Slot]:
        return [
            s
            for ns in self.namespaces.values()
            for s in ns.slots.values()
            if s.state is SlotState.READY
        ]

    def ready_slots_by_age(self) -> list[Slot]:
        """READY slots, next victim first; held (pinned, read) ones last."""
        held = [s for s in self.ready_slots() if s.held]
        return [*self._policy, *held]

    def check_invariants(self) -> None:
        """Raises AssertionError when index and allocator disagree (see
        kvdepot.server.core.index_check)."""
        check_index(self, self._policy, self._writes, self._pins)

    # -- warm restart and crash recovery (Recovery) ---------------------------------

    @property
    def recovering(self) -> Mapping[int, Extent]:
        """Extents claimed for a crash journal's rows, by offset, until verified
        (read-only: claim_recovering, drop_recovering and adopt_* change it)."""
        return self._recovery.recovering

    def claim_recovering(self, offset: int, size: int) -> Extent:
        """Claims an extent for a row a crash journal lists (Recovery.claim_recovering)."""
        return self._recovery.claim_recovering(offset, size)

    def drop_recovering(self, extent: Extent) -> None:
        """Frees a claimed extent whose row failed verification."""
        self._recovery.drop_recovering(extent)

    def adopt_recovered(
        self, namespace_id: str, key: bytes, extent: Extent, chunk_event: bytes = b""
    ) -> Slot | None:
        """Makes a verified row READY, with its chunk event, and announces it; None
        if it cannot be (Recovery.adopt_recovered)."""
        ns = self.namespaces.get(namespace_id)
        return self._recovery.adopt_recovered(ns, key, extent, chunk_event)

    def adopt_ready(self, namespace_id: str, key: bytes, extent: Extent) -> Slot:
        """Inserts a READY slot over a claimed extent, silently: a warm restart
        (Recovery.adopt_ready)."""
        return self._recovery.adopt_ready(self.namespace(namespace_id), key, extent)


def _hold_ready(ns: Namespace, policy: EvictionPolicy, keys: Iterable[bytes]) -> list[Slot]:
    """Holds each of `keys`' READY slots in `ns` against eviction (a reader more), in
    order, up to the first key not READY; returns the slots held."""
    held: list[Slot] = []
    get, ready = ns.slots.get, SlotState.READY
    for key in keys:
        slot = get(key)
        if slot is None or slot.state is not ready:
            break
        if not slot.readers and not slot.pins:  # unheld: the policy has it
            policy.withdraw(slot)
        slot.readers += 1
        held.append(slot)
    return held
