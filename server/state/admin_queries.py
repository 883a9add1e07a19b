"""The operators' read-only queries: a facet of `DepotState`.

`AdminQueries` answers Admin/ListNamespaces and Admin/ListBlocks (through
`BlockListing`, kvdepot.server.state.listing, which pages the blocks), and the
figures Admin/ListEngines and the metrics read beside GetStats: the pool's
capacity, a session's pinned blocks, evictions by reason. It changes nothing.

Owned by `DepotState`, which offers these calls as its own (a method per call);
everything runs on the event loop, which owns what it reads.
"""

from __future__ import annotations

from kvdepot.server.core.index import BlockIndex, Namespace
from kvdepot.server.state.listing import BlockListing, BlockPage


class AdminQueries:
    """Namespaces, blocks a page at a time, and the index's figures."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.listing = BlockListing(index)

    @property
    def capacity_bytes(self) -> int:
        return self.index.allocator.capacity

    def namespaces(self) -> list[Namespace]:
        """Every namespace, sorted by id (Admin/ListNamespaces)."""
        return self.listing.namespaces()

    async def list_blocks(
        self, namespace_id: str, group: int | None, page_size: int, page_token: str
    ) -> BlockPage:
        """A page of Admin/ListBlocks: see BlockListing.blocks."""
        return await self.listing.blocks(namespace_id, group, page_size, page_token)

    def pinned_blocks(self, session_id: str) -> int:
        """Blocks the session pins now (Admin/ListEngines)."""
        return self.index.pinned_slot_count(session_id)

    def evictions_by_reason(self) -> dict[str, int]:
        return {reason.value: n for reason, n in self.index.stats.evictions.items()}
