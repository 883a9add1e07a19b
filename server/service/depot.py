"""kvdepot.v1.Depot over grpc.aio: a thin translation onto DepotState.

Messages become state calls; errors become statuses through `reports_errors`
(one table, kvdepot.server.errors).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable

import grpc

import kvdepot
from kvdepot.common.jobs import JobResult
from kvdepot.common.kinds import TICKET_METADATA
from kvdepot.server import errors
from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.kinds import EventKind, Tier
from kvdepot.server.service.bounds import check_register_size
from kvdepot.server.service.codec import (
    JobMessage,
    OversizedJob,
    job_from_proto,
    layout_from_proto,
    memory_from_proto,
    read_job,
    result_to_proto,
)
from kvdepot.server.service.job_lane import JobLanes
from kvdepot.server.service.status import abort_with, reports_errors
from kvdepot.server.state import DepotState
from kvdepot.v1 import depot_pb2 as pb
from kvdepot.v1 import depot_pb2_grpc

log = logging.getLogger("kvdepot.depot")

SNAPSHOT_BATCH = 4096  # keys in one message of events
SNAPSHOT_SLICE = 1024  # keys of a namespace a Watch snapshot reads at a time
# Jobs of one Transfer stream running or answered but not yet taken by the client.
MAX_UNREAD_RESULTS = 1024


# RegisterKVResponse.memory_path of an observer join.
OBSERVER = "observer"


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    """The call's metadata `key` ("" when absent)."""
    for item in context.invocation_metadata() or ():
        if item[0] == key:
            value = item[1]
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""


def transport_opener(context: grpc.aio.ServicerContext) -> tuple[str, str, str] | None:
    """Who opens a session, as the transport says: a TCP peer's host and TLS
    certificate name (("tcp", host, name); its port changes per connection); None on
    the Unix socket, which names nobody (the fd socket's ticket or attest does)."""
    peer = context.peer() or ""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = address.rpartition(":")[0]
    auth = context.auth_context() or {}
    names = auth.get("x509_subject_alternative_name") or auth.get("x509_common_name") or ()
    name = b",".join(sorted(names)).decode("utf-8", "replace")
    return ("tcp", host, name)


def is_observer_join(request: pb.RegisterKVRequest) -> bool:
    """A RegisterKV naming the namespace id alone (no groups) and no memory: a
    scheduler joining to Watch, Lookup, Pin and Prefetch (kvdepot.server.state.namespaces)."""
    return not (request.namespace.groups or request.regions or request.tensors or request.groups)


WATCH_KINDS = {EventKind.STORED: pb.WatchEvent.STORED, EventKind.REMOVED: pb.WatchEvent.REMOVED}
# Prefetch's answers (kvdepot.server.core.prefix_fetch.KeyState's values): a disk fetch is
# FETCHING on the wire, with from_disk.
_FETCHING, _FETCHING_DISK = pb.PrefetchResponse.FETCHING, 4
WATCH_TIERS = {Tier.POOL: pb.WatchEvent.TIER_POOL, Tier.DISK: pb.WatchEvent.TIER_DISK}


def event_reason(event: IndexEvent) -> str:
    return event.reason.text if event.reason is not None else ""


def _chunk_events_of(st: DepotState, run: IndexEvent) -> list[bytes] | tuple[bytes, ...]:
    """A Watch message's key_events: a STORED run's rows' (read now, from the pool or
    a tier below); a REMOVED run's, taken as the rows went (their slots are gone)."""
    if run.kind is EventKind.STORED:
        return st.chunk_events(run.namespace, run.keys)
    return run.chunk_events


