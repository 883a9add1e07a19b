"""A third tier below the pool, written for the tests against the tier seam only
(kvdepot.server.core.tier): rows kept in a dict, written behind from the pool and
fetched back into it. Its registry line is all the daemon needs of it
(tests/tiers/test_tier_seam.py): ("memory", "tests.tiers.memory_tier").

Everything runs on the event loop; it owns its dict and the rows it claims in the
pool until they are READY (at once: it has no I/O of its own)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.kinds import EventKind, SlotState, StoreOutcome
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.core.tier import Tier, TierHost
from kvdepot.server.memory.arena import Arena

OWNER = "memory-tier"  # the index's writer id for rows it brings into the pool


class MemoryTier:
    name = "memory"
    fetched = KeyState.FETCHING

    def __init__(self, index: BlockIndex, arena: Arena) -> None:
        self._index = index
        self._arena = arena
        self.rows: dict[tuple[str, bytes], bytes] = {}  # a whole row, every rank's section
        self._noted: list[tuple[str, bytes]] = []
        self.touched: list[bytes] = []
        self.fetches = 0
        self.closed = False

    def attach(self, host: TierHost) -> None:
        """Nothing beyond the events every tier hears."""

    def on_event(self, event: IndexEvent) -> None:
        if event.kind is not EventKind.STORED:
            return
        if not self._noted:  # a listener never calls back into the index: after it
            asyncio.get_running_loop().call_soon(self._write_behind)
        self._noted += [(event.namespace, key) for key in event.keys]

    def _write_behind(self) -> None:
        noted, self._noted = self._noted, []
        for namespace_id, key in noted:
            ns = self._index.namespace(namespace_id)
            slot = ns.slots.get(key)
            if slot is not None and slot.state is SlotState.READY:
                size = ns.layout.slot_bytes(slot.group)
                self.rows[namespace_id, key] = bytes(self._arena.view(slot.extent.offset, size))

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        self.touched += keys

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
