"""The daemon's state and operations, between the sans-I/O core and gRPC.

`DepotState` owns the arena, the block index, sessions, registrations, pending
fds and watchers. The gRPC servicers translate messages into calls on it and
`DepotError`s into status codes; everything here runs on the event loop except
the byte copies, which go to the copy threads.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import kvdepot
from kvdepot.server import errors
from kvdepot.server.config import ServeConfig, format_size
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core import snapshot
from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.arena import Arena
from kvdepot.server.core.copy_engine import (
    LOAD,
    STORE,
    CopyEngine,
    CpuCopyEngine,
    MappedRegion,
    SharedMemoryRegion,
)
from kvdepot.server.core.index import (
    BlockIndex,
    IndexEvent,
    LayoutMismatch,
    Slot,
    StoreOutcome,
    UnknownNamespace,
)
from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_key
from kvdepot.server.core.planner import CopyPlan, LayerRef, MemoryMap, TensorView, plan_job
from kvdepot.server.fd_receiver import FdReceiver

log = logging.getLogger("kvdepot.state")

def seal_against_shrinking(fd: int) -> None:
    """Makes sure the client cannot shrink the file while the daemon maps it.

    A copy that touches a page past the end of a shrunk file gets SIGBUS, which
    kills the whole daemon, so a file that cannot be sealed is refused (ValueError).
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if not seals & fcntl.F_SEAL_SHRINK:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except OSError as exc:
        raise ValueError(
            f"the file cannot be sealed against shrinking ({exc.strerror}): pass a memfd "
            f"created with MFD_ALLOW_SEALING (kvdepot.client.SharedKVBuffer does), so that "
            f"truncating it cannot crash the daemon"
        ) from None


WATCH_QUEUE_LIMIT = 65536  # events a watcher may lag behind before it is resynced


@dataclass
class Session:
    id: str
    client_name: str
    pid: int
    engine_id: str
    opened: float
    registrations: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Registration:
    id: int
    session_id: str
    layout: NamespaceLayout
    rank: int
    memory_path: str  # "shm", "cuda_ipc", "inline"
    regions: list[MappedRegion]
    memory: MemoryMap | None
    engine: CopyEngine | None
    registered_bytes: int
    inflight: int = 0
    closing: bool = False

    def close_regions(self) -> None:
        for r in self.regions:
            r.close()
        self.regions = []


@dataclass
class JobSpec:
    """A transfer job, decoupled from protobuf."""

    job_id: int
    direction: int
    registration_id: int
    keys: Sequence[bytes]
    block_ids: Sequence[int]
    group_sizes: Sequence[int]
    block_indices: Sequence[int]
    expedited: bool
    session_id: str


@dataclass
class JobOutcome:
    job_id: int
    success: bool
    bytes: int = 0
    copy_seconds: float = 0.0
    total_seconds: float = 0.0
    error: str = ""
    error_code: str = ""
    stored_keys: int = 0
    present_keys: int = 0
    dropped_keys: int = 0
    drop_reason: str = ""


@dataclass
class TrafficStats:
    stores: int = 0
    loads: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    failed_jobs: Counter = field(default_factory=Counter)  # direction name -> jobs
    inflight_jobs: int = 0


class Watcher:
    """One Watch stream's queue. Overflow turns into a resync (fresh snapshot)."""

    def __init__(self, namespace_id: str) -> None:
        self.namespace_id = namespace_id
        self.queue: asyncio.Queue[IndexEvent] = asyncio.Queue()
        self.lagged = False
        self.wakeup = asyncio.Event()

    def push(self, event: IndexEvent) -> None:
        if self.lagged:
            return
        if self.queue.qsize() >= WATCH_QUEUE_LIMIT:
            self.lagged = True
            while not self.queue.empty():
                self.queue.get_nowait()
        else:
            self.queue.put_nowait(event)
        self.wakeup.set()


TransferObserver = Callable[[str, bool, int, float], None]  # direction, ok, bytes, seconds


