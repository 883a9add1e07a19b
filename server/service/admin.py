"""kvdepot.v1.Admin over grpc.aio: inspection and maintenance for operators.

Every call runs on the event loop, which owns the index, so what it reports is one
consistent snapshot. Reads look at the state; changes (Evict, Clear) go through
the same DepotState API as Depot's calls, and errors become statuses through the
same `reports_errors`. Evict and Clear answer PERMISSION_DENIED when the daemon
runs with --no-destructive-admin.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import grpc

from kvdepot.server import errors
from kvdepot.server.service.codec import block_infos, engine_info, namespace_info
from kvdepot.server.service.status import reports_errors
from kvdepot.server.state import DepotState
from kvdepot.server.state.admin_evict import admin_pause
from kvdepot.server.state.listing import BUILD_SLICE
from kvdepot.v1 import admin_pb2 as pb
from kvdepot.v1 import admin_pb2_grpc

if TYPE_CHECKING:
    from kvdepot.server.service.job_lane import JobLanes


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """The Admin service on one DepotState."""

    def __init__(self, state: DepotState, lanes: JobLanes | None = None) -> None:
        self.state = state
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
        # Each figure is its field's type (tests/test_admin_api.py reads them all).
        return pb.GetStatsResponse(
            **cast("dict[str, Any]", self.state.stats()),
            **cast("dict[str, Any]", self.state.tier_stats()),
            **cast("dict[str, Any]", self.lanes.stats_fields() if self.lanes is not None else {}),
            evictions_by_reason=self.state.evictions_by_reason(),
        )

    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNamespacesResponse:
        """Every namespace (sorted by id) with its layout and block counts."""
        return pb.ListNamespacesResponse(
            namespaces=[namespace_info(ns) for ns in self.state.namespaces()]
        )

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnginesResponse:
        """Every open session (an engine process) with its registrations, oldest first."""
        st = self.state
        now = time.monotonic()
        engines = [
            engine_info(
                s,
                [st.registrations[i] for i in sorted(s.registrations)],
                st.pinned_blocks(s.id),
                self.lanes.count(s.id) if self.lanes is not None else 0,
                now,
            )
            for s in sorted(st.sessions.values(), key=lambda s: s.opened)
        ]
        return pb.ListEnginesResponse(engines=engines)

    @reports_errors
    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        """Blocks ordered by (namespace, key), a page at a time, optionally filtered
        (see BlockListing.blocks)."""
        # proto3 cannot tell group 0 from "unset": has_group says so; a non-zero group
        # needs no flag (an operator typing {"group": 1} means it).
        group = request.group if request.has_group or request.group else None
        found = await self.state.list_blocks(
            request.namespace_id, group, request.page_size, request.page_token
        )
        page = found.slots
        blocks = []
        for start in range(0, len(page), BUILD_SLICE):
            if start:
                await admin_pause()
            blocks += block_infos(page[start : start + BUILD_SLICE])
        return pb.ListBlocksResponse(
            blocks=blocks,
            next_page_token=found.next_page_token,
            total_blocks=found.total_blocks,
        )

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
