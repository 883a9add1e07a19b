"""kvdepot.v1.Admin over grpc.aio: inspection and maintenance for operators."""

from __future__ import annotations

import time

import grpc

from kvdepot.server import errors
from kvdepot.server.core.index import UnknownNamespace
from kvdepot.server.core.layout import group_of_key
from kvdepot.server.state import DepotState
from kvdepot.v1 import admin_pb2 as pb
from kvdepot.v1 import admin_pb2_grpc

MAX_PAGE = 10000
DEFAULT_PAGE = 100


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, state: DepotState) -> None:
        self.state = state

    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        return pb.GetStatsResponse(**self.state.stats())

    async def ListNamespaces(
        self, request: pb.ListNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListNamespacesResponse:
        out = []
        for ns in self.state.index.namespaces.values():
            lay = ns.layout
            ready = sum(s.state.value == "ready" for s in ns.slots.values())
            out.append(
                pb.NamespaceInfo(
                    id=lay.id, world_size=lay.world_size, blocks_per_chunk=lay.blocks_per_chunk,
                    slot_bytes=[lay.slot_bytes(g) for g in range(lay.num_groups)],
                    ready_blocks=ready, writing_blocks=len(ns.slots) - ready,
                    used_bytes=ns.used_bytes, description=lay.description,
                )
            )
        return pb.ListNamespacesResponse(namespaces=out)

    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEnginesResponse:
        st = self.state
        now = time.monotonic()
        pins = st.index._pins_by_owner  # read-only view for reporting
        engines = []
        for s in st.sessions.values():
            regs = [
                pb.RegistrationInfo(
                    registration_id=r.id, namespace_id=r.layout.id, rank=r.rank,
                    memory_path=r.memory_path, registered_bytes=r.registered_bytes,
                )
                for r in (st.registrations[i] for i in sorted(s.registrations))
            ]
            engines.append(
                pb.EngineInfo(
                    session_id=s.id, client_name=s.client_name, pid=s.pid,
                    engine_id=s.engine_id, connected_seconds=now - s.opened,
                    registrations=regs, pinned_blocks=len(pins.get(s.id, ())),
                )
            )
        return pb.ListEnginesResponse(engines=engines)

    async def ListBlocks(
        self, request: pb.ListBlocksRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListBlocksResponse:
        index = self.state.index
        if request.namespace_id and request.namespace_id not in index.namespaces:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown namespace {request.namespace_id!r}: see Admin/ListNamespaces",
            )
        size = request.page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"page_size {size} is above {MAX_PAGE}"
            )
        try:
            start = int(request.page_token or 0)
        except ValueError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "page_token is not one this daemon handed out: pass next_page_token back as is",
            )
        namespaces = (
            [index.namespaces[request.namespace_id]]
            if request.namespace_id else list(index.namespaces.values())
        )
        blocks = [
            s for ns in namespaces for s in ns.slots.values()
            if not request.has_group or s.group == request.group
        ]
        page = blocks[start : start + size]
        nxt = start + size if start + size < len(blocks) else None
        return pb.ListBlocksResponse(
            blocks=[
                pb.BlockInfo(
                    namespace_id=s.namespace, key_hex=s.key.hex(), group=group_of_key(s.key),
                    state=s.state.value, pins=s.pin_count, bytes=s.extent.size,
                    pool_offset=s.extent.offset, written_ranks_mask=s.written_mask,
                )
                for s in page
            ],
            next_page_token="" if nxt is None else str(nxt),
            total_blocks=len(blocks),
        )

    def _check_destructive(self) -> None:
        if not self.state.config.destructive_admin:
            raise errors.denied(
                "destructive admin calls are disabled on this daemon (--no-destructive-admin)"
            )

    async def Evict(
        self, request: pb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> pb.EvictResponse:
        try:
            self._check_destructive()
            try:
                evicted, skipped = self.state.index.evict(
                    request.namespace_id, list(request.keys) or None, reason="admin"
                )
            except UnknownNamespace as exc:
                raise errors.not_found(str(exc)) from None
        except errors.DepotError as exc:
            await context.abort(exc.code, exc.message)
        self.state.publish_events()
        return pb.EvictResponse(evicted_blocks=evicted, skipped_blocks=skipped)

    async def Clear(
        self, request: pb.ClearRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearResponse:
        try:
            self._check_destructive()
        except errors.DepotError as exc:
            await context.abort(exc.code, exc.message)
        evicted, skipped = self.state.index.clear()
        self.state.publish_events()
        return pb.ClearResponse(evicted_blocks=evicted, skipped_blocks=skipped)
