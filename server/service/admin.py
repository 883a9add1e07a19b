"""kvdepot.v1.Admin over grpc.aio: inspection and maintenance for operators.

Every call runs on the event loop, which owns the index, so what it reports is one
consistent snapshot. Reads look at the state; changes (Evict, Clear) go through
the same DepotState API as Depot's calls, and errors become statuses through the
same `reports_errors`. Evict and Clear answer PERMISSION_DENIED when the daemon
runs with --no-destructive-admin.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from kvdepot.server import errors
from kvdepot.server.core.index import Namespace, Slot
from kvdepot.server.service.status import reports_errors
from kvdepot.server.state import DepotState
from kvdepot.server.state.admin_evict import admin_pause
from kvdepot.v1 import admin_pb2 as pb
from kvdepot.v1 import admin_pb2_grpc

if TYPE_CHECKING:
    from kvdepot.server.remote.link import RemoteLink
    from kvdepot.server.service.job_lane import JobLanes

MAX_PAGE = 10000
DEFAULT_PAGE = 100
MAX_SCAN = 20000  # blocks one filtered ListBlocks call looks at, at most
# Blocks ListBlocks scans or turns into messages between two yields to the event
# loop: a 10,000-block page costs tens of milliseconds to build, which a Pin must
# not wait for. (A page built across yields shows each block as it was when
# its message was made.)
BUILD_SLICE = 256

# A page token is "<namespace id>/<key hex>" of the last block of the previous page.
# Paging by key (not by position) means blocks stored or evicted between two pages
# neither shift the rest nor make a page repeat or skip blocks that stayed.
_TOKEN_SEP = "/"


def _page_token(slot: Slot) -> str:
    return f"{slot.namespace}{_TOKEN_SEP}{slot.key.hex()}"


def _parse_page_token(token: str) -> tuple[str, bytes]:
    """(namespace id, key) of the last block already returned; ValueError if malformed."""
    namespace_id, sep, key_hex = token.rpartition(_TOKEN_SEP)
    if not sep:
        raise ValueError(token)
    return namespace_id, bytes.fromhex(key_hex)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The Admin service on one DepotState."""

    def __init__(
        self, state: DepotState, remote: RemoteLink | None = None, lanes: JobLanes | None = None
    ) -> None:
        self.state = state
        self.remote = remote  # the remote tier's counters join GetStats
        self.lanes = lanes  # the job lanes' counters join GetStats and ListEngines

    @reports_errors
    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        """Pool, index, engine and traffic figures (see DepotState.stats)."""
        # Debug daemons (KVDEPOT_CHECK_INVARIANTS=1) answer INTERNAL once an invariant broke.
        broken = self.state.verify_invariants()
        if broken is not None:
            raise errors.internal(broken)
        return pb.GetStatsResponse(
            **self.state.stats(),
            **(self.remote.stats_fields() if self.remote is not None else {}),
            **(self.lanes.stats_fields() if self.lanes is not None else {}),
            evictions_by_reason={
                reason.value: n for reason, n in self.state.index.stats.evictions.items()
            },
        )

    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNamespacesResponse:
        """Every namespace (sorted by id) with its layout and block counts."""
        out = []
        for ns_id in sorted(self.state.index.namespaces):
            ns = self.state.index.namespaces[ns_id]
            lay = ns.layout
            out.append(
                pb.NamespaceInfo(
                    id=lay.id,
                    world_size=lay.world_size,
                    blocks_per_chunk=lay.blocks_per_chunk,
                    slot_bytes=[lay.slot_bytes(g) for g in range(lay.num_groups)],
                    ready_blocks=ns.ready_blocks,
                    writing_blocks=ns.writing_blocks,
                    used_bytes=ns.used_bytes,
                    description=lay.description,
                )
            )
        return pb.ListNamespacesResponse(namespaces=out)

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnginesResponse:
        """Every open session (an engine process) with its registrations, oldest first."""
        st = self.state
        now = time.monotonic()
        engines = []
        for s in sorted(st.sessions.values(), key=lambda s: s.opened):
            regs = [
                pb.RegistrationInfo(
                    registration_id=r.id,
                    namespace_id=r.layout.id,
                    rank=r.rank,
                    memory_path=r.memory_path.value,
                    registered_bytes=r.registered_bytes,
                )
                for r in (st.registrations[i] for i in sorted(s.registrations))
            ]
            engines.append(
                pb.EngineInfo(
                    session_id=s.tag,  # the id itself is the session's secret
                    client_name=s.client_name,
                    pid=s.owner.pid if s.owner is not None else s.pid,
                    engine_id=s.engine_id,
                    connected_seconds=now - s.opened,
                    registrations=regs,
                    pinned_blocks=st.index.pinned_slot_count(s.id),
                    job_lanes=self.lanes.count(s.id) if self.lanes is not None else 0,
                )
            )
        return pb.ListEnginesResponse(engines=engines)

    @reports_errors
    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        """Blocks ordered by (namespace, key), a page at a time, optionally filtered.

        O(log n + page) per call: each namespace keeps its keys sorted, and the page
        token is where the last page stopped. A group filter looks at no more than
        MAX_SCAN blocks per call; a page may then come back short (even empty) with
        a token to go on from.
        """
        namespaces, group, size, after = self._block_query(request)
        page: list[Slot] = []
        scanned = 0
        last: Slot | None = None  # the last block looked at (the next page starts after it)
        more = False
        for ns in namespaces:
            if after is not None and ns.layout.id < after[0]:
                continue
            cursor = after[1] if after is not None and ns.layout.id == after[0] else None
            while not more:
                want = (
                    min(size + 1 - len(page), MAX_SCAN - scanned)
                    if group is None
                    else (MAX_SCAN - scanned)
                )
                keys = ns.sorted_keys.after(cursor, min(want, BUILD_SLICE))
                if not keys:
                    break
                for key in keys:
                    slot = ns.slots.get(key)
                    if slot is None:  # evicted while this call yielded
                        continue
                    scanned += 1
                    if group is None or slot.group == group:
                        if len(page) == size:
                            more = True  # one more matches: this page is full
                            break
                        page.append(slot)
                    last = slot
                    if scanned >= MAX_SCAN:
                        more = True
                        break
                cursor = keys[-1]
                await admin_pause()  # a long scan must not hold the event loop
            if more:
                break
        if group is None:
            total = sum(len(ns.slots) for ns in namespaces)
        else:
            total = sum(ns.group_blocks[group] for ns in namespaces)
        blocks = []
        for start in range(0, len(page), BUILD_SLICE):
            if start:
                await admin_pause()
            blocks += [
                pb.BlockInfo(
                    namespace_id=s.namespace,
                    key_hex=s.key.hex(),
                    key=s.key,
                    group=s.group,
                    state=s.state.value,
                    pins=s.pin_count,
                    bytes=s.extent.size,
                    pool_offset=s.extent.offset,
                    written_ranks_mask=s.written_mask,
                )
                for s in page[start : start + BUILD_SLICE]
            ]
        return pb.ListBlocksResponse(
            blocks=blocks,
            next_page_token=_page_token(last) if more and last is not None else "",
            total_blocks=total,
        )

    def _block_query(
        self, request: pb.ListBlocksRequest
    ) -> tuple[list[Namespace], int | None, int, tuple[str, bytes] | None]:
        """Validates a ListBlocks request: (namespaces, group or None, page size, after)."""
        index = self.state.index
        if request.namespace_id:
            if request.namespace_id not in index.namespaces:
                raise errors.not_found(
                    f"unknown namespace {request.namespace_id!r}: see Admin/ListNamespaces"
                )
            namespaces = [index.namespaces[request.namespace_id]]
        else:
            namespaces = [index.namespaces[k] for k in sorted(index.namespaces)]
        # proto3 cannot tell group 0 from "unset": has_group says so; a non-zero group
        # needs no flag (an operator typing {"group": 1} means it).
        group = request.group if request.has_group or request.group else None
        if group is not None and request.namespace_id:
            num_groups = namespaces[0].layout.num_groups
            if group >= num_groups:
                raise errors.invalid(
                    f"group {group} out of range: namespace {request.namespace_id} has "
                    f"{num_groups} group(s), 0 to {num_groups - 1}"
                )
        size = request.page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise errors.invalid(f"page_size {size} is above {MAX_PAGE}: ask for less per page")
        after = None
        if request.page_token:
            try:
                after = _parse_page_token(request.page_token)
            except ValueError:
                raise errors.invalid(
                    f"page_token {request.page_token!r} is not one this daemon hands out: "
                    f"pass next_page_token back as is, or leave it empty for the first page"
                ) from None
        return namespaces, group, size, after

    @reports_errors
    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> pb.EvictResponse:
        """Evicts ready, unpinned blocks of one namespace: all of them, or the given keys."""
        evicted, skipped, not_found = await self.state.evict_in_slices(
            request.namespace_id, list(request.keys)
        )
        return pb.EvictResponse(
            evicted_blocks=evicted, skipped_blocks=skipped, not_found_blocks=not_found
        )

    @reports_errors
    async def Clear(
        self, request: pb.ClearRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearResponse:
        """Evicts every ready, unpinned block of every namespace."""
        evicted, skipped = await self.state.clear_in_slices()
        return pb.ClearResponse(evicted_blocks=evicted, skipped_blocks=skipped)