class DepotState:
    def __init__(self, config: ServeConfig, arena: Arena, index: BlockIndex) -> None:
        self.config = config
        self.arena = arena
        self.index = index
        self.boot_id = secrets.token_hex(8)
        self.started = time.monotonic()
        self.sessions: dict[str, Session] = {}
        self.registrations: dict[int, Registration] = {}
        # Registration ids start at a random point per boot: a client still holding an
        # id from before a restart must get FAILED_PRECONDITION, never another
        # registration's memory (wrong KV). Below 2**53 so JSON tools show them exactly.
        self._next_registration = (secrets.randbits(32) << 20) + 1
        self.watchers: dict[str, set[Watcher]] = {}
        self.traffic = TrafficStats()
        self.copy_queue = CopyQueue(config.copy_threads)
        self.cpu_engine = CpuCopyEngine()
        self.fd_receiver: FdReceiver | None = None
        self.shutting_down = False
        self.shutdown_event = asyncio.Event()
        # Reply queues of open Transfer streams: shutdown ends them (None).
        self.transfer_streams: set[asyncio.Queue] = set()
        self.warm_restarted = False
        self.pool_lock: int | None = None  # fd holding <pool-file>.lock (warm restart)
        self.transfer_observers: list[TransferObserver] = []
        # Engines for other memory paths (the CUDA issue adds "cuda_ipc").
        self.region_openers: dict[str, Callable[[object, Session], tuple[MappedRegion, CopyEngine]]]
        self.region_openers = {}
        # Debug only (the fuzz and fault tests): check the invariants after every
        # mutation; a failure is logged and sticks (Admin/GetStats answers INTERNAL).
        self.debug_invariants = os.environ.get("KVDEPOT_CHECK_INVARIANTS") == "1"
        self.invariant_failure: str | None = None

    @classmethod
    def create(cls, config: ServeConfig) -> DepotState:
        # Warm restart (DESIGN §3): the snapshot beside the pool file is consumed
        # before the arena maps the file, since mapping it may change the file
        # times that the snapshot vouches for.
        plan = None
        pool_lock = None
        if config.pool_file:
            pool_lock = snapshot.lock_pool_file(config.pool_file)  # raises PoolFileBusy
            plan = snapshot.prepare_start(config.pool_file, config.pool_size,
                                          config.slot_granularity)
        arena = Arena(config.pool_size, config.pool_file)

        def new_index() -> BlockIndex:
            allocator = ExtentAllocator(arena.size, config.slot_granularity)
            return BlockIndex(allocator, reservation_timeout=config.reservation_timeout)

        index = new_index()
        warm = plan is not None and snapshot.finish_start(plan, index) is not None
        if plan is not None and not warm:
            index = new_index()  # drop whatever a rejected snapshot half-restored
        state = cls(config, arena, index)
        state.warm_restarted = warm
        state.pool_lock = pool_lock
        return state

    def begin_shutdown(self) -> None:
        """Refuse new work and end the long-lived streams (Session, Watch)."""
        self.shutting_down = True
        self.shutdown_event.set()
        for ws in self.watchers.values():
            for w in ws:
                w.wakeup.set()
        for q in self.transfer_streams:
            q.put_nowait(None)

    @property
    def uptime(self) -> float:
        return time.monotonic() - self.started

    def close(self) -> None:
        self.copy_queue.close()
        if self.fd_receiver is not None:
            self.fd_receiver.close()
        for reg in list(self.registrations.values()):
            reg.close_regions()
        self.arena.flush()
        self.arena.close()
        if self.config.pool_file:
            # After the last copy and the unmap, so the recorded file identity is final.
            snapshot.save_at_shutdown(self.index, self.config.pool_file, self.arena.size,
                                      self.boot_id)
        if self.pool_lock is not None:  # only now may the next daemon take the pool file
            os.close(self.pool_lock)
            self.pool_lock = None

    # -- sessions --------------------------------------------------------------------

    def open_session(self, client_name: str, pid: int, engine_id: str) -> Session:
        if self.shutting_down:
            raise errors.unavailable("the daemon is shutting down: reconnect in a moment")
        s = Session(
            secrets.token_hex(12), client_name[:200], pid, engine_id[:200], time.monotonic()
        )
        self.sessions[s.id] = s
        log.info("session %s opened by %r (pid %d)", s.id, s.client_name, pid)
        return s

    def close_session(self, session_id: str) -> None:
        """Releases everything the session held: registrations, pins, rows, fds."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return
        registrations = len(s.registrations)
        for reg_id in list(s.registrations):
            self._end_registration(self.registrations[reg_id])
        pins, rows = self.index.release_owner(session_id)
        fds = self.fd_receiver.drop_session(session_id) if self.fd_receiver else 0
        self.publish_events()
        log.info(
            "session %s (%r, pid %d) closed: released %d registration(s), %d pin(s), "
            "%d unfinished block row(s), %d pending fd(s)",
            session_id,
            s.client_name,
            s.pid,
            registrations,
            pins,
            rows,
            fds,
        )

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise errors.precondition(
                f"unknown session {session_id!r}: open a Session first and pass its id (after a "
                f"daemon restart every session is gone: reconnect)"
            )
        return s

    # -- registrations ---------------------------------------------------------------

    def declare(self, layout: NamespaceLayout) -> None:
        try:
            self.index.declare_namespace(layout)
        except LayoutMismatch as exc:
            raise errors.precondition(str(exc)) from None
        except LayoutError as exc:
            raise errors.invalid(str(exc)) from None

    def register(
        self,
        session_id: str,
        layout: NamespaceLayout,
        rank: int,
        regions: Sequence[tuple[str, object]],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
    ) -> Registration:
        """Maps the memory and records the registration (regions: (kind, handle))."""
        session = self.session(session_id)
        if not 0 <= rank < layout.world_size:
            raise errors.invalid(f"rank {rank} out of range [0, {layout.world_size})")
        self.declare(layout)
        kinds = {kind for kind, _ in regions}
        if len(kinds) > 1:
            raise errors.invalid(f"one registration uses one memory path, got {sorted(kinds)}")
        mapped: list[MappedRegion] = []
        engine: CopyEngine | None = None
        try:
            for kind, handle in regions:
                region, engine = self._open_region(kind, handle, session)
                mapped.append(region)
            memory = None
            if mapped:
                try:
                    memory = MemoryMap.build(layout, [r.size for r in mapped], tensors, groups)
                except LayoutError as exc:
                    raise errors.invalid(str(exc)) from None
            elif tensors:
                raise errors.invalid("tensors given without any memory region to hold them")
        except BaseException:
            for r in mapped:
                r.close()
            raise
        reg = Registration(
            id=self._next_registration,
            session_id=session_id,
            layout=layout,
            rank=rank,
            memory_path=next(iter(kinds)) if kinds else "inline",
            regions=mapped,
            memory=memory,
            engine=engine,
            registered_bytes=sum(r.size for r in mapped),
        )
        self._next_registration += 1
        self.registrations[reg.id] = reg
        session.registrations.add(reg.id)
        log.info(
            "registration %d: session %s rank %d of namespace %s over %s (%s)",
            reg.id,
            session_id,
            rank,
            layout.id,
            reg.memory_path,
            format_size(reg.registered_bytes),
        )
        return reg

    def _open_region(
        self, kind: str, handle: object, session: Session
    ) -> tuple[MappedRegion, CopyEngine]:
        if kind == "shm":
            token, size = handle  # type: ignore[misc]
            if self.fd_receiver is None:
                raise errors.precondition("this daemon takes no fds (no fd socket)")
            try:
                fd = self.fd_receiver.claim(token, session.id)
            except KeyError as exc:
                raise errors.invalid(exc.args[0]) from None
            try:
                seal_against_shrinking(fd)
                return SharedMemoryRegion(fd, size), self.cpu_engine
            except (OSError, ValueError) as exc:
                raise errors.invalid(f"cannot map the passed fd: {exc}") from None
            finally:
                os.close(fd)  # the mapping holds the memory now
        opener = self.region_openers.get(kind)
        if opener is None:
            raise errors.invalid(
                f"memory path {kind!r} is not available in this daemon (no CUDA device, or "
                f"built without it): use shared memory or inline Put/Get"
            )
        return opener(handle, session)

    def unregister(self, session_id: str, registration_id: int) -> None:
        reg = self._registration(session_id, registration_id)
        self._end_registration(reg)

    def _registration(self, session_id: str, registration_id: int) -> Registration:
        self.session(session_id)
        reg = self.registrations.get(registration_id)
        if reg is None or reg.session_id != session_id or reg.closing:
            raise errors.precondition(
                f"registration {registration_id} is not registered in this session: call "
                f"RegisterKV first (and again after a daemon restart)"
            )
        return reg

    def _end_registration(self, reg: Registration) -> None:
        reg.closing = True
        session = self.sessions.get(reg.session_id)
        if session is not None:
            session.registrations.discard(reg.id)
        if reg.inflight == 0:
            self._drop_registration(reg)

    def _drop_registration(self, reg: Registration) -> None:
        self.registrations.pop(reg.id, None)
        reg.close_regions()

    # -- lookups, pins ---------------------------------------------------------------------

    def _ns_call(self, fn: Callable, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except UnknownNamespace as exc:
            raise errors.not_found(str(exc)) from None
        except LayoutError as exc:
            raise errors.invalid(str(exc)) from None

    def _check_batch(self, keys: Sequence[bytes]) -> None:
        if len(keys) > self.config.max_job_keys * 16:
            raise errors.exhausted(
                f"{len(keys)} keys in one call; at most {self.config.max_job_keys * 16}: split it"
            )

    def lookup(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self._check_batch(keys)
        return self._ns_call(self.index.lookup, namespace_id, keys)

    def pin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.session(session_id)
        self._check_batch(keys)
        return self._ns_call(self.index.pin, namespace_id, keys, session_id)

    def unpin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> int:
        self.session(session_id)
        self._check_batch(keys)
        missing = self._ns_call(self.index.unpin, namespace_id, keys, session_id)
        self.publish_events()
        return missing

    # -- inline bytes -----------------------------------------------------------------------

    def _section(self, namespace_id: str, key: bytes, rank: int) -> tuple[int, int]:
        ns = self._ns_call(self.index.namespace, namespace_id)
        group = self._ns_call(check_key, key, ns.layout.num_groups)
        if not 0 <= rank < ns.layout.world_size:
            raise errors.invalid(f"rank {rank} out of range [0, {ns.layout.world_size})")
        size = ns.layout.section_bytes(group)
        return rank * size, size

    async def put(
        self, session_id: str, namespace_id: str, key: bytes, rank: int, data: bytes
    ) -> tuple[str, bool, str]:
        self.session(session_id)
        offset, size = self._section(namespace_id, key, rank)
        if len(data) != size:
            raise errors.invalid(
                f"data has {len(data)} bytes; rank {rank}'s section of this key's group is "
                f"{size} bytes (blocks_per_chunk x the group's page bytes)"
            )
        decision = self._ns_call(self.index.begin_store, namespace_id, key, rank, session_id)
        if decision.outcome is StoreOutcome.DROPPED:
            return "dropped", False, decision.reason
        if decision.outcome is StoreOutcome.PRESENT:
            slot = decision.slot
            return "present", slot is not None and slot.state.value == "ready", ""
        slot = decision.slot
        assert slot is not None
        ok = False
        t0 = time.perf_counter()
        try:
            await self.copy_queue.run(
                lambda: self.arena.view(slot.extent.offset + offset, size).__setitem__(
                    slice(None), data
                )
            )
            ok = True
        finally:
            ready = self.index.finish_store(slot, rank, ok)
            self.publish_events()
        self.traffic.stores += 1
        self.traffic.stored_bytes += size
        # Observed like a job, so the histograms' counts match the transfer counters.
        for observer in self.transfer_observers:
            observer("store", True, size, time.perf_counter() - t0)
        return "stored", ready, ""

    async def get(self, namespace_id: str, key: bytes, rank: int) -> bytes:
        offset, size = self._section(namespace_id, key, rank)
        slot = self._ns_call(self.index.begin_read, namespace_id, key)
        if slot is None:
            raise errors.not_found(f"key {key.hex()} is not ready in namespace {namespace_id}")
        t0 = time.perf_counter()
        try:
            data = await self.copy_queue.run(
                lambda: bytes(self.arena.view(slot.extent.offset + offset, size))
            )
        finally:
            self.index.end_read(slot)
            self.publish_events()
        self.traffic.loads += 1
        self.traffic.loaded_bytes += size
        for observer in self.transfer_observers:
            observer("load", True, size, time.perf_counter() - t0)
        return data

    # -- transfer jobs ----------------------------------------------------------------------

    async def run_job(self, job: JobSpec) -> JobOutcome:
        """Validates, plans and copies one job. Never raises: failures are outcomes."""
        t0 = time.perf_counter()
        self.traffic.inflight_jobs += 1
        try:
            out = await self._run_job(job)
        except errors.DepotError as exc:
            out = JobOutcome(job.job_id, False, error=exc.message, error_code=exc.code.name)
        except Exception as exc:  # a bug must not take the stream down
            log.exception("job %d failed unexpectedly", job.job_id)
            out = JobOutcome(
                job.job_id, False, error=f"internal error: {exc}", error_code="INTERNAL"
            )
        finally:
            self.traffic.inflight_jobs -= 1
        out.total_seconds = time.perf_counter() - t0
        direction = "store" if job.direction == STORE else "load"
        if not out.success:
            self.traffic.failed_jobs[direction] += 1
        for observer in self.transfer_observers:
            observer(direction, out.success, out.bytes, out.copy_seconds)
        return out

    async def _run_job(self, job: JobSpec) -> JobOutcome:
        if self.shutting_down:
            raise errors.unavailable("the daemon is shutting down")
        reg = self._registration(job.session_id, job.registration_id)
        if reg.memory is None or reg.engine is None:
            raise errors.precondition(
                f"registration {reg.id} has no shared memory (inline): use Put/Get"
            )
        if job.direction not in (STORE, LOAD):
            raise errors.invalid(f"direction must be STORE or LOAD, got {job.direction}")
        if len(job.keys) > self.config.max_job_keys:
            raise errors.exhausted(
                f"job of {len(job.keys)} keys; this daemon takes at most "
                f"{self.config.max_job_keys} (--max-job-keys): split it"
            )
        layout = reg.layout
        try:
            chunks = layout.chunks_per_group(job.group_sizes, job.block_indices)
        except LayoutError as exc:
            raise errors.invalid(str(exc)) from None
        if sum(chunks) != len(job.keys):
            raise errors.invalid(
                f"job carries {len(job.keys)} key(s) but group_sizes/block_indices describe "
                f"{sum(chunks)} chunk(s) ({chunks} per group)"
            )
        if len(set(job.keys)) != len(job.keys):
            raise errors.invalid("a job names the same key twice")
        pos = 0
        for g, n in enumerate(chunks):
            for key in job.keys[pos : pos + n]:
                if self._ns_call(check_key, key, layout.num_groups) != g:
                    raise errors.invalid(
                        f"key {key.hex()[:16]}… is of group {key[-4:].hex()} but sits among "
                        f"group {g}'s keys: keys are group-major, like group_sizes"
                    )
            pos += n
        if job.direction == STORE:
            return await self._store(job, reg)
        return await self._load(job, reg)

    def _plan(self, job: JobSpec, reg: Registration, offsets: list[int | None]) -> CopyPlan:
        assert reg.memory is not None
        try:
            return plan_job(
                reg.layout,
                reg.rank,
                reg.memory,
                job.block_ids,
                job.group_sizes,
                job.block_indices,
                offsets,
            )
        except LayoutError as exc:
            raise errors.invalid(str(exc)) from None

    async def _copy(self, job: JobSpec, reg: Registration, plan: CopyPlan) -> float:
        engine, regions, pool = reg.engine, reg.regions, self.arena.address
        assert engine is not None

        def work() -> float:
            t = time.perf_counter()
            engine.copy(job.direction, regions, pool, plan)
            return time.perf_counter() - t

        reg.inflight += 1
        try:
            return await self.copy_queue.run(work, job.expedited)
        finally:
            reg.inflight -= 1
            if reg.closing and reg.inflight == 0:
                self._drop_registration(reg)

    async def _plan_and_copy(
        self, job: JobSpec, reg: Registration, offsets: list[int | None], out: JobOutcome
    ) -> bool:
        """Plans and copies; a failure is recorded in `out` (and False returned)."""
        try:
            plan = self._plan(job, reg, offsets)
            out.copy_seconds = await self._copy(job, reg, plan) if plan.runs else 0.0
            out.bytes = plan.nbytes
            return True
        except errors.DepotError as exc:
            out.success, out.error, out.error_code = False, exc.message, exc.code.name
        except Exception as exc:
            direction = "store" if job.direction == STORE else "load"
            log.warning("%s job %d: copy failed: %s", direction, job.job_id, exc)
            out.success, out.error, out.error_code = False, f"copy failed: {exc}", "INTERNAL"
        return False

    async def _store(self, job: JobSpec, reg: Registration) -> JobOutcome:
        ns_id, rank = reg.layout.id, reg.rank
        self._plan(job, reg, [None] * len(job.keys))  # validate block ids before reserving
        slots: list[Slot | None] = []
        out = JobOutcome(job.job_id, True)
        for key in job.keys:
            d = self.index.begin_store(ns_id, key, rank, job.session_id)
            if d.outcome is StoreOutcome.WRITE:
                slots.append(d.slot)
            else:
                slots.append(None)
                if d.outcome is StoreOutcome.PRESENT:
                    out.present_keys += 1
                else:
                    out.dropped_keys += 1
                    out.drop_reason = d.reason
        writing = [s for s in slots if s is not None]
        ok = False
        try:
            ok = await self._plan_and_copy(
                job, reg, [s.extent.offset if s else None for s in slots], out
            )
        finally:
            for slot in writing:
                self.index.finish_store(slot, rank, ok)
            self.publish_events()
        if ok:
            out.stored_keys = len(writing)
            self.traffic.stores += 1
            self.traffic.stored_bytes += out.bytes
        return out

    async def _load(self, job: JobSpec, reg: Registration) -> JobOutcome:
        ns_id = reg.layout.id
        slots: list[Slot] = []
        out = JobOutcome(job.job_id, True)
        try:
            for key in job.keys:
                slot = self._ns_call(self.index.begin_read, ns_id, key)
                if slot is None:
                    raise errors.not_found(
                        f"key {key.hex()[:16]}… is not ready in namespace {ns_id} (evicted, or "
                        f"never stored): pin keys before loading them"
                    )
                slots.append(slot)
            await self._plan_and_copy(job, reg, [s.extent.offset for s in slots], out)
        except errors.DepotError as exc:
            out.success, out.error, out.error_code = False, exc.message, exc.code.name
        finally:
            for slot in slots:
                self.index.end_read(slot)
            self.publish_events()
        if out.success:
            self.traffic.loads += 1
            self.traffic.loaded_bytes += out.bytes
        return out

    # -- watch ------------------------------------------------------------------------------

    def add_watcher(self, namespace_id: str) -> tuple[Watcher, list[bytes]]:
        """Subscribes and returns the current ready keys (no event can fall between)."""
        w = Watcher(namespace_id)
        self.watchers.setdefault(namespace_id, set()).add(w)
        return w, self.snapshot(namespace_id)

    def snapshot(self, namespace_id: str) -> list[bytes]:
        ns = self.index.namespaces.get(namespace_id)
        if ns is None:
            return []
        return [k for k, s in ns.slots.items() if s.state.value == "ready"]

    def remove_watcher(self, w: Watcher) -> None:
        ws = self.watchers.get(w.namespace_id)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self.watchers[w.namespace_id]

    def publish_events(self) -> None:
        for event in self.index.take_events():
            for w in self.watchers.get(event.namespace, ()):
                w.push(event)
        if self.debug_invariants:  # every mutation ends here
            self.verify_invariants()

    def check_invariants(self) -> None:
        """Raises AssertionError when the index, the allocator, the sessions and the
        registrations disagree. Holds between any two steps of the event loop."""
        self.index.check_invariants()
        for s in self.sessions.values():
            for reg_id in s.registrations:
                reg = self.registrations.get(reg_id)
                assert reg is not None and reg.session_id == s.id and not reg.closing, (
                    f"session {s.id} lists registration {reg_id}, which is gone or closing"
                )
        for reg in self.registrations.values():
            assert reg.inflight >= 0, f"registration {reg.id}: {reg.inflight} copies in flight"
            if reg.closing:  # kept only while copies still use its mapping
                assert reg.inflight > 0, f"registration {reg.id} closed but still mapped"
        for ns in self.index.namespaces.values():
            for slot in ns.slots.values():
                assert set(slot.pins) <= self.sessions.keys(), (
                    f"block {slot.key.hex()[:16]} pinned by a closed session"
                )
                if slot.state.value == "writing":
                    assert set(slot.writers.values()) <= self.sessions.keys(), (
                        f"block {slot.key.hex()[:16]} reserved by a closed session"
                    )
        assert self.traffic.inflight_jobs >= 0

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

    # -- housekeeping -----------------------------------------------------------------------

    def housekeeping(self) -> None:
        expired = self.index.expire_reservations()
        if expired:
            log.warning("dropped %d block row(s) whose ranks never all stored", expired)
        if self.fd_receiver is not None:
            stale = self.fd_receiver.expire()
            if stale:
                log.warning("closed %d fd(s) that no RegisterKV claimed", stale)
        self.publish_events()
        self.verify_invariants()

    def stats(self) -> dict[str, object]:
        counts = self.index.counts()
        alloc = self.index.allocator
        ix = self.index.stats
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
            "registrations": len(self.registrations),
            "namespaces": len(self.index.namespaces),
            "lookups": ix.lookups,
            "hits": ix.hits,
            "misses": ix.misses,
            "evictions": sum(ix.evictions.values()),
            "stores": self.traffic.stores,
            "loads": self.traffic.loads,
            "stored_bytes": self.traffic.stored_bytes,
            "loaded_bytes": self.traffic.loaded_bytes,
            "dropped_stores": sum(ix.dropped_stores.values()),
            "inflight_jobs": self.traffic.inflight_jobs,
            "pool_backing": self.arena.backing,
            "warm_restarted": self.warm_restarted,
        }
