"""Admin/Evict and Admin/Clear: the request checks, and bulk eviction in slices.

A bulk eviction (Clear, Evict of a whole namespace or of many keys) runs on the
event loop, EVICT_SLICE blocks (and at most EVICT_SLICE_BUDGET_S) at a time, with
`admin_pause` between slices, so a Pin or a Transfer job never waits for more
than about one slice. `AdminEviction` is DepotState's part for this (its
`admin`); DepotState's `evict`, `evict_in_slices`, `clear_in_slices` and `clear`
are the calls the services make.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvdepot.server import errors
from kvdepot.server.core.index import BlockIndex, UnknownNamespace
from kvdepot.server.core.kinds import EvictionReason
from kvdepot.server.state.settings import StateConfig

# Blocks a bulk eviction (Clear, Evict of a namespace) handles between two yields
# to the event loop: about a millisecond of work, far inside a Pin's deadline.
EVICT_SLICE = 2000
EVICT_SLICE_BUDGET_S = 0.001  # and at most this long (freeing costs more when fragmented)
ADMIN_PAUSE_S = 0.001


async def admin_pause() -> None:
    """Between two slices of admin work: a real pause, not just a turn of the
    loop. A gRPC call takes several loop iterations from its bytes to its answer;
    with only `sleep(0)` between 1 ms slices a Pin would wait a slice per
    iteration. Pausing as long as a slice halves the admin call's pace and keeps
    the data path's delay to about one slice."""
    await asyncio.sleep(ADMIN_PAUSE_S)


class AdminEviction:
    """Evict and Clear over `index`, refused unless `config.destructive_admin`.

    `verify` runs after every slice (DepotState.verify_invariants: the invariant
    check under KVDEPOT_CHECK_INVARIANTS=1); the one-go calls leave it to their
    caller.
    """

    def __init__(
        self, index: BlockIndex, config: StateConfig, verify: Callable[[], object]
    ) -> None:
        self.index = index
        self.config = config
        self._verify = verify
        self.slices_yielded = 0  # bulk-eviction slices so far (tests: the work was sliced)

    def check_destructive(self) -> None:
        if not self.config.destructive_admin:
            raise errors.denied(
                "Evict and Clear are disabled on this daemon (--no-destructive-admin, or "
                "KVDEPOT_NO_DESTRUCTIVE_ADMIN=1): blocks age out by LRU; to evict by hand, "
                "restart the daemon without that setting"
            )

    def request(self, namespace_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Checks an Admin/Evict request; returns its distinct keys."""
        self.check_destructive()
        if not namespace_id:
            raise errors.invalid(
                "namespace_id is empty: name the namespace (see Admin/ListNamespaces), or "
                "call Admin/Clear to evict from every namespace"
            )
        try:
            ns = self.index.namespace(namespace_id)
        except UnknownNamespace as exc:  # the operator's next step added
            raise errors.not_found(f"{exc}; see Admin/ListNamespaces") from None
        unique = list(dict.fromkeys(keys))  # a key named twice counts once
        for key in unique:
            try:
                ns.layout.key_group(key)
            except ValueError as exc:
                raise errors.invalid(
                    f"{exc}. In grpcurl JSON a key is base64: copy `key` from "
                    f"Admin/ListBlocks, or convert key_hex with `xxd -r -p | base64 -w0`"
                ) from None
        return unique

    def evict(self, namespace_id: str, keys: Sequence[bytes]) -> tuple[int, int, int]:
        """Admin/Evict in one go (direct use, tests); the service calls
        `evict_in_slices`. Returns (evicted, skipped: pinned, read or written,
        not found)."""
        unique = self.request(namespace_id, keys)
        if not unique:
            evicted, skipped = self.index.evict(namespace_id, None, EvictionReason.ADMIN)
            return evicted, skipped, 0
        ns = self.index.namespace(namespace_id)
        not_found = sum(k not in ns.slots for k in unique)
        evicted, skipped = self.index.evict(namespace_id, unique, EvictionReason.ADMIN)
        return evicted, skipped, not_found

    async def evict_in_slices(
        self, namespace_id: str, keys: Sequence[bytes]
    ) -> tuple[int, int, int]:
        """Admin/Evict: ready, unheld blocks of one namespace (all, or `keys`),
        EVICT_SLICE blocks at a time with the event loop free in between, so a
        Pin never waits for more than one slice. Returns (evicted, skipped,
        not found)."""
        unique = self.request(namespace_id, keys)
        if not unique:
            evicted, skipped = await self._evict_namespace(namespace_id, EvictionReason.ADMIN)
            return evicted, skipped, 0
        evicted = skipped = not_found = 0
        for start in range(0, len(unique), EVICT_SLICE):
            ns = self.index.namespaces.get(namespace_id)
            if ns is None:  # cannot happen today (namespaces are never dropped)
                break
            part = unique[start : start + EVICT_SLICE]
            not_found += sum(k not in ns.slots for k in part)
            e, s = self.index.evict(namespace_id, part, EvictionReason.ADMIN)
            evicted, skipped = evicted + e, skipped + s
            self._verify()
            await admin_pause()
        return evicted, skipped, not_found

    async def clear_in_slices(self) -> tuple[int, int]:
        """Admin/Clear: every ready, unheld block, a slice at a time (see
        `evict_in_slices`), the eviction policy's victims first (least recently
        used). Blocks stored while it runs are admitted behind them; the walk stops
        after as many blocks as were evictable at the start. Returns (evicted,
        skipped: pinned, read or written)."""
        self.check_destructive()
        evicted = 0
        todo = self.index.evictable_blocks
        while evicted < todo:
            n = self.index.evict_cold_slice(
                min(EVICT_SLICE, todo - evicted), EVICT_SLICE_BUDGET_S, EvictionReason.CLEAR
            )
            evicted += n
            self.slices_yielded += 1
            self._verify()
            await admin_pause()
            if n == 0:
                break
        return evicted, self.index.unevictable_blocks()

    async def _evict_namespace(self, namespace_id: str, reason: EvictionReason) -> tuple[int, int]:
        evicted = skipped = 0
        after: bytes | None = None
        while True:
            e, s, after = self.index.evict_slice(
                namespace_id, after, EVICT_SLICE, reason, EVICT_SLICE_BUDGET_S
            )
            evicted, skipped = evicted + e, skipped + s
            self.slices_yielded += 1
            self._verify()
            await admin_pause()
            if after is None:
                return evicted, skipped

    def clear(self) -> tuple[int, int]:
        """Admin/Clear in one go (direct use, tests); the service calls
        `clear_in_slices`. Returns (evicted, skipped)."""
        self.check_destructive()
        return self.index.clear()
