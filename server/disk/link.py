"""`DiskLink`: the disk tier (kvdepot.server.disk.tier.DiskTier) attached to one daemon.

Wired the way the remote tier is (kvdepot.server.remote.link): it plugs into the
daemon through its explicit hooks only, the event bus listener (`on_event`) and
the index and arena APIs. The state's tier facet (kvdepot.server.state.tiers)
asks it first on Depot/Prefetch; Admin/GetStats and the Prometheus collector
(kvdepot.server.disk.metrics) read its figures.

- Write-behind: a row that becomes READY (its STORED event) is noted; right after
  the event (a listener must not call back into the index) each row still ready is
  held with `begin_read` and handed to `DiskTier.write` straight from the pool's
  memory (page-aligned: nothing is staged); the hold ends when the write's `done`
  comes back to the loop. What the tier cannot take (the bound on bytes in flight,
  the disk down or its index coming back, no space) is dropped and counted there:
  a store never waits on the disk.
- Promotion: `promote(namespace, keys)` claims, for each key on disk whose record
  is a whole row of the namespace's layout, every rank's section of a fresh slot
  (`begin_store`, as the remote fetcher does), `DiskTier.read` reads the record
  straight into it, and `done` makes it READY (`finish_store`, announced on Watch)
  or drops it (a record that did not verify: never served).
- Events: the tier's record changes (`DiskTier.watch`: a record written; one
  evicted, not verified or lost with its file) reach `announce` (the event bus's
  Watch streams, set by kvdepot.server.state.tiers) on the loop, in order, as
  STORED/REMOVED events of tier DISK, so routers see where a block lives.

Threads: everything here runs on the event loop, except the tier's `done`
callbacks, which run on its I/O threads and only hand their result to the loop.
Those threads touch the pool's memory: `close` waits for them, so the daemon
closes the link before it unmaps the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from kvdepot.server.core.index import BlockIndex, IndexEvent, Slot, UnknownNamespace
from kvdepot.server.core.kinds import EventKind, StoreOutcome, Tier
from kvdepot.server.core.layout import check_key
from kvdepot.server.disk.space import Change, WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from kvdepot.server.memory.arena import Arena

log = logging.getLogger("kvdepot.disk")

OWNER = "disk-tier"  # the index's writer id for rows promoted from the disk
# The tier's write verdicts that drop a row, as GetStats and Prometheus name them.
_DROPS = {
    WriteVerdict.BACKLOG_FULL: "backlog_full",
    WriteVerdict.NO_SPACE: "no_space",
    WriteVerdict.TIER_DOWN: "tier_down",
    WriteVerdict.RECOVERING: "recovering",
}


@dataclass(frozen=True)
class DiskSettings:
    directory: str
    size: int
    max_inflight_bytes: int = 256 << 20


@dataclass
class DiskLinkStats:
    """Counters since start, beside the tier's own (DiskTier.snapshot)."""

    hits: int = 0  # rows read from disk, verified and made ready in the pool
    misses: int = 0  # keys asked for that the disk did not have
    write_drops: Counter[str] = field(default_factory=Counter)  # rows not written, by reason
    promote_drops: Counter[str] = field(default_factory=Counter)  # rows not promoted


