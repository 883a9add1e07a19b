"""DepotState: the daemon's state and the one API the gRPC services call.

It assembles the parts and owns their life:

    BlockIndex (core)    keys, slots, pins, LRU; announces changes on the EventBus
    EventBus             watchers by namespace (Depot/Watch)
    Sessions             sessions, registrations, memory paths, fd claiming
    JobRunner            Transfer jobs: check once, reserve, plan once, copy
    InlinePath           Put/Get
    AdminEviction        Admin/Evict and Admin/Clear, in slices
    Traffic              job and block counters, transfer observers (metrics)

Everything runs on the event loop except the byte copies (CopyQueue threads).
Errors are raised as DepotError or as the core's own exceptions; the services
map both to a status with one table (kvdepot.server.errors). Other parts plug in
through explicit calls: `attach_fd_receiver`, `add_memory_path`,
`add_event_listener`, `add_transfer_observer`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import kvdepot
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.allocator import Extent, ExtentAllocator
from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.kinds import PutOutcome, SlotState
from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_namespace_id
from kvdepot.server.core.planner import LayerRef, TensorView
from kvdepot.server.memory import journal_file, pool_file
from kvdepot.server.memory.arena import Arena
from kvdepot.server.peer import Peer
from kvdepot.server.resources import Headroom
from kvdepot.server.state.admin_evict import AdminEviction
from kvdepot.server.state.events import EventBus, Watcher
from kvdepot.server.state.inline import InlinePath
from kvdepot.server.state.invariants import check_invariants
from kvdepot.server.state.jobs import JobLimits, JobOutcome, JobRunner, JobSpec
from kvdepot.server.state.namespaces import NamespaceAccess
from kvdepot.server.state.sessions import (
    FdSource,
    RegionOpener,
    Registration,
    Session,
    Sessions,
)
from kvdepot.server.state.settings import StateConfig
from kvdepot.server.state.traffic import Traffic, TransferObserver

log = logging.getLogger("kvdepot.state")
F = TypeVar("F", bound=Callable[..., Any])


def mutation(fn: F) -> F:
    """Marks a state operation that may change the index, sessions or
    registrations: with KVDEPOT_CHECK_INVARIANTS=1 the invariants are checked
    when it returns (or raises)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(self: DepotState, *args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(self, *args, **kwargs)
            finally:
                self.verify_invariants()

        return run_async  # type: ignore[return-value]

    @functools.wraps(fn)
    def run(self: DepotState, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.verify_invariants()

    return run  # type: ignore[return-value]


class DepotState:
    def __init__(
        self,
        config: StateConfig,
        arena: Arena,
        index: BlockIndex,
        bus: EventBus,
        *,
        warm_restarted: bool = False,
        pool_lock: int | None = None,
        headroom: bool = False,
    ) -> None:
        """`index` must announce its events on `bus` (see `create`). `pool_lock`
        is the fd holding `<pool-file>.lock`, closed after the last snapshot.
        `headroom`: refuse registrations near the process's fd and mapping limits
        (the daemon; tests that build a state directly leave it off)."""
        self.config = config
        self.arena = arena
        self.index = index
        self.bus = bus
        self.boot_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.warm_restarted = warm_restarted
        self._pool_lock = pool_lock
        self._sessions = Sessions(
            config.max_sessions,
            config.max_registrations_per_session,
            Headroom(config.fd_reserve) if headroom else None,
            max_per_pid=config.max_sessions_per_pid,
            max_per_uid=config.max_sessions_per_uid,
            max_unattested=config.max_unattested_sessions,
        )
        self.traffic = Traffic()
        self.copy_queue = CopyQueue(config.copy_threads)
        self.jobs = JobRunner(
            index,
            self._sessions,
            arena,
            self.copy_queue,
            self.traffic,
            JobLimits(config.max_job_keys, config.max_job_blocks, config.max_job_pages),
            lambda: self.shutting_down,
        )
        self.inline = InlinePath(index, arena, self.copy_queue, self.traffic)
        self.shutting_down = False
        self.shutdown_event = asyncio.Event()
        # Reply queues of open Transfer streams: shutdown ends them (None).
        self.transfer_streams: set[asyncio.Queue] = set()
        # Debug only (the fuzz and fault tests): check the invariants after every
        # mutation; a failure is logged and sticks (Admin/GetStats answers INTERNAL).
        self.debug_invariants = os.environ.get("KVDEPOT_CHECK_INVARIANTS") == "1"
        # Writer ids that are not sessions (see add_internal_writer).
        self.internal_writers: set[str] = set()
        # Who may name which namespace, and the per-session quotas (state.namespaces).
        self.access = NamespaceAccess(config, index, self._sessions)
        index.max_writing_per_owner = self.access.max_writing
        index.writing_quota_exempt = self.internal_writers  # type: ignore[assignment]
        self.invariant_failure: str | None = None
        self.admin = AdminEviction(index, config, self.verify_invariants)
        # With --pool-file: the crash journal, and the recovery of a killed daemon's rows.
        self.journal: journal_file.Journal | None = None
        self.recovery = journal_file.RecoveryProgress()
        self._recovery: journal_file.Recovery | None = None
        self._compaction: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, config: StateConfig) -> DepotState:
        """The arena, a fresh or warm-restarted index, and the state over them."""
        # Warm restart: the snapshot beside the pool file is consumed before the
        # arena maps the file, since mapping it may change the file times that the
        # snapshot vouches for.
        plan = None
        pool_lock = None
        if config.pool_file:
            pool_lock = pool_file.lock_pool_file(config.pool_file)  # raises PoolFileBusy
            plan = pool_file.prepare_start(
                config.pool_file, config.pool_size, config.slot_granularity
            )
        arena = Arena(config.pool_size, config.pool_file)
        bus = EventBus()

        def new_index() -> BlockIndex:
            allocator = ExtentAllocator(arena.size, config.slot_granularity)
            return BlockIndex(
                allocator,
                reservation_timeout=config.reservation_timeout,
                on_event=bus.publish,
            )

        index = new_index()
        if plan is None:
            return cls(config, arena, index, bus, headroom=True)
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
        st = cls(config, arena, index, bus, warm_restarted=warm, pool_lock=pool_lock, headroom=True)
        st._start_journal(old if crashed else None, old if warm else None)
        return st

    def _start_journal(
        self,
        crashed: journal_file.JournalState | None,
        previous: journal_file.JournalState | None,
    ) -> None:
        """Opens a fresh journal listing what this start serves, and starts the
        checksums (warm restart) or the verification (crash recovery)."""
        index, arena = self.index, self.arena
        journal = self.journal = journal_file.Journal(
            self.config.pool_file, index, arena, self.boot_id
        )
        rows: list[tuple[str, bytes, journal_file.Row]] = []
        to_verify: list[tuple[str, bytes, Extent, int]] = []
        if crashed is not None:
            to_verify, rows = journal_file.begin_recovery(index, crashed, self.recovery)
            log.info(
                "crash recovery: the previous daemon was killed; %d block(s) in its journal, "
                "%d to verify (%d dropped at once: %s); serving meanwhile",
                self.recovery.total,
                len(to_verify),
                self.recovery.rejected,
                ", ".join(f"{n} {r}" for r, n in self.recovery.reasons.items()) or "none",
            )
        unsealed = []
        for slot in index.ready_slots_by_age():  # a warm restart's rows
            known = previous.rows.get((slot.namespace, slot.key)) if previous else None
            crc = known.crc if known and known.offset == slot.extent.offset else None
            rows.append(
                (
                    slot.namespace,
                    slot.key,
                    journal_file.Row(slot.extent.offset, slot.extent.size, crc),
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
            for _, _, extent, _ in to_verify:
                index.drop_recovering(extent)
            self.recovery.rejected += len(to_verify)
            self.recovery.complete = True
            self.journal = None
            return
        self.bus.add_listener(journal.on_event)
        journal.seal(unsealed)
        if to_verify:
            self._recovery = journal_file.Recovery(index, arena, journal, to_verify, self.recovery)
            self._recovery.start(asyncio.get_running_loop())

    # -- hooks -------------------------------------------------------------------------

    def attach_fd_receiver(self, receiver: FdSource) -> None:
        """The fd socket that shared-memory (and process-memory) registrations
        claim their fds from."""
        self._sessions.fd_source = receiver

    @property
    def fd_receiver(self) -> FdSource | None:
        return self._sessions.fd_source

    def add_memory_path(self, kind: MemoryPath, opener: RegionOpener) -> None:
        """Serves registrations of `kind` (CUDA IPC, process memory) with `opener`."""
        self._sessions.add_memory_path(kind, opener)

    def memory_path(self, kind: MemoryPath) -> RegionOpener | None:
        return self._sessions.memory_path(kind)

    def add_event_listener(self, listener: Callable[[IndexEvent], None]) -> None:
        """Calls `listener(event)` for every index event (a key became READY, a READY
        key was removed), as it happens; see EventBus.add_listener."""
        self.bus.add_listener(listener)

    def add_internal_writer(self, owner: str) -> None:
        """Declares a writer id that is not a session (a tier below the pool that
        reserves rows with BlockIndex.begin_store), so the invariants accept it."""
        self.internal_writers.add(owner)

    def add_transfer_observer(self, observer: TransferObserver) -> None:
        """Calls `observer(direction, ok, bytes, copy seconds)` after every job
        (Transfer jobs and inline Put/Get), on the event loop."""
        self.traffic.observers.append(observer)

    # -- life --------------------------------------------------------------------------

    @property
    def uptime(self) -> float:
        return time.monotonic() - self.started

    @property
    def sessions(self) -> dict[str, Session]:
        return self._sessions.sessions

    @property
    def registrations(self) -> dict[int, Registration]:
        return self._sessions.registrations

    @property
    def cpu_engine(self) -> Any:
        return self._sessions.cpu_engine

    def begin_shutdown(self) -> None:
        """Refuse new work and end the long-lived streams (Session, Watch)."""
        self.shutting_down = True
        self.shutdown_event.set()
        self.bus.wake_all()
        for q in self.transfer_streams:
            q.put_nowait(None)

    def close(self) -> None:
        if self._recovery is not None:
            self._recovery.stop()  # it reads the pool: before the unmap
        stopped = self.copy_queue.close()
        if not stopped:
            log.error("a copy did not end within the shutdown grace: memory stays mapped")
        if self.fd_receiver is not None:
            self.fd_receiver.close()
        # A copy still running keeps the regions and the pool mapped.
        self._sessions.close_all(unmap=stopped)
        if self.journal is not None:
            self.journal.close()  # stops the checksums before the unmap
        self.arena.flush()
        self.arena.close(unmap=stopped)
        if self.config.pool_file:
            # After the last copy and the unmap, so the recorded file identity is final.
            pool_file.save_at_shutdown(
                self.index, self.config.pool_file, self.arena.size, self.boot_id
            )
            if self.journal is not None:
                # Rows the recovery had not verified yet stay listed (still unserved).
                self.journal.rewrite()
        if self._pool_lock is not None:  # only now may the next daemon take the pool file
            os.close(self._pool_lock)
            self._pool_lock = None

    @mutation
    def housekeeping(self) -> None:
        j = self.journal
        if (
            j is not None
            and j.wants_compaction()
            and (self._compaction is None or self._compaction.done())
        ):
            self._compaction = asyncio.get_running_loop().create_task(j.compact())
        expired = self.index.expire_reservations()
        if expired:
            log.warning("dropped %d block row(s) whose ranks never all stored", expired)
        # Namespaces emptied by eviction, or whose last copy has ended since; not
        # while a crash recovery may still adopt rows into them.
        if self.recovery.complete or self._recovery is None:
            self._forget_unused()
        if self.fd_receiver is not None:
            stale = self.fd_receiver.expire()
            if stale:
                log.warning("closed %d fd(s) that no RegisterKV claimed", stale)

    # -- sessions and registrations ------------------------------------------------------

    def open_session(self, client_name: str, pid: int, engine_id: str) -> Session:
        if self.shutting_down:
            raise errors.unavailable("the daemon is shutting down: reconnect in a moment")
        for old in self._sessions.make_room():  # the oldest unattested session, if full
            self.close_session(old.id)
            old.revoke(
                errors.exhausted(
                    "this session was ended to make room: it never attested on the fd "
                    "socket (kvdepot's client does; see kvdepot.client.fdpass.attest)"
                )
            )
        return self._sessions.open(client_name, pid, engine_id)

    def attest(self, session_id: str, peer: Peer) -> None:
        """The fd socket's identity check (kvdepot.server.fd_receiver; on the loop):
        binds the session to `peer` or checks it is the owner. A session over its
        owner's quota is ended (the error says which limit)."""
        try:
            self._sessions.attest(session_id, peer)
        except errors.DepotError as exc:
            if exc.code is errors.Code.RESOURCE_EXHAUSTED:
                s = self._sessions.sessions.get(session_id)
                self.close_session(session_id)
                if s is not None:
                    s.revoke(exc)
            raise

    def claim_passed(self, token: str, session_id: str) -> Any:
        """The fd_receiver's PendingFd (fd and sender) behind `token` of this
        session; the caller owns its fd. DepotError with why not."""
        return self._sessions.claim_pending(token, session_id)

    def deny(self, message: str) -> errors.DepotError:
        """A counted PERMISSION_DENIED (identity refusals; Admin/GetStats)."""
        return self._sessions.deny(message)

    @mutation
    def close_session(self, session_id: str) -> None:
        """Releases everything the session held: registrations, pins, rows, fds."""
        closed = self._sessions.close(session_id)
        if closed is None:
            return
        s, registrations, fds = closed
        pins, rows = self.index.release_owner(session_id)
        self.bus.end_session(session_id)  # its Watch streams end with it
        self._forget_unused(s.namespaces)
        log.info(
            "session %s (%r, pid %d) closed: released %d registration(s), %d pin(s), "
            "%d unfinished block row(s), %d pending fd(s)",
            s.tag,
            s.client_name,
            s.pid,
            registrations,
            pins,
            rows,
            fds,
        )

    def session(self, session_id: str) -> Session:
        return self._sessions.get(session_id)

    def declare(self, layout: NamespaceLayout) -> None:
        self.index.declare_namespace(layout)

    @mutation
    def register(
        self,
        session_id: str,
        layout: NamespaceLayout,
        rank: int,
        regions: Sequence[tuple[MemoryPath | str, object]],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
    ) -> Registration:
        """Declares the namespace, maps the memory and records the registration
        (regions: (memory path, handle))."""
        session = self.session(session_id)
        if not 0 <= rank < layout.world_size:
            raise errors.invalid(f"rank {rank} out of range [0, {layout.world_size})")
        self.access.check_room(session, layout.id)
        self.declare(layout)
        try:
            reg = self._sessions.register(
                session_id,
                layout,
                rank,
                [(MemoryPath(k), h) for k, h in regions],
                tensors,
                groups,
            )
        except BaseException:
            self._forget_unused([layout.id])  # declared for nothing
            raise
        self.access.join(session, layout.id)  # a registration is the join
        return reg

    def observe(self, session_id: str, namespace_id: str) -> None:
        """An observer join (RegisterKV naming the namespace id alone): the session
        may Watch, Lookup, Pin, Unpin and Prefetch it; nothing is mapped or declared."""
        try:
            check_namespace_id(namespace_id)
        except LayoutError as exc:
            raise errors.invalid(f"namespace layout: {exc}") from None
        self.access.join(self.session(session_id), namespace_id)

    @mutation
    def unregister(self, session_id: str, registration_id: int) -> None:
        reg = self.registrations.get(registration_id)
        self._sessions.unregister(session_id, registration_id)
        if reg is not None:
            self._forget_unused([reg.layout.id])

    def _forget_unused(self, candidates: Iterable[str] | None = None) -> None:
        """Forgets the namespaces (of `candidates`, or all) that no registration and
        no block uses (state.namespaces), in the index and the journal."""
        for namespace_id in self.access.forget_unused(candidates):
            if self.journal is not None:
                self.journal.drop_namespace(namespace_id)

    # -- lookups, pins, eviction -----------------------------------------------------------

    def _check_batch(self, keys: Sequence[bytes]) -> None:
        limit = self.config.max_batch_keys
        if len(keys) > limit:
            raise errors.exhausted(
                f"{len(keys)} keys in one call; at most {limit} (--max-batch-keys): split it"
            )

    def lookup(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.access.member(session_id, namespace_id)
        self._check_batch(keys)
        return self.index.lookup(namespace_id, keys)

    @mutation
    def pin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.access.member(session_id, namespace_id)
        self._check_batch(keys)
        pinned = self.index.pin(namespace_id, keys, session_id)
        try:
            self.access.check_pinned(session_id)  # --max-pinned-per-session
        except errors.DepotError:
            # All or nothing: the call's own pins are dropped again.
            mine = [k for k, p in zip(keys, pinned, strict=True) if p]
            self.index.unpin(namespace_id, mine, session_id)
            raise
        return pinned

    @mutation
    def unpin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> int:
        self.access.member(session_id, namespace_id)
        self._check_batch(keys)
        return self.index.unpin(namespace_id, keys, session_id)

    def check_job_namespace(self, session_id: str, registration_id: int) -> None:
        """A Transfer job (stream or lane): its session must have joined the namespace
        of the registration it names (PERMISSION_DENIED otherwise; the message never
        names that namespace). An unknown registration is left to the job runner."""
        reg = self.registrations.get(registration_id)
        session = self.sessions.get(session_id)
        if reg is not None and session is not None and reg.layout.id not in session.namespaces:
            raise errors.denied(
                f"registration {registration_id} is of a namespace this session has not "
                f"joined: RegisterKV into the namespace first"
            )

    # -- admin: Evict and Clear (kvdepot.server.state.admin_evict) ---------------------

    @mutation
    def evict(self, namespace_id: str, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Admin/Evict in one go (direct use, tests): see AdminEviction.evict."""
        return self.admin.evict(namespace_id, keys)

    async def evict_in_slices(
        self, namespace_id: str, keys: Sequence[bytes]
    ) -> tuple[int, int, int]:
        """Admin/Evict, a slice at a time: see AdminEviction.evict_in_slices."""
        return await self.admin.evict_in_slices(namespace_id, keys)

    async def clear_in_slices(self) -> tuple[int, int]:
        """Admin/Clear, a slice at a time: see AdminEviction.clear_in_slices."""
        return await self.admin.clear_in_slices()

    @mutation
    def clear(self) -> tuple[int, int]:
        """Admin/Clear in one go (direct use, tests): see AdminEviction.clear."""
        return self.admin.clear()

    @property
    def slices_yielded(self) -> int:
        """Bulk-eviction slices so far (tests: the work was sliced)."""
        return self.admin.slices_yielded

    # -- transfers ---------------------------------------------------------------------

    @mutation
    async def run_job(self, job: JobSpec) -> JobOutcome:
        """One Transfer job (see kvdepot.server.state.jobs). Never raises."""
        return await self.jobs.run(job)

    @mutation
    async def put(
        self, session_id: str, namespace_id: str, key: bytes, rank: int, data: bytes
    ) -> tuple[PutOutcome, bool, str]:
        self.access.registered(session_id, namespace_id)
        return await self.inline.put(session_id, namespace_id, key, rank, data)

    @mutation
    async def get(self, session_id: str, namespace_id: str, key: bytes, rank: int) -> bytes:
        self.access.registered(session_id, namespace_id)
        return await self.inline.get(namespace_id, key, rank)

    # -- watch -------------------------------------------------------------------------

    def add_watcher(self, session_id: str, namespace_id: str) -> tuple[Watcher, list[bytes]]:
        """Subscribes and returns the current ready keys (no event can fall between).
        The session must have joined the namespace and have a Watch stream to spare."""
        session = self.access.member(session_id, namespace_id)
        self.access.open_watch(session)  # --max-watches-per-session
        return self.bus.subscribe(namespace_id, session_id), self.ready_keys(namespace_id)

    def remove_watcher(self, w: Watcher) -> None:
        self.bus.unsubscribe(w)
        session = self.sessions.get(w.session_id)
        if session is not None:
            self.access.close_watch(session)

    def ready_keys(self, namespace_id: str) -> list[bytes]:
        ns = self.index.namespaces.get(namespace_id)
        if ns is None:
            return []
        return [k for k, s in ns.slots.items() if s.state is SlotState.READY]

    # -- invariants and figures --------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raises AssertionError when the parts disagree (see state.invariants)."""
        check_invariants(self)

    def verify_invariants(self) -> str | None:
        """With KVDEPOT_CHECK_INVARIANTS=1: None if the invariants hold, else what
        broke (sticky: the first failure is kept). Always None when disabled."""
        if not self.debug_invariants:
            return None
        if self.invariant_failure is None:
            try:
                self.check_invariants()
            except AssertionError as exc:
                self.invariant_failure = f"invariant broken: {exc}"
                log.critical("%s", self.invariant_failure, exc_info=True)
        return self.invariant_failure

    def stats(self) -> dict[str, object]:
        """Admin/GetStats' fields (see admin.proto for what each counter means)."""
        counts = self.index.counts()
        alloc = self.index.allocator
        ix = self.index.stats
        store, load = self.traffic.store, self.traffic.load
        return {
            "version": kvdepot.__version__,
            "boot_id": self.boot_id,
            "uptime_seconds": self.uptime,
            "capacity_bytes": alloc.capacity,
            "used_bytes": alloc.used_bytes,
            "pinned_bytes": self.index.pinned_bytes,
            "largest_free_extent_bytes": alloc.largest_free_extent,
            "warmup_done_bytes": self.arena.warmup_done_bytes,
            "warmup_complete": self.arena.warmup_complete,
            "ready_blocks": counts["ready"],
            "writing_blocks": counts["writing"],
            "pinned_blocks": counts["pinned"],
            "sessions": len(self.sessions),
            "permission_denied": self._sessions.permission_denied,
            "registrations": len(self.registrations),
            "populating_bytes": sum(
                r.populating_bytes for reg in self.registrations.values() for r in reg.regions
            ),
            "namespaces": len(self.index.namespaces),
            "lookups": ix.lookups,
            "hits": ix.hits,
            "misses": ix.misses,
            "evictions": sum(ix.evictions.values()),
            "stores": store.jobs,
            "loads": load.jobs,
            "stored_bytes": store.bytes,
            "loaded_bytes": load.bytes,
            "dropped_stores": sum(ix.dropped_stores.values()),
            "inflight_jobs": self.traffic.inflight_jobs,
            "pool_backing": self.arena.backing,
            "warm_restarted": self.warm_restarted,
            "store_jobs": store.jobs,
            "load_jobs": load.jobs,
            "stored_blocks": store.blocks,
            "loaded_blocks": load.blocks,
            "failed_store_jobs": store.failed_jobs,
            "failed_load_jobs": load.failed_jobs,
            "pin_calls": ix.pin_calls,
            "pin_keys": ix.pin_keys,
            "pinned_keys": ix.pinned_keys,
            "recovery_blocks_total": self.recovery.total,
            "recovery_blocks_verified": self.recovery.verified,
            "recovery_blocks_rejected": self.recovery.rejected,
            "recovery_complete": self.recovery.complete,
            **self._page_locking_fields(),
        }

    def _page_locking_fields(self) -> dict[str, object]:
        """The CUDA path's page-locking figures (server/cuda/enable.py), when it serves."""
        path = self.memory_path(MemoryPath.CUDA_IPC)
        report = getattr(path, "page_locking_fields", None)
        if report is None:
            return {"page_locking": False, "page_locked_bytes": 0, "page_locking_error": ""}
        return report()