class DepotServicer(depot_pb2_grpc.DepotServicer):
    def __init__(self, state: DepotState) -> None:
        self.state = state
        self._snapshot_turn = asyncio.Lock()  # one Watch snapshot slice read at a time
        # Job lanes (OpenJobLane) run their jobs through the same `answer_job`.
        self.lanes = JobLanes(state, self.answer_job, MAX_UNREAD_RESULTS)

    def request_parsers(self) -> dict[str, Callable[[bytes], object]]:
        """Request types parsed otherwise than by protobuf's FromString (wire.py): a
        TransferJob's lists are counted before they are decoded (codec.read_job)."""
        read = functools.partial(read_job, limits=self.state.job_limits)
        return {pb.TransferJob.DESCRIPTOR.full_name: read}

    async def answer_job(self, job: JobMessage) -> pb.TransferResult:
        """One Transfer job, from a stream or a lane. Never raises (failures are results)."""
        try:  # an open session, counts within bounds, the namespace joined: before lists
            if isinstance(job, OversizedJob):  # its lists too long: never decoded
                self.state.admit_job(job.session_id, job.registration_id, *job.counts)
                raise errors.internal("an oversized job was admitted")  # cannot happen
            # The lists' lengths (len() of a repeated field copies nothing). Each read of
            # a repeated field makes its container anew (about 0.3 µs) unless one is
            # still alive: these stay alive until job_from_proto has read them again.
            keys, block_ids = job.keys, job.block_ids
            group_sizes, block_indices = job.group_sizes, job.block_indices
            self.state.admit_job(
                job.session_id,
                job.registration_id,
                len(keys),
                len(block_ids),
                len(group_sizes),
                len(block_indices),
            )
        except errors.DepotError as exc:
            return result_to_proto(
                JobResult(job.job_id, False, error=exc.message, error_code=exc.code.name)
            )
        return result_to_proto(await self.state.run_job(job_from_proto(job)))

    async def Session(
        self, request: pb.SessionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionEvent]:
        st = self.state
        try:
            session = st.open_session(
                request.client_name,
                request.pid,
                request.engine_id,
                ticket=metadata_value(context, TICKET_METADATA),
                opener=transport_opener(context),
            )
        except errors.DepotError as exc:
            await abort_with(context, exc)
            return
        try:
            yield pb.SessionEvent(
                hello=pb.SessionHello(
                    session_id=session.id,
                    boot_id=st.boot_id,
                    version=kvdepot.__version__,
                    pool_capacity_bytes=st.capacity_bytes,
                    max_job_keys=st.config.max_job_keys,
                    fd_socket=st.config.fd_socket if st.fd_receiver else "",
                    remote_tier=st.has_tier_below,
                    shard=st.config.shard,
                    shard_count=st.config.shards,
                    eviction_policy=st.config.eviction_policy,
                )
            )
            # Ends at shutdown, or when the daemon ends the session itself (evicted
            # from the unattested pool, over its owner's quota: session.end_reason).
            waits = (
                asyncio.ensure_future(st.shutdown_event.wait()),
                asyncio.ensure_future(session.ended.wait()),
            )
            try:
                while not st.shutting_down:
                    await asyncio.wait(
                        waits, timeout=st.config.keepalive_seconds, return_when="FIRST_COMPLETED"
                    )
                    if st.shutting_down:
                        break
                    if session.end_reason is not None:
                        await abort_with(context, session.end_reason)
                        return
                    used, writing, pinned = st.pool_usage()
                    yield pb.SessionEvent(
                        keepalive=pb.SessionKeepalive(
                            uptime_seconds=st.uptime,
                            pool_used_bytes=used,
                            pool_writing_bytes=writing,
                            pool_pinned_bytes=pinned,
                        )
                    )
            finally:
                for w in waits:
                    w.cancel()
        finally:
            # Runs when the client goes away (stream cancelled) or we shut down.
            self.lanes.close_session(session.id)
            st.close_session(session.id)

    @reports_errors
    async def RegisterKV(
        self, request: pb.RegisterKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterKVResponse:
        check_register_size(request)  # before anything is built from it
        if is_observer_join(request):
            self.state.observe(request.session_id, request.namespace.id)
            return pb.RegisterKVResponse(registration_id=0, memory_path=OBSERVER)
        layout = layout_from_proto(request.namespace)
        regions, tensors, groups = memory_from_proto(request)
        reg = self.state.register(
            request.session_id,
            layout,
            request.rank,
            regions,
            tensors,
            groups,
            units=max(1, request.unit_count),
        )
        return pb.RegisterKVResponse(
            registration_id=reg.id,
            memory_path=reg.memory_path.value,
            slot_bytes=[layout.slot_bytes(g) for g in range(layout.num_groups)],
        )

    @reports_errors
    async def UnregisterKV(
        self, request: pb.UnregisterKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterKVResponse:
        self.state.unregister(request.session_id, request.registration_id)
        return pb.UnregisterKVResponse()

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        st = self.state
        if not request.namespace_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "namespace_id is empty: name the namespace"
            )
        namespace_id, with_events = request.namespace_id, request.key_events
        try:
            watcher = st.add_watcher(request.session_id, namespace_id)
        except errors.DepotError as exc:  # not joined, or the session's streams used up
            await abort_with(context, exc)
            return
        try:
            while True:
                watcher.lagged = False
                async for keys, first in self._snapshot(namespace_id):
                    if st.shutting_down or watcher.ended:  # no need to read the rest
                        return
                    yield pb.WatchEvent(
                        kind=pb.WatchEvent.SNAPSHOT,
                        keys=keys,
                        reset=first,
                        boot_id=st.boot_id,
                        key_events=st.chunk_events(namespace_id, keys) if with_events else (),
                    )
                yield pb.WatchEvent(kind=pb.WatchEvent.SNAPSHOT_END, boot_id=st.boot_id)
                while not watcher.lagged:
                    if st.shutting_down or watcher.ended:  # ended: its session did
                        return
                    run = watcher.take_run(SNAPSHOT_BATCH)  # runs of one kind: one message
                    if run is None:
                        watcher.wakeup.clear()
                        await watcher.wakeup.wait()
                        continue
                    yield pb.WatchEvent(
                        kind=WATCH_KINDS[run.kind],
                        keys=run.keys,
                        reason=event_reason(run),
                        boot_id=st.boot_id,
                        tier=WATCH_TIERS[run.tier],
                        key_events=_chunk_events_of(st, run) if with_events else (),
                    )
                log.warning(
                    "a watcher of %s fell behind; resending a snapshot", request.namespace_id
                )
        finally:
            st.remove_watcher(watcher)

    async def _snapshot(self, namespace_id: str) -> AsyncIterator[tuple[list[bytes], bool]]:
        """A Watch snapshot's batches of ready keys (the first, flagged, even when empty),
        read a slice of the namespace's keys at a time after the watcher subscribed. The
        reader holds `_snapshot_turn` through a turn of the loop, so all snapshots together
        read about one slice per turn: streams reopened in a loop over a large namespace
        add a slice to another call's wait at most, never a walk over every row."""
        after: bytes | None = None
        first = True
        while True:
            async with self._snapshot_turn:
                keys, after = self.state.ready_after(namespace_id, after, SNAPSHOT_SLICE)
                await asyncio.sleep(0)
            if keys or first:
                yield keys, first
                first = False
            if after is None:
                return

    @reports_errors
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        ready = self.state.lookup(request.session_id, request.namespace_id, request.keys)
        return pb.LookupResponse(ready=ready)

    @reports_errors
    async def Pin(
        self, request: pb.PinRequest, context: grpc.aio.ServicerContext
    ) -> pb.PinResponse:
        pinned = self.state.pin(request.session_id, request.namespace_id, request.keys)
        return pb.PinResponse(pinned=pinned)

    @reports_errors
    async def Unpin(
        self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinResponse:
        missing = self.state.unpin(
            request.session_id, request.namespace_id, request.keys, request.touch_keys
        )
        return pb.UnpinResponse(not_pinned=missing)

    async def Transfer(
        self, request_iterator: AsyncIterator[JobMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.TransferResult]:
        results: asyncio.Queue[pb.TransferResult | None] = asyncio.Queue()
        pending: set[asyncio.Task[None]] = set()
        drained = asyncio.Event()  # set when the client takes a result
        st = self.state

        async def run(job: JobMessage) -> None:
            results.put_nowait(await self.answer_job(job))

        async def read() -> None:
            try:
                async for job in request_iterator:
                    # A client that does not read its results stops being read
                    # (HTTP/2 flow control then holds its sends): memory stays bounded.
                    while len(pending) + results.qsize() >= MAX_UNREAD_RESULTS:
                        drained.clear()
                        await drained.wait()
                    task = asyncio.create_task(run(job))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            finally:
                # Jobs already started finish (their slots and pins are
                # bookkept); only then is the reply stream closed.
                if pending:
                    await asyncio.wait(set(pending))
                results.put_nowait(None)

        reader = asyncio.create_task(read())
        st.transfer_streams.add(results)
        try:
            while True:
                item = await results.get()
                drained.set()
                if item is None:
                    break
                yield item
            if pending:  # shutting down: answer the jobs already running
                await asyncio.wait(set(pending))
                while not results.empty():
                    item = results.get_nowait()
                    if item is not None:
                        yield item
        finally:
            st.transfer_streams.discard(results)
            if not reader.done():
                reader.cancel()
            # The client went away or aborted: jobs whose copy has not started are
            # skipped (CopyQueue), so nothing lands in memory it no longer expects.
            for task in pending:
                task.cancel()

    @reports_errors
    async def OpenJobLane(
        self, request: pb.OpenJobLaneRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenJobLaneResponse:
        """Attaches a job lane (kvdepot.server.service.job_lane)."""
        lane = self.lanes.open(
            request.session_id, request.fd_token, request.kind, request.batched_results
        )
        return pb.OpenJobLaneResponse(
            lane_id=lane.id, max_job_bytes=lane.max_datagram_bytes, batched_results=lane.batched
        )

    @reports_errors
    async def Put(
        self, request: pb.PutRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        outcome, ready, reason = await self.state.put(
            request.session_id, request.namespace_id, request.key, request.rank, request.data
        )
        return pb.PutResponse(outcome=outcome.value, ready=ready, drop_reason=reason)

    @reports_errors
    async def PutParts(
        self, requests: AsyncIterator[pb.PutRequest], context: grpc.aio.ServicerContext
    ) -> pb.PutResponse:
        """Put, the section in parts (depot.proto): a part is read only while the parts
        before it fit the section, so a call makes the daemon hold one section at most."""
        head: pb.PutRequest | None = None
        data = bytearray()
        size = 0
        async for part in requests:
            if head is None:
                head = part
                size = self.state.section_bytes(
                    part.session_id, part.namespace_id, part.key, part.rank
                )
            elif part.session_id or part.namespace_id or part.key or part.rank:
                raise errors.invalid("PutParts: only the first part names the section")
            if len(data) + len(part.data) > size:
                raise errors.invalid(
                    f"PutParts: the parts carry more than the section's {size} bytes"
                )
            data += part.data
        if head is None:
            raise errors.invalid("PutParts: no part (the first names the section)")
        outcome, ready, reason = await self.state.put(
            head.session_id, head.namespace_id, head.key, head.rank, bytes(data)
        )
        return pb.PutResponse(outcome=outcome.value, ready=ready, drop_reason=reason)

    @reports_errors
    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetResponse:
        data = await self.state.get(
            request.session_id, request.namespace_id, request.key, request.rank
        )
        return pb.GetResponse(data=data)

    @reports_errors
    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefetchResponse:
        """Keys missing locally, fetched from the tiers below the pool: the disk
        (kvdepot.server.disk), then the remote tier (kvdepot.server.remote)."""
        st = self.state
        states = await st.prefetch(request.session_id, request.namespace_id, request.keys)
        if states is None:  # no tier below the pool
            return pb.PrefetchResponse(
                states=[pb.PrefetchResponse.ABSENT] * len(request.keys), remote_tier=False
            )
        from_disk = [s == _FETCHING_DISK for s in states]
        return pb.PrefetchResponse(
            # KeyState's values, as ints (the stubs want the enum's NewType).
            states=[
                _FETCHING if disk else int(s)  # type: ignore[misc]
                for s, disk in zip(states, from_disk, strict=True)
            ],
            remote_tier=True,
            remote_healthy=st.tiers_healthy,
            from_disk=from_disk if any(from_disk) else (),
        )