class DiskLink:
    def __init__(self, tier: DiskTier, index: BlockIndex, arena: Arena) -> None:
        self.tier = tier
        self._index = index
        self._arena = arena
        self.stats = DiskLinkStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stored: list[tuple[str, tuple[bytes, ...]]] = []  # STORED, not yet written
        self._promoting: set[tuple[str, bytes]] = set()  # being read into the pool
        self._from_disk: set[tuple[str, bytes]] = set()  # promoted: not written back
        # Where the disk's events go (the Watch streams); None: nowhere.
        self.announce: Callable[[IndexEvent], None] | None = None

    @classmethod
    def from_settings(cls, settings: DiskSettings, index: BlockIndex, arena: Arena) -> DiskLink:
        tier = DiskTier(
            settings.directory, settings.size, max_inflight_bytes=settings.max_inflight_bytes
        )
        return cls(tier, index, arena)

    def start(self) -> None:
        """Opens the tier (on the event loop; its index comes back in the background).
        Raises UnsafeFileError or TierBusy: start-up errors."""
        self._loop = asyncio.get_running_loop()
        self.tier.watch(self._tier_changed)
        self.tier.open()
        snap = self.tier.snapshot()
        if snap["up"]:
            log.info(
                "disk tier %s: %d MiB, %s I/O, writing rows when they become ready%s",
                self.tier.directory,
                self.tier.size >> 20,
                "direct" if snap["direct_io"] else "buffered",
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

    @property
    def healthy(self) -> bool:
        return self.tier.health.up

    def _on_loop(self, call: Callable[..., Any], *args: Any) -> None:
        """From an I/O thread: `call(*args)` on the event loop (dropped once it closed)."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(call, *args)

    # -- write-behind ---------------------------------------------------------------------

    def on_event(self, event: IndexEvent) -> None:
        """The event bus listener: notes rows that became ready, written right after."""
        if event.kind is not EventKind.STORED or self._loop is None:
            return
        if not self._stored:
            self._loop.call_soon(self._write_stored)
        self._stored.append((event.namespace, event.keys))

    def _write_stored(self) -> None:
        stored, self._stored = self._stored, []
        index, arena, tier, drops = self._index, self._arena, self.tier, self.stats.write_drops
        for namespace_id, keys in stored:
            try:
                layout = index.namespace(namespace_id).layout
            except UnknownNamespace:
                continue
            for key in keys:
                if (namespace_id, key) in self._from_disk:
                    self._from_disk.discard((namespace_id, key))
                    continue
                slot = index.begin_read(namespace_id, key)
                if slot is None:  # evicted or replaced since its event
                    drops["evicted"] += 1
                    continue
                size = layout.slot_bytes(check_key(key, layout.num_groups))
                view = arena.view(slot.extent.offset, size)
                verdict = tier.write(namespace_id, key, view, lambda ok, s=slot: self._written(s))
                if verdict is not WriteVerdict.ACCEPTED:
                    index.end_read(slot)
                    if verdict in _DROPS:
                        drops[_DROPS[verdict]] += 1

    def _written(self, slot: Slot) -> None:  # an I/O thread
        self._on_loop(self._index.end_read, slot)

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
            announce(IndexEvent(namespace_id, kind, keys, why, Tier.DISK))

    # -- promotion ------------------------------------------------------------------------

    def promote(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key (checked, missing in the pool): True when it is being read from disk
        into the pool (READY and announced shortly), False when the disk lacks it."""
        ns = self._index.namespace(namespace_id)
        layout, tier = ns.layout, self.tier
        if not tier.health.up:  # no slot claimed (nor a row evicted for it) in vain
            for key in keys:
                check_key(key, layout.num_groups)
            self.stats.misses += len(keys)
            return [False] * len(keys)
        out: list[bool] = []
        asked_at = time.monotonic()
        for key in keys:
            if (namespace_id, key) in self._promoting:
                out.append(True)
                continue
            length = tier.length_of(namespace_id, key)
            size = layout.slot_bytes(check_key(key, layout.num_groups))
            if length is None:
                self.stats.misses += 1
                out.append(False)
                continue
            if length != size:  # another layout's row under this name: never loaded
                self.stats.promote_drops["wrong_length"] += 1
                out.append(False)
                continue
            out.append(self._read_into_pool(namespace_id, key, size, layout.world_size, asked_at))
        return out

    def _read_into_pool(
        self, namespace_id: str, key: bytes, size: int, world_size: int, asked_at: float
    ) -> bool:
        first = self._index.begin_store(namespace_id, key, 0, OWNER)
        if first.outcome is not StoreOutcome.WRITE or first.slot is None:
            self.stats.promote_drops["pool_full"] += 1
            return False
        slot = first.slot
        # A fresh slot: every other rank's section is free to claim as well.
        for rank in range(1, world_size):
            self._index.begin_store(namespace_id, key, rank, OWNER)
        dest = self._arena.view(slot.extent.offset, size)

        def done(ok: bool) -> None:  # an I/O thread
            self._on_loop(self._promoted, namespace_id, key, slot, world_size, ok)

        if not self.tier.read(namespace_id, key, dest, done):  # gone since length_of
            self.stats.misses += 1
            self._settle(slot, world_size, False)
            return False
        self._promoting.add((namespace_id, key))
        return True

    def _promoted(self, namespace_id: str, key: bytes, slot: Slot, world: int, ok: bool) -> None:
        self._promoting.discard((namespace_id, key))
        if ok:
            self._from_disk.add((namespace_id, key))
        if self._settle(slot, world, ok):
            self.stats.hits += 1
            return
        self._from_disk.discard((namespace_id, key))
        self.stats.promote_drops["rejected" if not ok else "dropped"] += 1

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
        drops["error"] = int(snap["write_errors"])  # type: ignore[call-overload]
        return {
            "disk_enabled": True,
            "disk_healthy": bool(snap["up"]),
            "disk_down_reason": str(snap["down_reason"] or ""),
            "disk_direct_io": bool(snap["direct_io"]),
            "disk_capacity_bytes": snap["capacity_bytes"],
            "disk_used_bytes": snap["used_bytes"],
            "disk_records": snap["records"],
            "disk_inflight_bytes": snap["inflight_bytes"],
            "disk_writes": snap["written_records"],
            "disk_write_bytes": snap["written_bytes"],
            "disk_reads": snap["read_records"],
            "disk_read_bytes": snap["read_bytes"],
            "disk_hits": self.stats.hits,
            "disk_misses": self.stats.misses,
            "disk_write_drops": {k: v for k, v in drops.items() if v},
            "disk_promote_drops": sum(self.stats.promote_drops.values()),
            "disk_rejected": snap["rejected"],
            "disk_errors": int(snap["write_errors"]) + int(snap["read_errors"]),  # type: ignore[call-overload]
            "disk_evicted": snap["evicted"],
            "disk_recovery_complete": bool(snap["recovery_complete"]),
            "disk_recovery_source": str(snap["recovery_source"]),
            "disk_recovery_scanned_bytes": snap["recovery_scanned_bytes"],
            "disk_recovery_total_bytes": snap["recovery_total_bytes"],
            "disk_recovered": snap["recovered"],
        }
