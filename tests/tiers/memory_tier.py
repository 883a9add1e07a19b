"""A third tier below the pool, written for the tests against the tier seam only
(kvdepot.server.core.tier): rows kept in a dict, written behind from the pool and
fetched back into it. Its registry line is all the daemon needs of it
(tests/tiers/test_tier_seam.py): ("memory", "tests.tiers.memory_tier").

With a `capacity` (in rows) it keeps an order of its own and evicts from its cold
end, following the pool's as the seam asks (`Tier.touch`): rows written together go in
tail first, a touch makes its rows young, the head youngest, and a touch that comes
before its rows are written is applied again once they are (TouchesAfterWrites).

Everything runs on the event loop; it owns its dict and the rows it claims in the
pool until they are READY (at once: it has no I/O of its own)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvdepot.server.core.eviction import tail_first
from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.kinds import EventKind, SlotState, StoreOutcome
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.core.tier import Tier, TierHost
from kvdepot.server.core.touch_order import TouchesAfterWrites
from kvdepot.server.memory.arena import Arena

OWNER = "memory-tier"  # the index's writer id for rows it brings into the pool


class MemoryTier:
    name = "memory"
    fetched = KeyState.FETCHING

    def __init__(self, index: BlockIndex, arena: Arena, capacity: int | None = None) -> None:
        self._index = index
        self._arena = arena
        self.capacity = capacity  # rows; None: no bound
        # A whole row, every rank's section; the coldest first.
        self.rows: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._noted: list[tuple[str, tuple[bytes, ...]]] = []
        self._touch_order = TouchesAfterWrites()
        self.touched: list[bytes] = []
        self.fetches = 0
        self.evicted = 0
        self.closed = False

    def attach(self, host: TierHost) -> None:
        """Nothing beyond the events every tier hears."""

    def on_event(self, event: IndexEvent) -> None:
        if event.kind is not EventKind.STORED:
            return
        if not self._noted:  # a listener never calls back into the index: after it
            asyncio.get_running_loop().call_soon(self._write_behind)
        self._noted.append((event.namespace, event.keys))
        for key in event.keys:
            self._touch_order.noted((event.namespace, key))

    def _write_behind(self) -> None:
        noted, self._noted = self._noted, []
        for namespace_id, keys in noted:
            ns = self._index.namespace(namespace_id)
            slots = [s for k in keys if (s := ns.slots.get(k)) is not None]
            for slot in tail_first([s for s in slots if s.state is SlotState.READY]):
                size = ns.layout.slot_bytes(slot.group)
                self.rows[namespace_id, slot.key] = bytes(
                    self._arena.view(slot.extent.offset, size)
                )
                self.rows.move_to_end((namespace_id, slot.key))
            while self.capacity is not None and len(self.rows) > self.capacity:
                self.rows.popitem(last=False)
                self.evicted += 1
            for key in keys:
                self._apply(self._touch_order.settled((namespace_id, key)))

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        self.touched += keys
        self._apply([(namespace_id, keys)])
        self._apply(self._touch_order.touched(namespace_id, keys))

    def _apply(self, touches: list[tuple[str, Sequence[bytes]]]) -> None:
        rows = self.rows
        for namespace_id, keys in touches:
            for key in reversed(keys):  # the head last: the youngest
                if (namespace_id, key) in rows:
                    rows.move_to_end((namespace_id, key))

    async def locate(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        return [(namespace_id, key) in self.rows for key in keys]

    def fetch(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        ns = self._index.namespace(namespace_id)
        out = []
        for key in keys:
            row = self.rows.get((namespace_id, key))
            if key in ns.slots or row is None:
                out.append(key in ns.slots)
                continue
            first = self._index.begin_store(namespace_id, key, 0, OWNER)
            if first.outcome is not StoreOutcome.WRITE or first.slot is None:
                out.append(False)
                continue
            slot = first.slot
            for rank in range(1, ns.layout.world_size):  # a fresh slot: every rank's
                self._index.begin_store(namespace_id, key, rank, OWNER)
            self._arena.view(slot.extent.offset, len(row))[:] = row
            for rank in range(ns.layout.world_size):
                self._index.finish_store(slot, rank, True)
            self.fetches += 1
            out.append(True)
        return out

    @property
    def healthy(self) -> bool:
        return not self.closed

    def stats_fields(self) -> dict[str, object]:
        return {"memory_rows": len(self.rows)}

    def collector(self) -> Collector:
        return _Rows(self)

    async def close(self) -> None:
        self.closed = True


class _Rows(Collector):
    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("test_memory_tier_rows", "Rows held.", value=len(self.tier.rows))


class Site(Protocol):
    @property
    def index(self) -> BlockIndex: ...
    @property
    def arena(self) -> Arena: ...


def build(site: Site) -> Tier | None:
    """The registry's factory: always on (no setting of its own)."""
    return MemoryTier(site.index, site.arena)
