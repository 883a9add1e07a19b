"""`DiskLink`: the disk tier (kvdepot.server.disk.tier.DiskTier) attached to one daemon.

Wired the way the remote tier is (kvdepot.server.remote.link): it plugs into the
daemon through its explicit hooks only, the event bus listener (`on_event`) and
the index and arena APIs: a `Tier` (kvdepot.server.core.tier), which the daemon
builds from its registry (kvdepot.server.disk.factory). The state's tier facet
(kvdepot.server.state.tiers) asks it first on Depot/Prefetch; Admin/GetStats and
the Prometheus collector (kvdepot.server.disk.metrics) read its figures.

- Write-behind, `--disk-write ready`: a row that becomes READY (its STORED event)
  is noted; right after the event (a listener must not call back into the index)
  each row still ready is kept in place with `begin_keep` (no use: it keeps its
  place in the eviction order, which eviction passes over, so the order in which
  writes end never reorders a prefix) and handed to `DiskTier.write` straight from
  the pool's memory (page-aligned: nothing is staged); the hold ends when the
  write's `done` comes back to the loop (`end_keep`). A row that finds the bound on
  bytes in flight reached waits, as a key only (nothing held, so RAM may still
  evict it), in a list of at most WAITING_ROWS, written oldest first as writes
  finish: a burst larger than the bound still reaches the disk. Past that list,
  and whatever the tier cannot take (the disk down or its index coming back, no
  space), is dropped and counted: a store never waits on the disk.
- Order: the disk keeps the pool's (`touch`: a finished request's chunks made young,
  the head youngest). A record enters the disk's order when its write ends, and the
  request's touch may come before that; a touch naming a row still to write is
  applied again once none is (`TouchesAfterWrites`, core/touch_order.py), so a new tail is
  never younger on disk than its head (which the disk would then evict first, keeping
  the tail where no lookup reaches it).
- Write-behind, `--disk-write evict`: nothing is written while the pool is below
  its high-water fill. Above it, a walk from the cold end of the pool's LRU
  (`BlockIndex.coldest`) writes the least recently used rows not on disk yet, the
  same way and under the same bound, so that eviction finds them written; a row
  reused meanwhile moves to the hot end and is not written. The walk covers only
  the coldest bytes above the high-water mark and runs again after new rows or
  finished writes worth an eighth of what it last walked (amortized: a few checks
  per stored row). The write keeps the row in place, as above: a written row is
  still among the coldest.
- With `--disk-write-priority low` (the default) the write threads run at nice 19
  and the lowest best-effort I/O priority (`io_threads.lower_priority`): stores' copies and
  the event loop win the CPU, and what the disk cannot take in time is dropped.
- Writes in flight hold at most half the pool (`POOL_SHARE`; a row being written is
  unevictable, and a pool all held would drop stores).
- Promotion, a tier below the pool for Prefetch (kvdepot.server.core.prefix_fetch):
  `locate(namespace, keys)` says which keys the disk has as a whole row of the
  namespace's layout; `fetch(namespace, keys)`, for the leading run of a request
  the state picked, claims every rank's section of a fresh slot for each
  (`begin_store`, as the remote fetcher does), `DiskTier.read` reads the record
  straight into it, and once all of the call's reads are done their rows become
  READY tail first (`finish_store`, announced on Watch), or are dropped (a record
  that did not verify: never served).
- Events: the tier's record changes (`DiskTier.watch`: a record written; one
  evicted, not verified or lost with its file) reach `announce` (the event bus's
  Watch streams, set by `attach`) on the loop, in order, as
  STORED/REMOVED events of tier DISK, so routers see where a block lives; the
  records the index rebuild brings back at start are announced the same way, in
  its batches, and a Watch stream that starts later is told what is on disk by
  `on_watch` (the event bus's greeting).

Threads: everything here runs on the event loop, except the tier's `done`
callbacks, which run on its I/O threads and only hand their result to the loop.
Those threads touch the pool's memory: `close` waits for them, so the daemon
closes the link before it unmaps the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import TYPE_CHECKING, Any

from kvdepot.server.core.eviction import tail_first
from kvdepot.server.core.index import BlockIndex, IndexEvent, Slot, UnknownNamespace
from kvdepot.server.core.kinds import EventKind, StoreOutcome, Tier
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.core.tier import TierHost
from kvdepot.server.core.touch_order import TouchesAfterWrites
from kvdepot.server.disk.cold_end import WRITE_DROPS, ColdEndWriter
from kvdepot.server.disk.io_threads import lower_priority
from kvdepot.server.disk.space import Change, WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from kvdepot.server.memory.arena import Arena

if TYPE_CHECKING:  # prometheus_client: imported with the collector, when metrics are on
    from prometheus_client.registry import Collector

log = logging.getLogger("kvdepot.disk")

OWNER = "disk-tier"  # the index's writer id for rows promoted from the disk
# Keys a new Watch stream is told are on disk (a quarter of what it may lag behind).
WATCH_DISK_KEYS = 16384
# Ready rows that found the bound on bytes in flight reached, waiting (as keys) for
# writes to finish; more than this are dropped (`backlog_full`).
WAITING_ROWS = 4096


WRITE_MODES = ("ready", "evict")
# Writes in flight hold at most half the pool (DiskLink.from_settings): a row being
# written is unevictable, and a pool all held would drop stores.
POOL_SHARE = 2


@dataclass(frozen=True)
class DiskSettings:
    directory: str
    size: int
    max_inflight_bytes: int = 256 << 20
    write_mode: str = "ready"  # --disk-write: when a row becomes ready, or ahead of eviction
    high_water: float = 0.8  # evict mode: pool fill above which the coldest rows are written
    # --disk-write-priority low: the write threads at the lowest priorities
    # (kvdepot.server.disk.io_threads.lower_priority)
    background_writes: bool = True
    # The fleet key ids this node holds (--remote's key file; none without --remote):
    # records of rows another key admitted are dropped at open (DiskTier).
    held_fleet_keys: frozenset[bytes] = frozenset()


@dataclass
class DiskLinkStats:
    """Counters since start, beside the tier's own (DiskTier.snapshot)."""

    hits: int = 0  # rows read from disk, verified and made ready in the pool
    misses: int = 0  # keys asked for that the disk did not have
    write_drops: Counter[str] = field(default_factory=Counter)  # rows not written, by reason
    promote_drops: Counter[str] = field(default_factory=Counter)  # rows not promoted


