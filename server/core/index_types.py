"""The block index's records: slots, namespaces, store decisions, events, counters.

Plain data, kept apart from `kvdepot.server.core.index` (which re-exports them)
so that the index's modules hold its operations only; a namespace keeps its own
counters as slots come and go (`Namespace.attach`/`detach`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvdepot.server.core.allocator import Extent
from kvdepot.server.core.kinds import (
    AbortReason,
    DiskRemoval,
    DropReason,
    EventKind,
    EvictionReason,
    SlotState,
    StoreOutcome,
    Tier,
)
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.sorted_keys import SortedKeys

Owner = Hashable  # a session id


class UnknownNamespace(LookupError):
    """No engine has declared this namespace (maps to NOT_FOUND)."""


class LayoutMismatch(Exception):
    """A namespace id was declared again with other bytes (FAILED_PRECONDITION)."""


# A row's chunk event (Slot.chunk_event) is at most this long, wherever it comes from
# (a store's TransferJob.key_events, a fleet record): a 4-block chunk of 16-token
# blocks is about 350 bytes; this leaves room for 1024 tokens a chunk.
MAX_CHUNK_EVENT_BYTES = 4096


@dataclass(eq=False, slots=True)
class Slot:
    namespace: str
    key: bytes
    group: int
    extent: Extent
    created: float
    state: SlotState = SlotState.WRITING
    written_mask: int = 0  # ranks whose section is complete
    copying_mask: int = 0  # ranks whose store copy is in flight
    # Made when first needed and dropped when emptied: most rows are READY and
    # unpinned, and two empty dicts were a fifth of a READY row's memory in the index.
    writers: dict[int, Owner] | None = None  # WRITING: rank -> session
    pins: dict[Owner, int] | None = None  # session -> pin count (> 0); None: no pin
    readers: int = 0  # load copies in flight
    # Holds that keep the row where it stands in the eviction order (a tier writing it
    # behind: BlockIndex.begin_keep): eviction passes over it, touches still move it.
    kept: int = 0
    reserver: Owner | None = None  # WRITING: who reserved the row (charged for its bytes)
    doomed: bool = False  # detached from its namespace; freed when no copy is in flight
    # The fleet key id that verified the row, for a row fetched from the fleet (or
    # promoted from a disk record of one); b"" for rows this node's engines stored.
    # Such rows are never kept in the pool file nor written back to the fleet, and a
    # restart without that key drops them from the disk (docs/security.md).
    admitted_by: bytes = b""
    # What a router needs to index the row (a serialized kvdepot.v1.ChunkEvent, from
    # the storing engine's job; b"": none). Set once (Namespace.set_chunk_event).
    chunk_event: bytes = b""

    @property
    def pin_count(self) -> int:
        return sum(self.pins.values()) if self.pins else 0

    @property
    def held(self) -> bool:
        """Pinned or being read: not evictable."""
        return self.readers > 0 or bool(self.pins)


@dataclass(eq=False, slots=True)
class GivenUp:
    """A block row some ranks gave up before it was whole (kvdepot.server.core.index_writes):
    `mask` the ranks that went through it (dropped it, or wrote into a row dropped
    unfinished), `since` when the first did (the index's clock)."""

    mask: int
    since: float


@dataclass
class Namespace:
    """A layout and its slots, with counters kept on every state change so that
    the figures (GetStats, ListNamespaces, metrics) cost O(namespaces), never a
    walk over the slots."""

    layout: NamespaceLayout
    slots: dict[bytes, Slot] = field(default_factory=dict)
    used_bytes: int = 0  # slots in `slots`, and doomed ones not yet freed
    sorted_keys: SortedKeys = field(default_factory=SortedKeys)  # keys of `slots`
    ready_blocks: int = 0
    ready_bytes: int = 0
    writing_blocks: int = 0
    writing_bytes: int = 0
    pinned_blocks: int = 0  # READY slots with at least one pin
    pinned_bytes: int = 0
    group_blocks: Counter[int] = field(default_factory=Counter)  # slots by group
    # Keys whose row some ranks gave up, oldest first (Writes: a later rank then
    # drops the key rather than begin a row that would never be whole).
    given_up: dict[bytes, GivenUp] = field(default_factory=dict)
    # The pool bytes the operator's --namespace-share guarantees it (0: none): while it
    # holds no more, other namespaces' stores do not evict its rows (index_evict).
    share_bytes: int = 0
    evicted_blocks: int = 0  # rows evicted for room (LRU), since the namespace began
    chunk_event_rows: int = 0  # slots in `slots` with a chunk_event
    chunk_event_bytes: int = 0  # and those events' bytes

    @property
    def full_mask(self) -> int:
        return (1 << self.layout.world_size) - 1

    def attach(self, slot: Slot) -> None:
        """Puts `slot` into this namespace and counts it (by its state)."""
        self.slots[slot.key] = slot
        self.sorted_keys.add(slot.key)
        self.used_bytes += slot.extent.size
        self.group_blocks[slot.group] += 1
        if slot.state is SlotState.READY:
            self.ready_blocks += 1
            self.ready_bytes += slot.extent.size
        else:
            self.writing_blocks += 1
            self.writing_bytes += slot.extent.size

    def set_chunk_event(self, slot: Slot, event: bytes) -> None:
        """Keeps `event` beside `slot` (one of this namespace's, WRITING or READY) and
        counts it, unless the slot has one already or `event` is empty: the first
        rank's job to carry one sets it, later ones change nothing."""
        if event and not slot.chunk_event:
            slot.chunk_event = event
            self.chunk_event_rows += 1
            self.chunk_event_bytes += len(event)

    def detach(self, slot: Slot) -> None:
        """Takes `slot` out of this namespace and its counts; used_bytes stays
        until the slot's extent is freed."""
        del self.slots[slot.key]
        self.sorted_keys.remove(slot.key)
        self.group_blocks[slot.group] -= 1
        if slot.chunk_event:
            self.chunk_event_rows -= 1
            self.chunk_event_bytes -= len(slot.chunk_event)
        if slot.state is SlotState.READY:
            self.ready_blocks -= 1
            self.ready_bytes -= slot.extent.size
        else:
            self.writing_blocks -= 1
            self.writing_bytes -= slot.extent.size


@dataclass(frozen=True)
class StoreDecision:
    outcome: StoreOutcome
    slot: Slot | None = None
    reason: DropReason | None = None  # when DROPPED


@dataclass
class StoreClaim:
    """What `begin_store_many` decided for a job's keys, in one piece."""

    offsets: list[int | None]  # per key, in order: its slot's offset to copy into, or None
    slots: list[Slot]  # the WRITE keys' slots, in key order: settle each once
    present: int = 0  # keys ready, or whose section this rank has written or is writing
    dropped: int = 0  # keys with no room
    drop_reason: DropReason | None = None  # the last drop's


@dataclass(frozen=True)
class IndexEvent:
    namespace: str
    kind: EventKind
    keys: tuple[bytes, ...]
    reason: EvictionReason | DiskRemoval | None = None  # REMOVED events
    tier: Tier = Tier.POOL  # DISK: the disk tier's event, announced to watchers only
    # REMOVED events: the removed rows' chunk events, in key order, taken as the rows
    # go (their slots are forgotten then); () when none had one. Watch streams that
    # ask for chunk events hand them on, so an engine needs no copy until removal.
    chunk_events: tuple[bytes, ...] = ()


@dataclass
class IndexStats:
    """Counters since start, for Admin/GetStats and Prometheus."""

    lookups: int = 0  # keys looked up
    hits: int = 0
    misses: int = 0
    pin_calls: int = 0
    pin_keys: int = 0  # keys asked to pin
    pinned_keys: int = 0  # keys pinned (ready)
    touched_keys: int = 0  # READY rows made young again by a request's touch
    evictions: Counter[EvictionReason] = field(default_factory=Counter)  # blocks
    dropped_stores: Counter[DropReason] = field(default_factory=Counter)  # keys
    aborted_writes: Counter[AbortReason] = field(default_factory=Counter)  # rows
