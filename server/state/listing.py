"""The admin queries: namespaces and blocks as operators list them (Admin/List*).

`BlockListing` reads the index on the event loop, which owns it; DepotState
holds one and the Admin service calls it through DepotState (`namespaces`,
`list_blocks`), never the index itself. `list_blocks` yields to the event loop
between slices of its scan (a long listing must not hold up a Pin), so a page
shows each block as it was when it was looked at; the page returned is the
caller's.

Paging: a page token is "<namespace id>/<key hex>" of the last block looked at.
Paging by key (not by position) means blocks stored or evicted between two pages
neither shift the rest nor make a page repeat or skip blocks that stayed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import errors
from kvdepot.server.core.index import BlockIndex, Namespace, Slot
from kvdepot.server.state.admin_evict import admin_pause

MAX_PAGE = 10000
DEFAULT_PAGE = 100
MAX_SCAN = 20000  # blocks one filtered ListBlocks call looks at, at most
# Blocks a listing scans (or the service turns into messages) between two yields to
# the event loop: a 10,000-block page costs tens of milliseconds to build, which a
# Pin must not wait for.
BUILD_SLICE = 256

_TOKEN_SEP = "/"


def _page_token(slot: Slot) -> str:
    return f"{slot.namespace}{_TOKEN_SEP}{slot.key.hex()}"


def _parse_page_token(token: str) -> tuple[str, bytes]:
    """(namespace id, key) of the last block already returned; ValueError if malformed."""
    namespace_id, sep, key_hex = token.rpartition(_TOKEN_SEP)
    if not sep:
        raise ValueError(token)
    return namespace_id, bytes.fromhex(key_hex)


@dataclass
class BlockPage:
    """One page of ListBlocks: its blocks, where the next starts ("" at the end),
    and how many blocks the query matches in all."""

    slots: list[Slot]
    next_page_token: str
    total_blocks: int


class BlockListing:
    """Namespaces and blocks of one index, for operators."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    def namespaces(self) -> list[Namespace]:
        """Every namespace, sorted by id."""
        spaces = self.index.namespaces
        return [spaces[k] for k in sorted(spaces)]

    async def blocks(
        self, namespace_id: str, group: int | None, page_size: int, page_token: str
    ) -> BlockPage:
        """Blocks ordered by (namespace, key), a page at a time, optionally of one
        namespace (`namespace_id` not empty) and one KV-cache group.

        O(log n + page) per call: each namespace keeps its keys sorted, and the page
        token is where the last page stopped. A group filter looks at no more than
        MAX_SCAN blocks per call; a page may then come back short (even empty) with
        a token to go on from. `page_size` 0 is DEFAULT_PAGE.
        """
        namespaces, size, after = self._query(namespace_id, group, page_size, page_token)
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
        token = _page_token(last) if more and last is not None else ""
        return BlockPage(page, token, total)

    def _query(
        self, namespace_id: str, group: int | None, page_size: int, page_token: str
    ) -> tuple[list[Namespace], int, tuple[str, bytes] | None]:
        """Validates a ListBlocks query: (namespaces, page size, after)."""
        index = self.index
        if namespace_id:
            if namespace_id not in index.namespaces:
                raise errors.not_found(
                    f"unknown namespace {namespace_id!r}: see Admin/ListNamespaces"
                )
            namespaces = [index.namespaces[namespace_id]]
        else:
            namespaces = self.namespaces()
        if group is not None and namespace_id:
            num_groups = namespaces[0].layout.num_groups
            if group >= num_groups:
                raise errors.invalid(
                    f"group {group} out of range: namespace {namespace_id} has "
                    f"{num_groups} group(s), 0 to {num_groups - 1}"
                )
        size = page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise errors.invalid(f"page_size {size} is above {MAX_PAGE}: ask for less per page")
        after = None
        if page_token:
            try:
                after = _parse_page_token(page_token)
            except ValueError:
                raise errors.invalid(
                    f"page_token {page_token!r} is not one this daemon hands out: "
                    f"pass next_page_token back as is, or leave it empty for the first page"
                ) from None
        return namespaces, size, after
