"""The disk tier writing rows behind never reorders a prefix in the pool: a row being
written keeps its place in the eviction order (BlockIndex.begin_keep), so the touch
of the request that stored it still reaches it, and the order in which the writes
end does not matter. A real state (arena, index), a real DiskLink and DiskTier in a
temporary directory, without the gRPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.state import DepotState
from tests.support.prefixes import reach

pytest.importorskip("blake3")

from kvdepot.server.disk.link import DiskLink, DiskSettings

ROW = 96 << 10  # 85 rows in the fixture's 8 MiB pool
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=1, groups=((ROW,),))


def key(prompt: int, chunk: int) -> bytes:
    return hashlib.sha256(bytes([prompt, chunk])).digest() + (0).to_bytes(4, "big")


async def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def store(st: DepotState, owner: str, keys: list[bytes], per_job: int = 20) -> None:
    """Makes `keys` ready in jobs of `per_job` (chunked prefill: one job a step)."""
    for start in range(0, len(keys), per_job):
        claim = st.index.begin_store_many("ns", keys[start : start + per_job], 0, owner)
        assert len(claim.slots) == len(keys[start : start + per_job])
        assert st.index.finish_store_many(claim.slots, 0, True) == len(claim.slots)


def test_a_prompt_written_behind_while_its_request_touches_it_keeps_its_leading_chunks(
    state: DepotState, tmp_path: Path
) -> None:
    link = DiskLink.from_settings(
        DiskSettings(str(tmp_path / "disk"), 64 << 20), state.index, state.arena
    )
    state.attach_tier(link)
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    p1 = [key(1, c) for c in range(40)]
    p2 = [key(2, c) for c in range(60)]

    async def run() -> None:
        link.start()
        try:
            await until(lambda: bool(link.tier.snapshot()["recovery_complete"]))
            store(state, session.id, p1)
            # One turn of the loop: the disk takes the 40 rows (their writes start),
            # and no write's end can come back before the next turn.
            await asyncio.sleep(0)
            assert link.tier.snapshot()["inflight_bytes"] == 40 * (4096 + ROW)  # header, row
            state.unpin(session.id, "ns", [], touch=p1)  # the request ends: its touch
            await until(lambda: link.tier.snapshot()["written_records"] == 40)
            # Every write's end has come back to the loop (a row still kept in place
            # would be passed over by the eviction below).
            await until(lambda: not any(slot.kept for slot in state.index.ready_slots()))
            assert state.index.evictable_blocks == 40
            store(state, session.id, p2)  # 100 rows for 85: 15 must go
            assert reach(state.index.lookup("ns", p1)) == (25, 0)
            assert reach(state.index.lookup("ns", p2)) == (60, 0)
            state.index.check_invariants()
        finally:
            await link.close()

    asyncio.run(run())


def test_the_disk_keeps_the_pools_prefix_order_when_a_touch_beats_the_writes(
    state: DepotState, tmp_path: Path
) -> None:
    """A request's touch that comes before its rows are written (the connector sends it
    once the pool's stores are in) is applied on disk again once they are: a prompt's
    head stays the disk's youngest, so the disk, full, evicts tails and keeps a leading
    run. Room on disk for 60 rows; two prompts of 40."""
    record = 4096 + ROW  # its header page and the row
    link = DiskLink.from_settings(
        DiskSettings(str(tmp_path / "disk"), 60 * record + 4096), state.index, state.arena
    )
    state.attach_tier(link)
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    p1 = [key(1, c) for c in range(40)]
    p2 = [key(2, c) for c in range(40)]

    async def run() -> None:
        link.start()
        try:
            await until(lambda: bool(link.tier.snapshot()["recovery_complete"]))
            # The touch before the disk even took the rows (its writes start after the
            # STORED event, on the loop's next turn)...
            store(state, session.id, p1)
            state.unpin(session.id, "ns", [], touch=p1)
            await until(lambda: link.tier.snapshot()["written_records"] == 40)
            await until(lambda: not any(slot.kept for slot in state.index.ready_slots()))
            assert link.tier.keys_of("ns", 100) == p1  # most recent first: the head
            # ... and while its writes run.
            store(state, session.id, p2)
            await asyncio.sleep(0)
            assert link.tier.snapshot()["inflight_bytes"] > 0
            state.unpin(session.id, "ns", [], touch=p2)
            await until(lambda: link.tier.snapshot()["written_records"] == 80)
            await until(lambda: not any(slot.kept for slot in state.index.ready_slots()))
            assert link.tier.snapshot()["evicted"] == 20
            # The disk kept p1's first 20 chunks, and all of p2, head first.
            assert link.tier.keys_of("ns", 100) == p2 + p1[:20]
            state.index.check_invariants()
        finally:
            await link.close()

    asyncio.run(run())
