"""The job runner: one Transfer job, checked once, planned once, copied once.

    check   the registration, the direction, the size, and the job's shape against
            the namespace and the rank's memory (core.planner.check_job): once,
            before anything is reserved
    claim   STORE: reserve each key's slot (BlockIndex.begin_store_many, one call for
            the job), skipping keys already present and those dropped for lack
            of room; LOAD: hold each key's READY slot against eviction
            (begin_read), NOT_FOUND if one is gone
    plan    the checked shape and the slot offsets become byte runs (plan_copy)
    copy    on a copy thread (CopyQueue), by the registration's copy engine, with
            the registration held mapped (Sessions.in_use)
    settle  finish_store_many / end_read for every claimed slot, success or not;
            the index announces what became READY on the event bus by itself

A job never raises: every failure becomes a JobOutcome with the status code name
that the error table (kvdepot.server.errors) gives it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.common.kinds import Direction
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex, Slot
from kvdepot.server.core.planner import CopyPlan, JobShape, check_job, plan_copy
from kvdepot.server.memory.arena import Arena
from kvdepot.server.memory.copy_engine import PreparedCopy
from kvdepot.server.state.sessions import Registration, Sessions
from kvdepot.server.state.traffic import Traffic

log = logging.getLogger("kvdepot.state")


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

    def fail(self, exc: errors.DepotError) -> None:
        self.success, self.error, self.error_code = False, exc.message, exc.code.name


class JobRunner:
    def __init__(
        self,
        index: BlockIndex,
        sessions: Sessions,
        arena: Arena,
        copy_queue: CopyQueue,
        traffic: Traffic,
        max_job_keys: int,
        refusing: Callable[[], bool],
    ) -> None:
        self._index = index
        self._sessions = sessions
        self._arena = arena
        self._copy_queue = copy_queue
        self._traffic = traffic
        self._max_job_keys = max_job_keys
        self._refusing = refusing  # True once the daemon shuts down

    async def run(self, job: JobSpec) -> JobOutcome:
        """Checks, plans and copies one job. Never raises: failures are outcomes."""
        t0 = time.perf_counter()
        out = JobOutcome(job.job_id, True)
        direction: Direction | None = None
        self._traffic.inflight_jobs += 1
        try:
            direction, reg, shape = self._check(job)
            if direction is Direction.STORE:
                await self._store(job, reg, shape, out)
            else:
                await self._load(job, reg, shape, out)
        except Exception as exc:  # a bug must not take the stream down
            err = errors.as_depot_error(exc)
            if err is None:
                log.exception("job %d failed unexpectedly", job.job_id)
                err = errors.internal(f"internal error: {exc}")
            out.fail(err)
        finally:
            self._traffic.inflight_jobs -= 1
        out.total_seconds = time.perf_counter() - t0
        blocks = out.stored_keys if direction is Direction.STORE else len(job.keys)
        self._traffic.record(
            direction or _counted_direction(job.direction),
            out.success,
            blocks,
            out.bytes,
            out.copy_seconds,
        )
        return out

    def _check(self, job: JobSpec) -> tuple[Direction, Registration, JobShape]:
        if self._refusing():
            raise errors.unavailable("the daemon is shutting down")
        reg = self._sessions.registration(job.session_id, job.registration_id)
        if reg.memory is None or reg.engine is None:
            raise errors.precondition(
                f"registration {reg.id} has no shared memory (inline): use Put/Get"
            )
        try:
            direction = Direction(job.direction)
        except ValueError:
            raise errors.invalid(f"direction must be STORE or LOAD, got {job.direction}") from None
        if len(job.keys) > self._max_job_keys:
            raise errors.exhausted(
                f"job of {len(job.keys)} keys; this daemon takes at most "
                f"{self._max_job_keys} (--max-job-keys): split it"
            )
        shape = check_job(
            reg.layout,
            reg.memory,
            job.block_ids,
            job.group_sizes,
            job.block_indices,
            keys=job.keys,
        )
        return direction, reg, shape

    async def _store(
        self, job: JobSpec, reg: Registration, shape: JobShape, out: JobOutcome
    ) -> None:
        rank, index = reg.rank, self._index
        # One index call each way for the whole job: the per-key work, the
        # namespace lookup and the events (one per job) are paid once.
        claim = index.begin_store_many(reg.layout.id, job.keys, rank, job.session_id)
        out.present_keys, out.dropped_keys = claim.present, claim.dropped
        if claim.drop_reason is not None:
            out.drop_reason = claim.drop_reason.text
        ok = False
        try:
            await self._copy(job, reg, shape, claim.offsets, out)
            ok = True
        finally:
            index.finish_store_many(claim.slots, rank, ok)
        out.stored_keys = len(claim.slots)

    async def _load(
        self, job: JobSpec, reg: Registration, shape: JobShape, out: JobOutcome
    ) -> None:
        ns_id, index = reg.layout.id, self._index
        slots: list[Slot] = []
        try:
            for key in job.keys:
                slot = index.begin_read(ns_id, key)
                if slot is None:
                    raise errors.not_found(
                        f"key {key.hex()[:16]}… is not ready in namespace {ns_id} (evicted, or "
                        f"never stored): pin keys before loading them"
                    )
                slots.append(slot)
            await self._copy(job, reg, shape, [s.extent.offset for s in slots], out)
        finally:
            for slot in slots:
                index.end_read(slot)

    async def _copy(
        self,
        job: JobSpec,
        reg: Registration,
        shape: JobShape,
        offsets: Sequence[int | None],
        out: JobOutcome,
    ) -> None:
        """Plans and copies; the bytes and copy time go into `out`. Raises
        DepotError (a copy that failed is INTERNAL, or what the engine said)."""
        assert reg.memory is not None and reg.engine is not None
        plan = plan_copy(reg.layout, reg.rank, reg.memory, shape, offsets)
        if len(plan):
            out.copy_seconds = await self._run_copy(job, reg, plan)
        out.bytes = plan.nbytes  # only once the bytes have landed

    async def _run_copy(self, job: JobSpec, reg: Registration, plan: CopyPlan) -> float:
        """Copies on the copy threads; a large plan is cut into parts that
        several threads copy at once (one thread's memmove is slower than the
        machine's). Returns seconds from the first part's start to the last's end."""
        engine, regions, pool = reg.engine, reg.regions, self._arena.address
        assert engine is not None
        direction = job.direction
        parts = [plan]
        if engine.parallel_min_bytes:
            parts = plan.split(self._copy_queue.threads, engine.parallel_min_bytes)

        def work(copy: PreparedCopy) -> tuple[float, float]:
            t = time.perf_counter()
            copy()
            return t, time.perf_counter()

        with self._sessions.in_use(reg):
            try:
                # Planned here, on the loop: the copy threads then hardly need the GIL.
                copies = [engine.prepare(direction, regions, pool, p) for p in parts]
                if len(copies) == 1:
                    t0, t1 = await self._copy_queue.run(lambda: work(copies[0]), job.expedited)
                    return t1 - t0
                # Every part ends before the job does (return_exceptions): a
                # failed part must not release slots another part still writes.
                spans = await asyncio.gather(
                    *(
                        self._copy_queue.run(functools.partial(work, c), job.expedited)
                        for c in copies
                    ),
                    return_exceptions=True,
                )
                for span in spans:
                    if isinstance(span, BaseException):
                        raise span
                return max(e for _, e in spans) - min(s for s, _ in spans)  # type: ignore[misc]
            except errors.DepotError:
                raise
            except Exception as exc:
                label = Direction(job.direction).label
                log.warning("%s job %d: copy failed: %s", label, job.job_id, exc)
                raise errors.internal(f"copy failed: {exc}") from None


def _counted_direction(value: int) -> Direction:
    """The direction to count a job under whose direction is invalid (as a load)."""
    return Direction.STORE if value == Direction.STORE else Direction.LOAD
