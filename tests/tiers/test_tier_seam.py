"""The tier seam (kvdepot.server.core.tier): a tier below the pool is a package and one
line in the daemon's registry (kvdepot.server.tier_registry). A third tier written for
the tests against the seam alone (tests/tiers/memory_tier.py), added by its line to
the daemon's own, is started, attached and walked by the real registry and state:
write-behind from the pool's events, touches, Prefetch's leading run across the
tiers in the registry's order (before it, the real disk tier), its figures, its
health and its close. A real DepotState (arena, index, copy threads) without the
gRPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvdepot.server.config import ServeConfig
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.state import DepotState
from kvdepot.server.tier_registry import TIERS, TierSite, start_tiers
from tests.tiers.memory_tier import MemoryTier

ROW = 96 << 10  # 85 rows in the fixture's 8 MiB pool
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=1, groups=((ROW,),))
WITH_MEMORY = (*TIERS, ("memory", "tests.tiers.memory_tier"))  # the one line
CONFIG = ServeConfig(socket="/nonexistent/kvdepot.sock")
F, D, A = KeyState.FETCHING, KeyState.FETCHING_DISK, KeyState.ABSENT


def key(i: int) -> bytes:
    return hashlib.sha256(bytes([i])).digest() + (0).to_bytes(4, "big")


async def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_every_registered_factory_leaves_its_tier_off_without_its_setting(
    state: DepotState,
) -> None:
    """The daemon's lines name importable factories (no extra needed to import them),
    nearest first, and without --disk or --remote each starts nothing."""
    assert [name for name, _ in TIERS] == ["disk", "fleet"]
    site = TierSite(CONFIG, state.index, state.arena, state.copy_queue, None)
    for _name, module in TIERS:
        assert importlib.import_module(module).build(site) is None
    assert start_tiers(CONFIG, state) == []
    assert not state.has_tier_below


def test_a_third_tier_is_one_registry_line(state: DepotState) -> None:
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    keys = [key(i) for i in range(6)]
    rows = {k: os.urandom(ROW) for k in keys}

    async def run() -> None:
        assert not state.has_tier_below
        tiers = start_tiers(CONFIG, state, WITH_MEMORY)
        assert [t.name for t in tiers] == ["memory"]  # no --disk, no --remote
        memory = tiers[0]
        assert isinstance(memory, MemoryTier)
        assert state.has_tier_below and state.tiers_healthy
        for k in keys[:5]:  # the sixth is never stored
            await state.put(session.id, "ns", k, 0, rows[k])
        await until(lambda: len(memory.rows) == 5)  # written behind from the events
        state.unpin(session.id, "ns", [], touch=keys[:2])
        assert memory.touched == keys[:2]
        assert state.evict("ns", keys[:5])[0] == 5
        del memory.rows["ns", keys[2]]  # a hole: nothing holds the third key now

        states = await state.prefetch(session.id, "ns", keys)

        assert states == [F, F, A, A, A, A]  # the leading run only, never past the hole
        assert memory.fetches == 2
        assert state.lookup(session.id, "ns", keys) == [True, True] + [False] * 4
        for k in keys[:2]:
            assert await state.get(session.id, "ns", k, 0) == rows[k]
        assert state.tier_stats() == {"memory_rows": 4}
        registry = CollectorRegistry()
        for tier in tiers:
            registry.register(tier.collector())
        assert registry.get_sample_value("test_memory_tier_rows") == 4
        for tier in reversed(tiers):
            await tier.close()
        assert not state.tiers_healthy
        state.check_invariants()

    asyncio.run(run())


def test_prefetch_asks_the_tiers_in_the_registrys_order(state: DepotState, tmp_path: Path) -> None:
    """With --disk, the disk is asked first: a row both tiers hold comes from the disk
    (FETCHING_DISK), a row only the third tier holds from it (FETCHING)."""
    pytest.importorskip("blake3")
    config = ServeConfig(
        socket="/nonexistent/kvdepot.sock", disk=str(tmp_path / "disk"), disk_size=64 << 20
    )
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    both, only_memory = key(1), key(2)
    rows = {both: os.urandom(ROW), only_memory: os.urandom(ROW)}

    async def run() -> None:
        tiers = start_tiers(config, state, WITH_MEMORY)
        try:
            assert [t.name for t in tiers] == ["disk", "memory"]
            disk, memory = tiers
            assert isinstance(memory, MemoryTier)
            await until(lambda: bool(disk.stats_fields()["disk_recovery_complete"]))
            await state.put(session.id, "ns", both, 0, rows[both])
            await until(lambda: disk.stats_fields()["disk_writes"] == 1 and len(memory.rows) == 1)
            assert state.evict("ns", [both])[0] == 1
            memory.rows["ns", only_memory] = rows[only_memory]

            states = await state.prefetch(session.id, "ns", [both, only_memory])

            assert states == [D, F]
            assert memory.fetches == 1  # the disk's row was not asked of it
            await until(lambda: all(state.lookup(session.id, "ns", list(rows))))
            for k, row in rows.items():
                assert await state.get(session.id, "ns", k, 0) == row
            assert set(state.tier_stats()) >= {"disk_enabled", "memory_rows"}
        finally:
            for tier in reversed(tiers):
                await tier.close()

    asyncio.run(run())


def test_a_tier_with_an_order_of_its_own_follows_the_pools_through_the_seam(
    state: DepotState,
) -> None:
    """The seam's order rule (`Tier.touch`) for a tier written against it alone: the
    memory tier, room for 60 rows, takes two prompts of 40, stored in jobs of 20 whose
    touch comes before the rows are written behind. Full, it evicts the first prompt's
    tail and keeps its leading 20 rows and the second prompt whole: no row behind one
    it dropped."""
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    memory = MemoryTier(state.index, state.arena, capacity=60)
    state.attach_tier(memory)
    p1 = [key(i) for i in range(40)]
    p2 = [key(i) for i in range(40, 80)]

    async def run() -> None:
        for prompt in (p1, p2):
            for start in range(0, 40, 20):  # one job a step: one STORED event each
                claim = state.index.begin_store_many("ns", prompt[start : start + 20], 0, "t")
                assert state.index.finish_store_many(claim.slots, 0, True) == 20
            # The request ends before the tier wrote its rows (on the loop's next turn).
            state.unpin(session.id, "ns", [], touch=prompt)
            assert not any(("ns", k) in memory.rows for k in prompt)
            await until(lambda p=prompt: ("ns", p[-1]) in memory.rows or memory.evicted > 0)
            await asyncio.sleep(0)
        assert memory.evicted == 20
        # The coldest first: the second prompt's tail ... its head, then the first's.
        assert [k for _, k in memory.rows] == p1[:20][::-1] + p2[::-1]
        await memory.close()

    asyncio.run(run())
