"""DepotState: the daemon's state and the one API the gRPC services call.

It assembles the parts and owns their life:

    BlockIndex (core)    keys, slots, pins, LRU; announces changes on the EventBus
    EventBus             watchers by namespace (Depot/Watch)
    Sessions             sessions, registrations, memory paths, fd claiming
    JobRunner            Transfer jobs: check once, reserve, plan once, copy
    InlinePath           Put/Get
    AdminEviction        Admin/Evict and Admin/Clear, in slices
    Traffic              job and block counters, transfer observers (metrics)

and offers the calls of its facets, one job each, as its own (`forward` rows,
kvdepot.server.state.facade):

    SessionRegistry      open, attest and close sessions; register, observe (registry.py)
    KeyCalls             Lookup, Pin, Unpin, Watch on a joined namespace (key_calls.py)
    TiersBelow           the tiers below the pool: Prefetch, their figures (tiers.py)
    AdminQueries         ListNamespaces, ListBlocks, the index's figures (admin_queries.py)

Everything runs on the event loop except the byte copies (CopyQueue threads).
Errors are raised as DepotError or as the core's own exceptions; the services
map both to a status with one table (kvdepot.server.errors). Other parts plug in
through explicit calls: `attach_fd_receiver`, `add_memory_path` (every memory
path, kvdepot.server.memory.paths), `attach_tier` (each tier below the pool, in
order, kvdepot.server.core.tier: Prefetch and their GetStats figures go through the
state), `add_event_listener`, `add_transfer_observer`. The services call nothing
else: not the index, not the tiers (tests/test_service_facade.py). How the state
starts (warm restart, crash recovery) is kvdepot.server.state.startup.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvdepot.common.jobs import Job, JobResult
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueues
from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.kinds import PutOutcome
from kvdepot.server.memory import journal_file, pool_file
from kvdepot.server.memory.arena import Arena
from kvdepot.server.resources import Headroom
from kvdepot.server.state import startup
from kvdepot.server.state.admin_evict import AdminEviction
from kvdepot.server.state.admin_queries import AdminQueries
from kvdepot.server.state.events import EventBus
from kvdepot.server.state.facade import forward, forward_value
from kvdepot.server.state.inline import InlinePath
from kvdepot.server.state.invariants import check_invariants, mutation
from kvdepot.server.state.jobs import JobCounts, JobLimits, JobRunner, check_job_counts
from kvdepot.server.state.key_calls import KeyCalls
from kvdepot.server.state.namespaces import NamespaceAccess
from kvdepot.server.state.registry import SessionRegistry
from kvdepot.server.state.sessions import FdSource, Registration, Session, Sessions
from kvdepot.server.state.settings import StateConfig
from kvdepot.server.state.stats import stats_fields
from kvdepot.server.state.tiers import TiersBelow
from kvdepot.server.state.traffic import Traffic, TransferObserver

log = logging.getLogger("kvdepot.state")


class EventStreamCounts(Protocol):
    """What GetStats reads of the KV-event publisher (kvdepot.server.kv_events)."""

    published: int  # batches sent
    dropped: int  # index events dropped, its queue full


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
        # The CPU clock of the thread building the state: the event loop's (`create` runs
        # there, as every method does). Read from any thread; GetStats' loop_cpu_seconds
        # counts from here, as uptime does (not the imports and start-up before).
        self._loop_cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._loop_cpu_started = time.clock_gettime(self._loop_cpu_clock)
        self.warm_restarted = warm_restarted
        self._pool_lock = pool_lock
        self._sessions = Sessions(
            config.max_sessions,
            config.max_registrations_per_session,
            Headroom(config.fd_reserve) if headroom else None,
            max_per_pid=config.max_sessions_per_pid,
            max_per_uid=config.max_sessions_per_uid,
            max_unattested=config.max_unattested_sessions,
            max_calls_per_account=config.max_calls_per_pid,
            # "auto" (0): a quarter of the server's concurrent-call limit (16 per session
            # of --max-sessions, kvdepot.server.service.bounds.RPCS_PER_SESSION).
            max_calls_per_uid=config.max_calls_per_uid or config.max_sessions * 4,
        )
        self.traffic = Traffic()
        # The shared CPU copy threads (`copy_queue`: jobs, inline and tier copies) and
        # each GPU's own (`copy_queues.devices`: its jobs' DMA waits, on its node).
        self.copy_queues = CopyQueues(
            config.copy_threads,
            arena.placement.cpus(config.copy_threads),
            device_threads=config.gpu_copy_threads,
            device_placement=arena.placement.device_threads,
        )
        self.copy_queue = self.copy_queues.shared
        self.jobs = JobRunner(
            index,
            self._sessions,
            arena,
            self.copy_queues,
            self.traffic,
            JobLimits(config.max_job_keys, config.max_job_blocks, config.max_job_pages),
            lambda: self.shutting_down,
        )
        self.inline = InlinePath(index, arena, self.copy_queue, self.traffic)
        self.shutting_down = False
        # `kvdepot serve --kv-events`' publisher, for GetStats' figures (the daemon's).
        self.event_stream: EventStreamCounts | None = None
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
        # session ids are the index's owners (Owner is any Hashable)
        index.writing_room = self.access.writing_room  # type: ignore[assignment]
        index.internal_writers = self.internal_writers  # type: ignore[assignment]
        self.invariant_failure: str | None = None
        self.admin = AdminEviction(index, config, self.verify_invariants)
        # The facets whose calls the state offers as its own (the forward rows below).
        self.registry = SessionRegistry(
            self._sessions,
            index,
            bus,
            self.access,
            shutting_down=lambda: self.shutting_down,
            journal=lambda: self.journal,
            verify_invariants=self.verify_invariants,
        )
        self.keys = KeyCalls(
            index, bus, self.access, self._sessions, config.max_batch_keys, self.verify_invariants
        )
        self.tiers = TiersBelow(index, bus, self.access, self.keys)
        self.queries = AdminQueries(index)
        # With --pool-file: the crash journal, and the recovery of a killed daemon's rows.
        self.journal: journal_file.Journal | None = None
        self.recovery = journal_file.RecoveryProgress()
        self._recovery: journal_file.Recovery | None = None
        self._compaction: asyncio.Task[None] | None = None

    @classmethod
    def create(cls, config: StateConfig) -> DepotState:
        """The arena, a fresh, warm-restarted or recovering index, and the state
        over them (kvdepot.server.state.startup)."""
        pool = startup.open_pool(config)
        st = cls(
            config,
            pool.arena,
            pool.index,
            pool.bus,
            warm_restarted=pool.warm_restarted,
            pool_lock=pool.pool_lock,
            headroom=True,
        )
        if pool.journalled and config.pool_file:  # journalled: with a pool file
            st.journal, st._recovery = startup.start_journal(
                pool, config.pool_file, st.boot_id, st.recovery
            )
        return st

    # -- hooks -------------------------------------------------------------------------

    def attach_fd_receiver(self, receiver: FdSource) -> None:
        """The fd socket that shared-memory (and process-memory) registrations
        claim their fds from."""
        self._sessions.fd_source = receiver

    @property
    def fd_receiver(self) -> FdSource | None:
        return self._sessions.fd_source

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

    def pool_usage(self) -> tuple[int, int, int]:
        """The pool's bytes used, in rows being written, and pinned (a Session's
        keepalive: vLLM's offload usage gauges)."""
        index = self.index
        return index.allocator.used_bytes, index.writing_bytes(), index.pinned_bytes

    @property
    def loop_cpu_seconds(self) -> float:
        """CPU seconds the event loop's thread has used since the state was built: the
        control plane's work."""
        return time.clock_gettime(self._loop_cpu_clock) - self._loop_cpu_started

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
        stopped = self.copy_queues.close()
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
        # A hung copy's queued jobs fail even when no new job comes to find the stall.
        self.copy_queues.check_stalls()
        expired = self.index.expire_reservations()
        if expired:
            log.warning("dropped %d block row(s) whose ranks never all stored", expired)
        # Namespaces emptied by eviction, or whose last copy has ended since; not
        # while a crash recovery may still adopt rows into them.
        if self.recovery.complete or self._recovery is None:
            self.registry.forget_unused()
        if self.fd_receiver is not None:
            stale = self.fd_receiver.expire()
            if stale:
                log.warning("closed %d fd(s) that no RegisterKV claimed", stale)

    # -- the facets' calls (each facet's module documents them) -------------------------

    # Sessions and registrations (kvdepot.server.state.registry).
    open_session = forward("registry", SessionRegistry.open_session)
    attest = forward("registry", SessionRegistry.attest)
    issue_ticket = forward("registry", SessionRegistry.issue_ticket)
    close_session = forward("registry", SessionRegistry.close_session)
    session = forward("registry", SessionRegistry.session)
    declare = forward("registry", SessionRegistry.declare)
    register = forward("registry", SessionRegistry.register)
    observe = forward("registry", SessionRegistry.observe)
    unregister = forward("registry", SessionRegistry.unregister)
    # The sessions, registrations and memory paths themselves, the fd socket's passed
    # fds and the identity refusals (kvdepot.server.state.sessions).
    sessions: Mapping[str, Session] = forward_value("_sessions.sessions", "session id -> Session")
    registrations: Mapping[int, Registration] = forward_value(
        "_sessions.registrations", "registration id -> Registration"
    )
    permission_denied: int = forward_value("_sessions.permission_denied", "identity refusals")
    add_memory_path = forward("_sessions", Sessions.add_memory_path)
    memory_path = forward("_sessions", Sessions.memory_path)
    takes_fds = forward("_sessions", Sessions.takes_fds)
    claim_passed = forward("_sessions", Sessions.claim_passed)
    deny = forward("_sessions", Sessions.deny)
    open_call = forward("_sessions", Sessions.open_call)
    close_call = forward("_sessions", Sessions.close_call)
    # Lookup, Pin, Unpin, Watch (kvdepot.server.state.key_calls).
    lookup = forward("keys", KeyCalls.lookup)
    pin = forward("keys", KeyCalls.pin)
    unpin = forward("keys", KeyCalls.unpin)
    add_watcher = forward("keys", KeyCalls.add_watcher)
    remove_watcher = forward("keys", KeyCalls.remove_watcher)
    ready_keys = forward("keys", KeyCalls.ready_keys)
    ready_after = forward("keys", KeyCalls.ready_after)
    chunk_events = forward("keys", KeyCalls.chunk_events)
    # The tiers below the pool, the disk and the fleet's (kvdepot.server.state.tiers).
    attach_tier = forward("tiers", TiersBelow.attach_tier)
    has_tier_below: bool = forward_value("tiers.has_tier_below", "a tier below the pool is on")
    tiers_healthy: bool = forward_value("tiers.tiers_healthy", "one of the tiers below is up")
    tier_stats = forward("tiers", TiersBelow.tier_stats)
    prefetch = forward("tiers", TiersBelow.prefetch)
    # The operators' queries (kvdepot.server.state.admin_queries).
    capacity_bytes: int = forward_value("queries.capacity_bytes", "the pool's bytes")
    namespaces = forward("queries", AdminQueries.namespaces)
    list_blocks = forward("queries", AdminQueries.list_blocks)
    pinned_blocks = forward("queries", AdminQueries.pinned_blocks)
    evictions_by_reason = forward("queries", AdminQueries.evictions_by_reason)
    # Admin/Evict and Admin/Clear a slice at a time (kvdepot.server.state.admin_evict).
    evict_in_slices = forward("admin", AdminEviction.evict_in_slices)
    clear_in_slices = forward("admin", AdminEviction.clear_in_slices)
    slices_yielded: int = forward_value("admin.slices_yielded", "bulk-eviction slices so far")

    job_limits: JobLimits = forward_value("jobs.limits", "the largest job taken (--max-job-*)")

    def admit_job(self, session_id: str, registration_id: int, counts: JobCounts) -> None:
        """A Transfer job (stream or lane), before anything is built from its message:
        its session must be open (FAILED_PRECONDITION), its lists no longer than any
        job may have (`check_job_counts`), and its session must have joined the
        namespace of the registration it names (PERMISSION_DENIED; the message never
        names that namespace). An unknown registration is left to the job runner."""
        session = self._sessions.get(session_id)
        check_job_counts(counts, self.jobs.limits)
        reg = self._sessions.registrations.get(registration_id)
        if reg is not None and reg.layout.id not in session.namespaces:
            raise errors.denied(
                f"registration {registration_id} is of a namespace this session has not "
                f"joined: RegisterKV into the namespace first"
            )

    # -- admin: Evict and Clear (kvdepot.server.state.admin_evict) ---------------------

    @mutation
    def evict(self, namespace_id: str, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Admin/Evict in one go (direct use, tests): see AdminEviction.evict."""
        return self.admin.evict(namespace_id, keys)

    @mutation
    def clear(self) -> tuple[int, int]:
        """Admin/Clear in one go (direct use, tests): see AdminEviction.clear."""
        return self.admin.clear()

    # -- transfers ---------------------------------------------------------------------

    @mutation
    async def run_job(self, job: Job) -> JobResult:
        """One Transfer job (see kvdepot.server.state.jobs). Never raises."""
        return await self.jobs.run(job)

    @mutation
    async def put(
        self, session_id: str, namespace_id: str, key: bytes, rank: int, data: bytes
    ) -> tuple[PutOutcome, bool, str]:
        self.access.registered(session_id, namespace_id)
        return await self.inline.put(session_id, namespace_id, key, rank, data)

    def section_bytes(self, session_id: str, namespace_id: str, key: bytes, rank: int) -> int:
        """What a Put of `rank`'s section of `key` carries, in a namespace the session
        joined (PutParts reads no more); DepotError otherwise."""
        self.access.registered(session_id, namespace_id)
        return self.inline.section_bytes(namespace_id, key, rank)

    @mutation
    async def get(self, session_id: str, namespace_id: str, key: bytes, rank: int) -> bytes:
        self.access.registered(session_id, namespace_id)
        return await self.inline.get(namespace_id, key, rank)

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
        """Admin/GetStats' fields of the pool, the index, the sessions and the traffic
        (see kvdepot.server.state.stats; admin.proto says what each one means)."""
        return stats_fields(self)
