"""The job runner: one Transfer job, checked once, planned once, copied once.

    check   the registration, the direction, the size, and the job's shape against
            the namespace and the rank's memory (core.job_check.check_job): once,
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

A registration of several ranks (RegisterKVRequest.unit_count: a canonical namespace's
units, one KV head each) runs claim, plan, copy and settle once per unit, as that unit's
rank with that unit's memory map, all at once (`_run_units`).

No job holds the event loop for long, whatever its content: its sizes (keys,
block ids, pages) are checked against `JobLimits` before anything is built from
it, and the per-key index work (claim, settle) and the per-page planning run in
slices (`KEY_SLICE` keys, `PAGE_SLICE` pages) with the loop yielded between them.

The job comes in as kvdepot.common.jobs.Job (the service reads it off the wire,
kvdepot.server.service.codec) with its session filled in, and ends as a
kvdepot.common.jobs.JobResult. A job never raises: every failure becomes a
JobResult with the status code name that the error table (kvdepot.server.errors)
gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.kinds import Direction
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue, CopyQueues
from kvdepot.server.core.index import BlockIndex, Slot
from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.core.job_check import JobShape, check_job, slice_shape
from kvdepot.server.core.layout import MAX_GROUPS, NamespaceLayout
from kvdepot.server.core.memory_map import MemoryMap
from kvdepot.server.core.planner import CopyPlan, plan_copy
from kvdepot.server.memory.arena import Arena
from kvdepot.server.memory.copy_engine import PreparedCopy
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.sessions import Sessions
from kvdepot.server.state.traffic import Traffic

log = logging.getLogger("kvdepot.state")

# Index work per slice of a job's keys (about 10 us a key) and pages planned per
# slice (about 0.1 us a page, planning and address columns): each slice holds the
# loop for well under 5 ms; the loop is yielded between slices.
KEY_SLICE = 256
PAGE_SLICE = 4096
_DIRECTIONS = {int(d): d for d in Direction}


@dataclass(frozen=True)
class JobLimits:
    """The largest job the daemon takes (--max-job-keys, --max-job-blocks, --max-job-pages)."""

    keys: int = 4096
    blocks: int = 16384
    pages: int = 1 << 20


class JobCounts(NamedTuple):
    """How many keys, block ids, group sizes and block indices a job message carries:
    the lengths of its repeated fields, read before anything is built from them."""

    keys: int
    blocks: int
    groups: int
    indices: int


class JobRunner:
    def __init__(
        self,
        index: BlockIndex,
        sessions: Sessions,
        arena: Arena,
        copy_queues: CopyQueues,
        traffic: Traffic,
        limits: JobLimits | int,
        refusing: Callable[[], bool],
    ) -> None:
        self._index = index
        self._sessions = sessions
        self._arena = arena
        self._copy_queues = copy_queues
        self._traffic = traffic
        # An int is --max-job-keys alone (the other limits at their defaults).
        self.limits = limits if isinstance(limits, JobLimits) else JobLimits(keys=limits)
        self._refusing = refusing  # True once the daemon shuts down

    async def run(self, job: Job) -> JobResult:
        """Checks, plans and copies one job of `job.session_id`. Never raises:
        failures are results."""
        t0 = time.perf_counter()
        out = JobResult(job.job_id, True)
        direction: Direction | None = None
        self._traffic.inflight_jobs += 1
        try:
            direction, reg, shape = self._check(job)
            if reg.more_units:
                await self._run_units(job, direction, reg, shape, out)
            elif direction is Direction.STORE:
                await self._store(job, reg, reg.rank, reg.memory, shape, out)
            else:
                await self._load(job, reg, reg.rank, reg.memory, shape, out)
        except Exception as exc:  # a bug must not take the stream down
            err = errors.as_depot_error(exc)
            if err is None:
                log.exception("job %d failed unexpectedly", job.job_id)
                err = errors.internal(f"internal error: {exc}")
            out.fail(err.code.name, err.message)
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

    def admit_job(
        self,
        session_id: str,
        registration_id: int,
        keys: int,
        blocks: int,
        groups: int,
        indices: int,
    ) -> None:
        """A Transfer job (stream or lane), before anything is built from its message:
        its session must be open (FAILED_PRECONDITION), its lists (their lengths: a
        JobCounts' fields, as plain ints) no longer than any job may have
        (`check_job_counts`), and its session must have joined the namespace of the
        registration it names (PERMISSION_DENIED; the message never names that
        namespace). An unknown registration is left to the job runner."""
        # Every job passes here: the common case (an open session, counts within the
        # limits) is read inline; the calls that raise, with their words, otherwise.
        sessions = self._sessions
        session = sessions.sessions.get(session_id)
        if session is None:
            session = sessions.get(session_id)  # raises
        limits = self.limits
        if (
            keys > limits.keys
            or blocks > limits.blocks
            or groups > MAX_GROUPS
            or indices > MAX_GROUPS
        ):
            check_job_counts(keys, blocks, groups, indices, limits)  # raises
        reg = sessions.registrations.get(registration_id)
        if reg is not None and reg.layout.id not in session.namespaces:
            raise errors.denied(
                f"registration {registration_id} is of a namespace this session has not "
                f"joined: RegisterKV into the namespace first"
            )

    def _check(self, job: Job) -> tuple[Direction, Registration, JobShape]:
        if self._refusing():
            raise errors.unavailable("the daemon is shutting down")
        reg = self._sessions.registration(job.session_id, job.registration_id)
        if reg.memory is None or reg.engine is None:
            raise errors.precondition(
                f"registration {reg.id} has no shared memory (inline): use Put/Get"
            )
        direction = _DIRECTIONS.get(job.direction)  # a dict: Direction(x) costs more
        if direction is None:
            raise errors.invalid(f"direction must be STORE or LOAD, got {job.direction}")
        check_job_size(job, reg.layout, self.limits)
        shape = check_job(
            reg.layout,
            reg.memory,
            job.block_ids,
            job.group_sizes,
            job.block_indices,
            keys=job.keys,
        )
        return direction, reg, shape

    async def _run_units(
        self, job: Job, direction: Direction, reg: Registration, shape: JobShape, out: JobResult
    ) -> None:
        """A registration of several ranks (a canonical namespace's units): the job is
        run once per unit, as that unit's rank with that unit's memory, all at once.
        Every unit's part has ended before this returns or raises (a failed one must
        not leave another still copying into memory the engine takes back). `out` sums
        the bytes and takes the most keys a unit's part stored or dropped and the
        fewest it found present."""
        parts = [JobResult(job.job_id, True) for _ in range(reg.unit_count)]
        runs = [
            self._store(job, reg, rank, memory, shape, part)
            if direction is Direction.STORE
            else self._load(job, reg, rank, memory, shape, part)
            for (rank, memory), part in zip(reg.units(), parts, strict=True)
        ]
        ended = await asyncio.gather(*runs, return_exceptions=True)
        out.bytes = sum(p.bytes for p in parts)
        out.copy_seconds = max(p.copy_seconds for p in parts)
        out.stored_keys = max(p.stored_keys for p in parts)
        out.present_keys = min(p.present_keys for p in parts)
        out.dropped_keys = max(p.dropped_keys for p in parts)
        out.drop_reason = next((p.drop_reason for p in parts if p.drop_reason), "")
        for failure in ended:
            if isinstance(failure, BaseException):
                raise failure

    async def _store(
        self,
        job: Job,
        reg: Registration,
        rank: int,
        memory: MemoryMap | None,
        shape: JobShape,
        out: JobResult,
    ) -> None:
        index = self._index
        # One index call each way per KEY_SLICE keys: the per-key work, the
        # namespace lookup and the events are paid once a slice, and a large job
        # lets other clients' calls run between its slices.
        offsets: list[int | None] = []
        claimed: list[Slot] = []
        ok = False
        events = chunk_events_of(job)
        try:
            for start in range(0, len(job.keys), KEY_SLICE):
                if start:
                    await asyncio.sleep(0)
                end = start + KEY_SLICE
                claim = index.begin_store_many(
                    reg.layout.id,
                    job.keys[start:end],
                    rank,
                    job.session_id,
                    shape.key_groups[start:end],  # checked by check_job
                )
                if events:
                    index.keep_chunk_events(reg.layout.id, claim.slots, events)
                claimed += claim.slots
                offsets += claim.offsets
                out.present_keys += claim.present
                out.dropped_keys += claim.dropped
                if claim.drop_reason is not None:
                    out.drop_reason = claim.drop_reason.text
            await self._copy(job, reg, rank, memory, shape, offsets, out)
            ok = True
        finally:
            if len(claimed) <= KEY_SLICE:  # one slice: settled at once, no coroutine
                index.finish_store_many(claimed, rank, ok)
            else:
                await _in_slices(claimed, lambda part: index.finish_store_many(part, rank, ok))
        out.stored_keys = len(claimed)

    async def _load(
        self,
        job: Job,
        reg: Registration,
        rank: int,
        memory: MemoryMap | None,
        shape: JobShape,
        out: JobResult,
    ) -> None:
        ns_id, index = reg.layout.id, self._index
        slots: list[Slot] = []
        keys = job.keys
        try:
            # One index call per KEY_SLICE keys, as for stores.
            for start in range(0, len(keys), KEY_SLICE):
                if start:
                    await asyncio.sleep(0)
                part = keys[start : start + KEY_SLICE]
                held = index.begin_read_many(ns_id, part)
                slots += held
                if len(held) < len(part):
                    key = part[len(held)]
                    raise errors.not_found(
                        f"key {key.hex()[:16]}… is not ready in namespace {ns_id} (evicted, or "
                        f"never stored): pin keys before loading them"
                    )
            offsets = [s.extent.offset for s in slots]
            await self._copy(job, reg, rank, memory, shape, offsets, out)
        finally:
            if len(slots) <= KEY_SLICE:  # one slice: settled at once, no coroutine
                index.end_read_many(slots)
            else:
                await _in_slices(slots, index.end_read_many)

    async def _copy(
        self,
        job: Job,
        reg: Registration,
        rank: int,
        memory: MemoryMap | None,
        shape: JobShape,
        offsets: Sequence[int | None],
        out: JobResult,
    ) -> None:
        """Plans and copies `rank`'s section from or to `memory` (the registration's,
        or one of its units'); the bytes and copy time go into `out`. Raises
        DepotError (a copy that failed is INTERNAL, or what the engine said)."""
        assert memory is not None and reg.engine is not None
        copy_queue = self._copy_queues.for_device(reg.copy_device)
        copy_queue.refuse_if_stalled()
        if shape_pages(reg.layout, shape) > PAGE_SLICE:
            await self._copy_in_slices(job, reg, rank, memory, copy_queue, shape, offsets, out)
            return
        plan = plan_copy(reg.layout, rank, memory, shape, offsets)
        if len(plan):
            out.copy_seconds = await self._run_copy(job, reg, copy_queue, plan)
        out.bytes = plan.nbytes  # only once the bytes have landed

    async def _copy_in_slices(
        self,
        job: Job,
        reg: Registration,
        rank: int,
        memory: MemoryMap,
        copy_queue: CopyQueue,
        shape: JobShape,
        offsets: Sequence[int | None],
        out: JobResult,
    ) -> None:
        """`_copy` for a job of more than PAGE_SLICE pages: each slice is planned and
        prepared on the loop, then handed to the copy threads at once (the slices
        copy in parallel, as a large plan's parts do), the loop yielded between
        slices. Every slice handed over has ended before this returns or raises."""
        engine, regions, pool = reg.engine, reg.regions, self._arena.address
        assert engine is not None
        copies: list[asyncio.Future[tuple[float, float]]] = []
        nbytes = 0
        with self._sessions.in_use(reg):
            try:
                for part in slice_shape(reg.layout, shape, PAGE_SLICE):
                    if copies:
                        await asyncio.sleep(0)
                    plan = plan_copy(reg.layout, rank, memory, part, offsets)
                    if not len(plan):
                        continue
                    prepared = engine.prepare(job.direction, regions, pool, plan)
                    nbytes += plan.nbytes
                    copies.append(
                        asyncio.ensure_future(
                            copy_queue.run(functools.partial(_timed, prepared), job.expedited)
                        )
                    )
            except errors.DepotError:
                raise
            except Exception as exc:
                label = Direction(job.direction).label
                log.warning("%s job %d: planning a slice failed: %s", label, job.job_id, exc)
                raise errors.internal(f"copy failed: {exc}") from None
            finally:
                # Slots are settled only after every slice handed over has ended.
                spans = await _all_ended(copies)
            for span in spans:
                if isinstance(span, BaseException):
                    label = Direction(job.direction).label
                    log.warning("%s job %d: copy failed: %s", label, job.job_id, span)
                    if isinstance(span, errors.DepotError):
                        raise span
                    raise errors.internal(f"copy failed: {span}")
        if spans:
            # every span is a (start, end) pair: the exceptions raised above
            out.copy_seconds = max(e for _, e in spans) - min(s for s, _ in spans)  # type: ignore[misc]
        out.bytes = nbytes  # only once the bytes have landed

    async def _run_copy(
        self, job: Job, reg: Registration, copy_queue: CopyQueue, plan: CopyPlan
    ) -> float:
        """Copies on the copy threads; a large plan is cut into parts that
        several idle threads copy at once (one thread's memmove is slower than the
        machine's). Returns seconds from the first part's start to the last's end."""
        engine, regions, pool = reg.engine, reg.regions, self._arena.address
        assert engine is not None
        direction = job.direction
        parts: list[CopyPlan] | None = None  # None: the plan whole (most jobs)
        if engine.parallel_min_bytes:
            # Cut only for threads that would otherwise wait: when every thread has a
            # copy already (a TP=8 engine's ranks send eight jobs at once), parts add
            # hand-offs and no speed.
            parts = plan.split(copy_queue.idle, engine.parallel_min_bytes)
            if len(parts) == 1:
                parts = None
        sessions = self._sessions
        sessions.begin_use(reg)  # Sessions.in_use, without a generator: every job
        try:
            # Planned here, on the loop: the copy threads then hardly need the GIL.
            if parts is None:
                prepared = engine.prepare(direction, regions, pool, plan, self._arena.size)
                t0, t1 = await copy_queue.run(functools.partial(_timed, prepared), job.expedited)
                return t1 - t0
            copies = [engine.prepare(direction, regions, pool, p, self._arena.size) for p in parts]
            # Every part ends before the job does (return_exceptions): a
            # failed part must not release slots another part still writes.
            spans = await asyncio.gather(
                *(copy_queue.run(functools.partial(_timed, c), job.expedited) for c in copies),
                return_exceptions=True,
            )
            for span in spans:
                if isinstance(span, BaseException):
                    raise span
            # every span is a (start, end) pair: the exceptions raised above
            return max(e for _, e in spans) - min(s for s, _ in spans)  # type: ignore[misc]
        except errors.DepotError:
            raise
        except Exception as exc:
            label = Direction(job.direction).label
            log.warning("%s job %d: copy failed: %s", label, job.job_id, exc)
            raise errors.internal(f"copy failed: {exc}") from None
        finally:
            sessions.end_use(reg)


def check_job_counts(keys: int, blocks: int, groups: int, indices: int, limits: JobLimits) -> None:
    """Refuses a job whose lists (a JobCounts' fields, as plain ints: every job passes
    here twice, and few are refused) are longer than any job may have: more keys or
    block ids than `limits` (RESOURCE_EXHAUSTED, naming the limit), more group sizes
    or block indices than a namespace has groups (INVALID_ARGUMENT). Lengths only:
    called on the wire message's counts, before a list is made of it (a Transfer
    message of 4 Mi block ids took 0.45 s to copy into a list before it was refused)."""
    if keys > limits.keys:
        raise errors.exhausted(
            f"job of {keys} keys; this daemon takes at most {limits.keys} "
            f"(--max-job-keys): split it"
        )
    if blocks > limits.blocks:
        raise errors.exhausted(
            f"job of {blocks} block ids; this daemon takes at most "
            f"{limits.blocks} (--max-job-blocks): split it"
        )
    if max(groups, indices) > MAX_GROUPS:
        raise errors.invalid(
            f"job of {groups} group sizes and {indices} block indices; a "
            f"namespace has at most {MAX_GROUPS} groups (MAX_GROUPS), one of each per group"
        )


def check_job_size(job: Job, layout: NamespaceLayout, limits: JobLimits) -> None:
    """Refuses (RESOURCE_EXHAUSTED, naming the limit) a job larger than `limits`, from
    its lists' lengths and group_sizes alone: nothing is built from the job before."""
    groups = len(job.group_sizes)
    keys, blocks, indices = len(job.keys), len(job.block_ids), len(job.block_indices)
    # Read inline (every job passes here; few are refused), check_job_counts's words
    # for those that are.
    if keys > limits.keys or blocks > limits.blocks or groups > MAX_GROUPS or indices > MAX_GROUPS:
        check_job_counts(keys, blocks, groups, indices, limits)  # raises
    if groups != layout.num_groups:
        return  # check_job says what is wrong
    # group_sizes and layout.groups have the same length (checked just above).
    pages = sum(map(operator.mul, job.group_sizes, map(len, layout.groups)))
    if pages > limits.pages:
        raise errors.exhausted(
            f"job of {pages} pages (block ids x layers of their group); this daemon takes at "
            f"most {limits.pages} (--max-job-pages): split it"
        )


def chunk_events_of(job: Job) -> dict[bytes, bytes] | None:
    """A store's chunk events by key (TransferJob.key_events), None when it carries
    none; refused (INVALID_ARGUMENT) when they are not one per key or one is larger
    than MAX_CHUNK_EVENT_BYTES, before anything of the job is done."""
    events = job.key_events
    if not events:
        return None
    if len(events) != len(job.keys):
        raise errors.invalid(
            f"key_events: {len(events)} for {len(job.keys)} keys; send one per key or none"
        )
    if max(map(len, events)) > MAX_CHUNK_EVENT_BYTES:
        raise errors.invalid(
            f"key_events: a chunk event over {MAX_CHUNK_EVENT_BYTES} bytes; this daemon "
            "keeps at most that much a key"
        )
    return dict(zip(job.keys, events, strict=True))


def shape_pages(layout: NamespaceLayout, shape: JobShape) -> int:
    """Pages (blocks x layers) a checked job names, skipped keys included."""
    return sum(len(ids) * len(layout.groups[g]) for g, ids, _, _ in shape.groups)


def _timed(copy: PreparedCopy) -> tuple[float, float]:
    t = time.perf_counter()
    copy()
    return t, time.perf_counter()


async def _all_ended(
    futures: Sequence[asyncio.Future[tuple[float, float]]],
) -> list[tuple[float, float] | BaseException]:
    """Waits until every future has ended, even if the caller is cancelled meanwhile
    (a copy that ran on must not outlive the slots it writes); then re-raises the
    cancellation."""
    if not futures:
        return []
    gathered = asyncio.gather(*futures, return_exceptions=True)
    try:
        return await asyncio.shield(gathered)
    except asyncio.CancelledError:
        for f in futures:
            f.cancel()  # CopyQueue: a copy not started is skipped, a running one awaited
        while not gathered.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(gathered)
        raise


async def _in_slices(items: Sequence[Slot], settle: Callable[[Sequence[Slot]], object]) -> None:
    """`settle(part)` for every KEY_SLICE items, the last part first (a job's rows
    are admitted to eviction tail first: kvdepot.server.core.eviction.tail_first),
    yielding the loop between parts; if the caller is cancelled while yielded, the
    rest is settled at once."""
    left = len(items)
    try:
        while left:
            if left < len(items):
                await asyncio.sleep(0)
            start = max(0, (left - 1) // KEY_SLICE * KEY_SLICE)
            part = items[start:left]
            left = start
            settle(part)
    finally:
        if left:
            settle(items[:left])


def _counted_direction(value: int) -> Direction:
    """The direction to count a job under whose direction is invalid (as a load)."""
    return Direction.STORE if value == Direction.STORE else Direction.LOAD