@dataclass(eq=False)
class _Read:
    """One row being read from disk into its claimed slot."""

    namespace: str
    key: bytes
    slot: Slot
    world_size: int
    ok: bool = False


@dataclass(eq=False)
class _Promotion:
    """One Prefetch's reads from disk (`DiskLink.fetch`), settled together."""

    order: list[_Read] = field(default_factory=list)  # the request's order
    pending: int = 0  # reads not done yet
    all_started: bool = False


class DiskLink:
    """The disk tier below the pool (a `Tier`, kvdepot.server.core.tier): the module
    docstring says what it does and on which threads."""

    name = "disk"
    fetched = KeyState.FETCHING_DISK  # vLLM's cache-hit source: the node's disk

    def __init__(
        self,
        tier: DiskTier,
        index: BlockIndex,
        arena: Arena,
        write_mode: str = "ready",
        high_water: float = 0.8,
    ) -> None:
        if write_mode not in WRITE_MODES:
            raise ValueError(f"disk write mode {write_mode!r}: one of {', '.join(WRITE_MODES)}")
        self.tier = tier
        self._index = index
        self._arena = arena
        self.write_mode = write_mode
        self.high_water = high_water
        self.stats = DiskLinkStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stored: list[tuple[str, tuple[bytes, ...]]] = []  # STORED, not yet written
        self._waiting: deque[tuple[str, bytes]] = deque()  # found the bound reached
        # Touches of rows still to write, applied again once they are (core/touch_order.py).
        self._touch_order = TouchesAfterWrites()
        self._promoting: set[tuple[str, bytes]] = set()  # being read into the pool
        self._cold = ColdEndWriter(self, high_water) if write_mode == "evict" else None
        self._from_disk: set[tuple[str, bytes]] = set()  # promoted: not written back
        # Where the disk's events go (the Watch streams); None: nowhere.
        self.announce: Callable[[IndexEvent], None] | None = None
        # The chunk events (kvdepot.v1.ChunkEvent) of the records written from rows
        # that had one, so a record's STORED event and its promotion into the pool
        # still carry it once the pool's row is gone; a record found at a restart
        # brings its own (its header's). Dropped with the record.
        self._chunk_events: dict[tuple[str, bytes], bytes] = {}
        self.chunk_event_bytes = 0

    @classmethod
    def from_settings(cls, settings: DiskSettings, index: BlockIndex, arena: Arena) -> DiskLink:
        # A row being written is held in the pool (unevictable): writes in flight never
        # hold more than a share of it, or stores would find nothing to evict and drop.
        inflight = min(settings.max_inflight_bytes, index.allocator.capacity // POOL_SHARE)
        tier = DiskTier(
            settings.directory,
            settings.size,
            max_inflight_bytes=inflight,
            write_thread_setup=lower_priority if settings.background_writes else None,
            held_fleet_keys=settings.held_fleet_keys,
        )
        return cls(tier, index, arena, settings.write_mode, settings.high_water)

    def start(self) -> None:
        """Opens the tier (on the event loop; its index comes back in the background).
        Raises UnsafeFileError or TierBusy: start-up errors."""
        self._loop = asyncio.get_running_loop()
        self.tier.watch(self._tier_changed)
        self.tier.open()
        snap = self.tier.snapshot()
        if snap["up"]:
            log.info(
                "disk tier %s: %d MiB, %s I/O, writing rows %s%s",
                self.tier.directory,
                self.tier.size >> 20,
                "direct" if snap["direct_io"] else "buffered",
                "when they become ready"
                if self.write_mode == "ready"
                else f"ahead of eviction (the pool over {self.high_water:.0%} full)",
                "" if snap["recovery_complete"] else "; its index comes back in the background",
            )
        else:
            log.warning(
                "disk tier %s is down at start (%s): serving from RAM only, retrying",
                self.tier.directory,
                snap["down_reason"],
            )

    async def close(self) -> None:
        """Waits for the tier's I/O (its holds end) and writes its index checkpoint
        (when the index is whole and the disk up: otherwise the next start scans)."""
        snap = self.tier.snapshot()
        whole = bool(snap["up"] and snap["recovery_complete"])
        await asyncio.get_running_loop().run_in_executor(None, self.tier.close)
        await asyncio.sleep(0)  # the last completions, handed to the loop, run now
        log.info(
            "disk tier %s closed (%s)",
            self.tier.directory,
            "index checkpoint written"
            if whole
            else "no index checkpoint: the next start scans the records",
        )

    def attach(self, host: TierHost) -> None:
        """Its records' events reach the Watch streams (not the pool's listeners), a
        new Watch stream hears what is on disk, and its records' chunk events answer
        where the pool's rows are gone."""
        self.announce = host.publish_to_watchers
        host.add_greeting(self.on_watch)
        host.add_chunk_event_source(self)

    @property
    def healthy(self) -> bool:
        return self.tier.health.up

    def collector(self) -> Collector:
        from kvdepot.server.disk.metrics import DiskCollector

        return DiskCollector(self)

    def _on_loop(self, call: Callable[..., Any], *args: Any) -> None:
        """From an I/O thread: `call(*args)` on the event loop (dropped once it closed)."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(call, *args)

    # -- write-behind ---------------------------------------------------------------------

    def on_event(self, event: IndexEvent) -> None:
        """The event bus listener: notes rows that became ready, written right after
        (ready mode), or hands the event to the cold end's writer (evict mode)."""
        if self._loop is None:
            return
        if self._cold is not None:
            self._cold.on_event(event)
            return
        if event.kind is not EventKind.STORED:
            return
        if not self._stored:
            self._loop.call_soon(self._write_stored)
        self._stored.append((event.namespace, event.keys))
        for key in event.keys:  # to write from now: a touch before it is kept
            self._touch_order.noted((event.namespace, key))

    def _write_stored(self) -> None:
        stored, self._stored = self._stored, []
        waiting, drops, order = self._waiting, self.stats.write_drops, self._touch_order
        for namespace_id, keys in stored:
            for key in keys:
                if (namespace_id, key) in self._from_disk:  # read from there: not again
                    self._from_disk.discard((namespace_id, key))
                elif len(waiting) < WAITING_ROWS:
                    waiting.append((namespace_id, key))
                    continue
                else:
                    drops["backlog_full"] += 1
                self._retouch(order.settled((namespace_id, key)))  # not to write
        self._drain()

    def _drain(self) -> None:
        """Writes the waiting rows, oldest first, until the bound on bytes in flight
        stops it (the next write that finishes drains on)."""
        waiting, drops = self._waiting, self.stats.write_drops
        while waiting:
            verdict = self._write_row(*waiting[0])
            if verdict is WriteVerdict.BACKLOG_FULL:
                return
            row = waiting.popleft()
            if verdict is not WriteVerdict.ACCEPTED:  # not written now: settled
                self._retouch(self._touch_order.settled(row))
            if verdict in WRITE_DROPS:
                drops[WRITE_DROPS[verdict]] += 1

    def write_row(
        self, namespace_id: str, key: bytes, written: Callable[[Slot], None]
    ) -> tuple[WriteVerdict | None, Slot | None]:
        """Keeps a ready row in place (BlockIndex.begin_keep) and hands it to the tier
        straight from the pool's memory; `written(slot)` runs on the loop when the
        write is done and must end the hold (`end_keep`). A write the tier refuses
        ends it here. (None, None): the row is gone (its namespace, or evicted or
        replaced since it was noted)."""
        index = self._index
        try:
            layout = index.namespace(namespace_id).layout
        except UnknownNamespace:
            return None, None
        slot = index.begin_keep(namespace_id, key)
        if slot is None:
            return None, None
        view = self._arena.view(slot.extent.offset, layout.slot_bytes(slot.group))
        on_loop = self._on_loop
        verdict = self.tier.write(
            namespace_id,
            key,
            view,
            lambda ok: on_loop(written, slot),
            slot.admitted_by,
            slot.chunk_event,
        )
        if verdict is not WriteVerdict.ACCEPTED:
            index.end_keep(slot)
        return verdict, slot

    def _write_row(self, namespace_id: str, key: bytes) -> WriteVerdict | None:
        verdict, slot = self.write_row(namespace_id, key, self._write_done)
        if slot is None:
            self.stats.write_drops["evicted"] += 1
        return verdict

    def _write_done(self, slot: Slot) -> None:
        self._index.end_keep(slot)
        self._retouch(self._touch_order.settled((slot.namespace, slot.key)))
        if self._waiting:
            self._drain()

    def _retouch(self, touches: list[tuple[str, Sequence[bytes]]]) -> None:
        for namespace_id, keys in touches:
            self.tier.touch(namespace_id, keys)

    # -- events ---------------------------------------------------------------------------

    def _tier_changed(self, changes: list[Change]) -> None:  # any thread, the tier's lock
        if self.announce is not None:
            self._on_loop(self._announce_changes, changes)

    def _announce_changes(self, changes: list[Change]) -> None:
        announce = self.announce
        if announce is None:
            return
        # Runs of one namespace and reason: one event each, in order.
        for (namespace_id, why), run in groupby(changes, key=lambda c: (c[0], c[2])):
            kind = EventKind.STORED if why is None else EventKind.REMOVED
            keys = tuple(change[1] for change in run)
            dropped = self._keep_chunk_events(namespace_id, keys, kind is EventKind.STORED)
            announce(IndexEvent(namespace_id, kind, keys, why, Tier.DISK, dropped))

    def _keep_chunk_events(
        self, namespace_id: str, keys: Sequence[bytes], stored: bool
    ) -> tuple[bytes, ...]:
        """A record written takes its row's chunk event (the pool's row, else the one
        its header holds: a record found at a restart); a record dropped drops it, and
        the dropped events are returned, in key order, for its REMOVED event (() when
        none was held)."""
        held = self._chunk_events
        if stored:
            for key, event in zip(keys, self._index.chunk_events(namespace_id, keys), strict=True):
                event = event or self.tier.chunk_event_of(namespace_id, key)
                if event and (namespace_id, key) not in held:
                    held[(namespace_id, key)] = event
                    self.chunk_event_bytes += len(event)
            return ()
        if not held:
            return ()
        dropped = tuple([held.pop((namespace_id, key), b"") for key in keys])
        self.chunk_event_bytes -= sum(map(len, dropped))
        return dropped if any(dropped) else ()

    def chunk_events(self, namespace_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Each record's chunk event, b"" where it has none (or is not on disk)."""
        held = self._chunk_events
        return [held.get((namespace_id, key), b"") for key in keys]

    @property
    def chunk_event_rows(self) -> int:
        return len(self._chunk_events)

    def on_watch(self, namespace_id: str) -> list[IndexEvent]:
        """What a new Watch stream is told is on disk (after the pool's snapshot): one
        STORED event of tier DISK with the namespace's records, most recently used
        first, at most WATCH_DISK_KEYS of them (so it never lags a stream at once)."""
        keys = tuple(self.tier.keys_of(namespace_id, WATCH_DISK_KEYS))
        if not keys:
            return []
        return [IndexEvent(namespace_id, EventKind.STORED, keys, None, Tier.DISK)]

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        """A finished request's chunks (KeyCalls' touch): their records on disk are made
        young as the pool's rows are, so the disk keeps the pool's prefix order; again
        once the rows it names still to write are written (core/touch_order.py)."""
        self.tier.touch(namespace_id, keys)
        self._retouch(self._touch_order.touched(namespace_id, keys))

    # -- promotion (a TierBelow: kvdepot.server.core.prefix_fetch) ---------------------

    async def locate(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key (checked, missing in the pool): whether the disk has it as a whole
        row of the namespace's layout (or is reading it into the pool already)."""
        layout, tier = self._index.namespace(namespace_id).layout, self.tier
        if not tier.health.up:
            self.stats.misses += len(keys)
            return [False] * len(keys)
        out: list[bool] = []
        for key in keys:
            if (namespace_id, key) in self._promoting:
                out.append(True)
                continue
            found = tier.record_of(namespace_id, key)
            if found is None:
                self.stats.misses += 1
                out.append(False)
            elif found[0] != layout.slot_bytes(layout.key_group(key)):
                # Another layout's row under this name: never loaded.
                self.stats.promote_drops["wrong_length"] += 1
                out.append(False)
            else:
                out.append(True)
        return out

    def fetch(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Reads `keys` (a leading run of a request, in its order, that `locate` found)
        from disk into the pool: per key, True when under way (or in the pool already).
        The reads go tail first (each touches its record, so a prefix's first chunk is
        the disk's youngest, as a touch leaves it), and the rows become READY together
        once all of this call's reads are done, tail first (the pool's order)."""
        ns = self._index.namespace(namespace_id)
        layout, tier = ns.layout, self.tier
        batch = _Promotion()
        out: list[bool] = []
        for key in reversed(keys):
            if key in ns.slots:  # being read already, or stored meanwhile
                out.append(True)
                continue
            found = tier.record_of(namespace_id, key) if tier.health.up else None
            size = layout.slot_bytes(layout.key_group(key))
            if found is None or found[0] != size:  # gone since `locate`
                self.stats.misses += 1
                out.append(False)
                continue
            out.append(
                self._read_into_pool(batch, namespace_id, key, size, layout.world_size, found[1])
            )
        batch.order.reverse()  # the request's order
        batch.all_started = True
        if not batch.pending:
            self._settle_batch(batch)
        return out[::-1]

    def _read_into_pool(
        self,
        batch: _Promotion,
        namespace_id: str,
        key: bytes,
        size: int,
        world_size: int,
        admitted_by: bytes,
    ) -> bool:
        first = self._index.begin_store(namespace_id, key, 0, OWNER)
        if first.outcome is not StoreOutcome.WRITE or first.slot is None:
            self.stats.promote_drops["pool_full"] += 1
            return False
        slot = first.slot
        # A fleet row stays one in RAM: never written back to the fleet, nor kept in
        # the pool file (the read checks the record's header, this id among it).
        slot.admitted_by = admitted_by
        event = self._chunk_events.get((namespace_id, key))
        if event:  # what routers index comes back with the row
            self._index.keep_chunk_events(namespace_id, (slot,), {key: event})
        # A fresh slot: every other rank's section is free to claim as well.
        for rank in range(1, world_size):
            self._index.begin_store(namespace_id, key, rank, OWNER)
        dest = self._arena.view(slot.extent.offset, size)
        read = _Read(namespace_id, key, slot, world_size)

        def done(ok: bool) -> None:  # an I/O thread
            self._on_loop(self._promoted, batch, read, ok)

        if not self.tier.read(namespace_id, key, dest, done):  # gone since record_of
            self.stats.misses += 1
            self._settle(slot, world_size, False)
            return False
        self._promoting.add((namespace_id, key))
        batch.order.append(read)
        batch.pending += 1
        return True

    def _promoted(self, batch: _Promotion, read: _Read, ok: bool) -> None:
        read.ok = ok
        batch.pending -= 1
        if not batch.pending and batch.all_started:
            self._settle_batch(batch)

    def _settle_batch(self, batch: _Promotion) -> None:
        """A Prefetch's reads are all done: their rows become READY tail first (one
        insert each, the head last: the youngest)."""
        by_slot = {read.slot: read for read in batch.order}
        for slot in tail_first([read.slot for read in batch.order]):
            read = by_slot[slot]
            self._promoting.discard((read.namespace, read.key))
            if read.ok and self.write_mode == "ready":  # its STORED event must not write it back
                self._from_disk.add((read.namespace, read.key))
            if self._settle(slot, read.world_size, read.ok):
                self.stats.hits += 1
                continue
            self._from_disk.discard((read.namespace, read.key))
            self.stats.promote_drops["rejected" if not read.ok else "dropped"] += 1

    def _settle(self, slot: Slot, world_size: int, ok: bool) -> bool:
        ready = False
        for rank in range(world_size):
            ready = self._index.finish_store(slot, rank, ok) or ready
        return ready

    # -- figures --------------------------------------------------------------------------

    def stats_fields(self) -> dict[str, object]:
        """GetStats' disk_* fields."""
        snap = self.tier.snapshot()
        drops = Counter(self.stats.write_drops)
        # the tier's snapshot counters are ints (a dict of mixed values)
        drops["error"] = int(snap["write_errors"])  # type: ignore[call-overload]
        return {
            "disk_enabled": True,
            "disk_write_mode": self.write_mode,
            "disk_healthy": bool(snap["up"]),
            "disk_down_reason": str(snap["down_reason"] or ""),
            "disk_direct_io": bool(snap["direct_io"]),
            "disk_capacity_bytes": snap["capacity_bytes"],
            "disk_used_bytes": snap["used_bytes"],
            "disk_records": snap["records"],
            "disk_inflight_bytes": snap["inflight_bytes"],
            "disk_write_waiting": len(self._waiting),
            "disk_writes": snap["written_records"],
            "disk_write_bytes": snap["written_bytes"],
            "disk_reads": snap["read_records"],
            "disk_read_bytes": snap["read_bytes"],
            "disk_hits": self.stats.hits,
            "disk_misses": self.stats.misses,
            "disk_write_drops": {k: v for k, v in drops.items() if v},
            "disk_promote_drops": sum(self.stats.promote_drops.values()),
            "disk_rejected": snap["rejected"],
            # the tier's snapshot counters are ints (a dict of mixed values)
            "disk_errors": int(snap["write_errors"]) + int(snap["read_errors"]),  # type: ignore[call-overload]
            "disk_evicted": snap["evicted"],
            "disk_recovery_complete": bool(snap["recovery_complete"]),
            "disk_recovery_source": str(snap["recovery_source"]),
            "disk_recovery_scanned_bytes": snap["recovery_scanned_bytes"],
            "disk_recovery_total_bytes": snap["recovery_total_bytes"],
            "disk_recovered": snap["recovered"],
        }
