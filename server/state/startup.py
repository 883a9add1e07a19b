"""How a DepotState starts: an empty pool, a warm restart, or a crash recovery.

    pool = open_pool(config)                 # arena, index (restored or empty), bus
    state = DepotState(config, pool.arena, pool.index, pool.bus, ...)
    journal, recovery = start_journal(...)   # with --pool-file only

Without --pool-file the pool starts empty and nothing is journalled. With it:

- **warm restart**: the last daemon shut down cleanly and left a snapshot beside
  the pool file (kvdepot.server.memory.pool_file): its index is restored, and its
  rows are sealed with checksums in a fresh journal;
- **crash recovery**: the last daemon was killed (a pool file, a journal, no
  snapshot): the journal's rows are verified against their checksums in the
  background (kvdepot.server.memory.journal_file.Recovery) while the daemon
  serves; each verified row becomes readable;
- otherwise the pool starts empty (the log says why).

`DepotState.create` calls both functions, on the event loop, before any client
can connect; the state owns what they return (it closes the journal and stops
the recovery in `DepotState.close`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.eviction import make_policy
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.memory import journal_file, numa, pool_file
from kvdepot.server.memory.arena import Arena
from kvdepot.server.state.events import EventBus
from kvdepot.server.state.settings import StateConfig

log = logging.getLogger("kvdepot.state")


@dataclass
class OpenedPool:
    """The pool as this start found it, for DepotState to take over."""

    arena: Arena
    index: BlockIndex
    bus: EventBus  # the index announces its events here
    pool_lock: int | None = None  # the fd holding `<pool-file>.lock`
    warm_restarted: bool = False
    journalled: bool = False  # --pool-file: start_journal must run
    crashed: journal_file.JournalState | None = None  # a killed daemon's rows, to verify
    previous: journal_file.JournalState | None = None  # a warm restart's known checksums


def open_pool(config: StateConfig) -> OpenedPool:
    """The arena, and a fresh or warm-restarted index over it. Raises PoolFileBusy
    when another daemon holds the pool file."""
    # Warm restart: the snapshot beside the pool file is consumed before the
    # arena maps the file, since mapping it may change the file times that the
    # snapshot vouches for.
    plan = None
    pool_lock = None
    if config.pool_file:
        pool_lock = pool_file.lock_pool_file(config.pool_file)  # raises PoolFileBusy
        plan = pool_file.prepare_start(config.pool_file, config.pool_size, config.slot_granularity)
    placement = numa.host_placement(config.numa, shard=config.shard, shards=config.shards)
    arena = Arena(config.pool_size, config.pool_file, placement)
    bus = EventBus()

    def new_index() -> BlockIndex:
        allocator = ExtentAllocator(arena.size, config.slot_granularity)
        return BlockIndex(
            allocator,
            policy=make_policy(config.eviction_policy, arena.size),
            reservation_timeout=config.reservation_timeout,
            on_event=bus.publish,
            shares=config.namespace_share,
        )

    index = new_index()
    if plan is None or not config.pool_file:  # a plan comes with a pool file
        return OpenedPool(arena, index, bus)
    # A killed daemon leaves no snapshot but a journal: recover from it. A
    # snapshot that was there but does not apply voids the journal too (the
    # pool file was replaced or changed while no daemon held it).
    old, why_not = journal_file.read(config.pool_file)
    crashed = plan.crashed
    if crashed and old is not None and not arena.existed:
        old, why_not = None, "the pool file was created or resized at this start"
    if (
        crashed
        and old is not None
        and (old.pool_size, old.granularity) != (arena.size, config.slot_granularity)
    ):
        old, why_not = None, "the journal is for another pool size or granularity"
    warm = False
    if not (crashed and old is not None):
        if crashed:
            plan.reason += f"; {why_not}"
        warm = pool_file.finish_start(plan, index) is not None
        if not warm:
            index = new_index()  # drop whatever a rejected snapshot half-restored
    return OpenedPool(
        arena,
        index,
        bus,
        pool_lock=pool_lock,
        warm_restarted=warm,
        journalled=True,
        crashed=old if crashed else None,
        previous=old if warm else None,
    )


def start_journal(
    pool: OpenedPool,
    pool_file_path: str,
    boot_id: str,
    progress: journal_file.RecoveryProgress,
) -> tuple[journal_file.Journal | None, journal_file.Recovery | None]:
    """Opens a fresh journal listing what this start serves, and starts the
    checksums (warm restart) or the verification (crash recovery, counted in
    `progress`). Returns (the journal, the running recovery); no journal when it
    cannot be written (logged: serving goes on, a crash would lose the cache)."""
    index, arena, crashed, previous = pool.index, pool.arena, pool.crashed, pool.previous
    journal = journal_file.Journal(pool_file_path, index, arena, boot_id)
    rows: list[tuple[str, bytes, journal_file.Row]] = []
    to_verify: list[tuple[str, bytes, Extent, int, bytes]] = []
    if crashed is not None:
        to_verify, rows = journal_file.begin_recovery(index, crashed, progress)
        log.info(
            "crash recovery: the previous daemon was killed; %d block(s) in its journal, "
            "%d to verify (%d dropped at once: %s); serving meanwhile",
            progress.total,
            len(to_verify),
            progress.rejected,
            ", ".join(f"{n} {r}" for r, n in progress.reasons.items()) or "none",
        )
    unsealed = []
    for slot in index.ready_slots_by_age():  # a warm restart's rows
        known = previous.rows.get((slot.namespace, slot.key)) if previous else None
        crc = known.crc if known and known.offset == slot.extent.offset else None
        rows.append(
            (
                slot.namespace,
                slot.key,
                journal_file.Row(slot.extent.offset, slot.extent.size, crc, slot.chunk_event),
            )
        )
        if crc is None:
            unsealed.append((slot.namespace, slot.key))
    try:
        journal.start(rows)
    except OSError as exc:  # a crash would now lose the cache; serving goes on
        log.error(
            "cannot write the journal %s: %s; crashes will lose the cache (a clean "
            "shutdown still keeps it)",
            journal.path,
            exc,
        )
        for _, _, extent, _, _ in to_verify:
            index.drop_recovering(extent)
        progress.rejected += len(to_verify)
        progress.complete = True
        return None, None
    pool.bus.add_listener(journal.on_event)
    journal.seal(unsealed)
    recovery = None
    if to_verify:
        recovery = journal_file.Recovery(index, arena, journal, to_verify, progress)
        recovery.start(asyncio.get_running_loop())
    return journal, recovery
