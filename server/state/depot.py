"""DepotState: the daemon's state and the one API the gRPC services call.

It assembles the parts and owns their life:

    BlockIndex (core)    keys, slots, pins, LRU; announces changes on the EventBus
    EventBus             watchers by namespace (Depot/Watch)
    Sessions             sessions, registrations, memory paths, fd claiming
    JobRunner            Transfer jobs: check once, reserve, plan once, copy
    InlinePath           Put/Get
    AdminEviction        Admin/Evict and Admin/Clear, in slices
    Traffic              job and block counters, transfer observers (metrics)

and offers the calls of its facets, one job each, as its own: a plain method per
call, with the call's signature, that hands it to the facet:

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
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from typing import Any, Protocol

from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueues
from kvdepot.server.core.index import BlockIndex, IndexEvent, Namespace
from kvdepot.server.core.kinds import PutOutcome
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.core.tier import Tier
from kvdepot.server.memory import journal_file, pool_file
from kvdepot.server.memory.arena import Arena
from kvdepot.server.memory.paths import MemoryPathPlugin, PassedFd
from kvdepot.server.peer import Peer
from kvdepot.server.resources import Headroom
from kvdepot.server.state import startup
from kvdepot.server.state.admin_evict import AdminEviction
from kvdepot.server.state.admin_queries import AdminQueries
from kvdepot.server.state.events import EventBus, Watcher
from kvdepot.server.state.inline import InlinePath
from kvdepot.server.state.invariants import check_invariants, mutation
from kvdepot.server.state.jobs import JobLimits, JobRunner
from kvdepot.server.state.key_calls import KeyCalls
from kvdepot.server.state.listing import BlockPage
from kvdepot.server.state.namespaces import NamespaceAccess
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.registry import SessionRegistry
from kvdepot.server.state.sessions import FdSource, Session, Sessions
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
        index.writing_floor = self.access.writing_floor
        index.internal_writers = self.internal_writers  # type: ignore[assignment]
        self.invariant_failure: str | None = None
        self.admin = AdminEviction(index, config, self.verify_invariants)
        # The facets whose calls the state offers as its own (its methods below).
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
    # Plain methods, one per call, each handing it to the facet that answers it: what
    # help() and a type checker read is the call's own signature. A value is a read-only
    # property; a container is handed out as a read-only Mapping.

    # Sessions and registrations (kvdepot.server.state.registry).
    def open_session(
        self,
        client_name: str,
        pid: int,
        engine_id: str,
        *,
        ticket: str = "",
        opener: Hashable | None = None,
    ) -> Session:
        """Depot/OpenSession: see SessionRegistry.open_session."""
        return self.registry.open_session(client_name, pid, engine_id, ticket=ticket, opener=opener)

    def attest(self, session_id: str, peer: Peer) -> None:
        """The fd socket's identity check: see SessionRegistry.attest."""
        self.registry.attest(session_id, peer)

    def issue_ticket(self, peer: Peer) -> str:
        """The fd socket's "ticket" message: see SessionRegistry.issue_ticket."""
        return self.registry.issue_ticket(peer)

    def close_session(self, session_id: str) -> None:
        """Releases everything the session held: see SessionRegistry.close_session."""
        self.registry.close_session(session_id)

    def session(self, session_id: str) -> Session:
        """The open session `session_id` (FAILED_PRECONDITION if none)."""
        return self.registry.session(session_id)

    def declare(self, layout: NamespaceLayout) -> None:
        """Declares a namespace in the index: see SessionRegistry.declare."""
        self.registry.declare(layout)

    def register(
        self,
        session_id: str,
        layout: NamespaceLayout,
        rank: int,
        regions: Sequence[tuple[MemoryPath | str, object]],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
        units: int = 1,
    ) -> Registration:
        """Depot/RegisterKV: see SessionRegistry.register."""
        return self.registry.register(session_id, layout, rank, regions, tensors, groups, units)

    def observe(self, session_id: str, namespace_id: str) -> None:
        """An observer join (RegisterKV naming a namespace id alone): see
        SessionRegistry.observe."""
        self.registry.observe(session_id, namespace_id)

    def unregister(self, session_id: str, registration_id: int) -> None:
        """Depot/UnregisterKV: see SessionRegistry.unregister."""
        self.registry.unregister(session_id, registration_id)

    # The sessions, registrations and memory paths themselves, the fd socket's passed
    # fds and the identity refusals (kvdepot.server.state.sessions).
    @property
    def sessions(self) -> Mapping[str, Session]:
        """session id -> Session (read-only)."""
        return self._sessions.sessions

    @property
    def registrations(self) -> Mapping[int, Registration]:
        """registration id -> Registration (read-only)."""
        return self._sessions.registrations

    @property
    def permission_denied(self) -> int:
        """Identity refusals so far."""
        return self._sessions.permission_denied

    def add_memory_path(self, path: MemoryPathPlugin[Any]) -> None:
        """Serves registrations of `path.kind` with `path`: see Sessions.add_memory_path."""
        self._sessions.add_memory_path(path)

    def memory_path(self, kind: MemoryPath) -> MemoryPathPlugin[Any] | None:
        """The path serving `kind` (None: this daemon has none)."""
        return self._sessions.memory_path(kind)

    def takes_fds(self) -> bool:
        """Whether the fd socket is attached (registrations can claim passed fds)."""
        return self._sessions.takes_fds()

    def claim_passed(self, token: str, session_id: str) -> PassedFd:
        """The fd passed under `token`: see Sessions.claim_passed."""
        return self._sessions.claim_passed(token, session_id)

    def deny(self, message: str, key: Hashable = "refused") -> errors.DepotError:
        """A PERMISSION_DENIED for an identity refusal, counted: see Sessions.deny."""
        return self._sessions.deny(message, key)

    def open_call(self, session_id: str) -> tuple[Hashable, int | None]:
        """Counts one more Depot call in flight: see Sessions.open_call."""
        return self._sessions.open_call(session_id)

    def close_call(self, held: tuple[Hashable, int | None]) -> None:
        """Ends the call `open_call` counted: see Sessions.close_call."""
        self._sessions.close_call(held)

    # Lookup, Pin, Unpin, Watch (kvdepot.server.state.key_calls).
    def lookup(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Depot/Lookup: see KeyCalls.lookup."""
        return self.keys.lookup(session_id, namespace_id, keys)

    def pin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Depot/Pin: see KeyCalls.pin."""
        return self.keys.pin(session_id, namespace_id, keys)

    def unpin(
        self,
        session_id: str,
        namespace_id: str,
        keys: Sequence[bytes],
        touch: Sequence[bytes] = (),
    ) -> int:
        """Depot/Unpin: see KeyCalls.unpin."""
        return self.keys.unpin(session_id, namespace_id, keys, touch)

    def add_watcher(self, session_id: str, namespace_id: str) -> Watcher:
        """Depot/Watch subscribes: see KeyCalls.add_watcher."""
        return self.keys.add_watcher(session_id, namespace_id)

    def remove_watcher(self, w: Watcher) -> None:
        """Depot/Watch ends: see KeyCalls.remove_watcher."""
        self.keys.remove_watcher(w)

    def ready_keys(self, namespace_id: str) -> list[bytes]:
        """The namespace's READY keys: see KeyCalls.ready_keys."""
        return self.keys.ready_keys(namespace_id)

    def ready_after(
        self, namespace_id: str, after: bytes | None, limit: int
    ) -> tuple[list[bytes], bytes | None]:
        """Depot/Watch's snapshot, a batch at a time: see KeyCalls.ready_after."""
        return self.keys.ready_after(namespace_id, after, limit)

    def chunk_events(self, namespace_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Each key's chunk event (WatchEvent.key_events): see KeyCalls.chunk_events."""
        return self.keys.chunk_events(namespace_id, keys)

    # The tiers below the pool, the disk and the fleet's (kvdepot.server.state.tiers).
    def attach_tier(self, tier: Tier) -> None:
        """Adds `tier` below those attached before it: see TiersBelow.attach_tier."""
        self.tiers.attach_tier(tier)

    @property
    def has_tier_below(self) -> bool:
        """A tier below the pool is on."""
        return self.tiers.has_tier_below

    @property
    def tiers_healthy(self) -> bool:
        """One of the tiers below is up."""
        return self.tiers.tiers_healthy

    def tier_stats(self) -> dict[str, object]:
        """The tiers' GetStats fields; none without them."""
        return self.tiers.tier_stats()

    async def prefetch(
        self, session_id: str, namespace_id: str, keys: Sequence[bytes]
    ) -> list[KeyState] | None:
        """Depot/Prefetch: see TiersBelow.prefetch."""
        return await self.tiers.prefetch(session_id, namespace_id, keys)

    # The operators' queries (kvdepot.server.state.admin_queries).
    @property
    def capacity_bytes(self) -> int:
        """The pool's bytes."""
        return self.queries.capacity_bytes

    def namespaces(self) -> list[Namespace]:
        """Every namespace, sorted by id (Admin/ListNamespaces)."""
        return self.queries.namespaces()

    async def list_blocks(
        self, namespace_id: str, group: int | None, page_size: int, page_token: str
    ) -> BlockPage:
        """A page of Admin/ListBlocks: see AdminQueries.list_blocks."""
        return await self.queries.list_blocks(namespace_id, group, page_size, page_token)

    def pinned_blocks(self, session_id: str) -> int:
        """Blocks the session pins now (Admin/ListEngines)."""
        return self.queries.pinned_blocks(session_id)

    def evictions_by_reason(self) -> dict[str, int]:
        """Blocks evicted so far, by reason (GetStats)."""
        return self.queries.evictions_by_reason()

    # Admin/Evict and Admin/Clear a slice at a time (kvdepot.server.state.admin_evict).
    async def evict_in_slices(
        self, namespace_id: str, keys: Sequence[bytes]
    ) -> tuple[int, int, int]:
        """Admin/Evict: see AdminEviction.evict_in_slices."""
        return await self.admin.evict_in_slices(namespace_id, keys)

    async def clear_in_slices(self) -> tuple[int, int]:
        """Admin/Clear: see AdminEviction.clear_in_slices."""
        return await self.admin.clear_in_slices()

    @property
    def slices_yielded(self) -> int:
        """Bulk-eviction slices so far."""
        return self.admin.slices_yielded

    @property
    def job_limits(self) -> JobLimits:
        """The largest job taken (--max-job-*)."""
        return self.jobs.limits

    def admit_job(
        self,
        session_id: str,
        registration_id: int,
        keys: int,
        blocks: int,
        groups: int,
        indices: int,
    ) -> None:
        """A Transfer job, before its message is decoded: see JobRunner.admit_job."""
        self.jobs.admit_job(session_id, registration_id, keys, blocks, groups, indices)

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

    def run_job(self, job: Job) -> Coroutine[Any, Any, JobResult]:
        """One Transfer job (kvdepot.server.state.jobs), to await; never raises. The
        runner's own coroutine (one less a job) unless the invariants are checked."""
        return self._run_job_checked(job) if self.debug_invariants else self.jobs.run(job)

    @mutation
    async def _run_job_checked(self, job: Job) -> JobResult:
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
