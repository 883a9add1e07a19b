"""The remote tier while the daemon's CPU copy threads are stalled: its writes and
fetches copy pool bytes on those threads, so while every one of them holds a copy
that may never end (a hung copy), the tier drops its rows at once and counts them
(`copies_stalled`) rather than queue behind the copy, as a job is refused; once a
copy ends it writes and fetches again. A real state (arena, index, copy threads), a
real RemoteLink and a real redis-server, without the gRPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.remote.link import RemoteLink, RemoteSettings
from kvdepot.server.state import DepotState
from tests.support.fleet_key import new_secret, write_key_file
from tests.support.redis_servers import RedisServer

PAGE = 4096
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=2, groups=((PAGE, PAGE),))
SECTION = 2 * 2 * PAGE


def key(i: int) -> bytes:
    return hashlib.sha256(b"stall" + i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


async def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def store_off_the_cpu_threads(st: DepotState, k: bytes, data: bytes) -> None:
    """Makes a row ready without the CPU copy threads, as a GPU engine's job does on
    its GPU's threads (the index's claim, the bytes, the settle)."""
    first = st.index.begin_store("ns", k, 0, "gpu-engine")
    assert first.slot is not None
    st.arena.view(first.slot.extent.offset, len(data))[:] = data
    assert st.index.finish_store(first.slot, 0, True)


def test_the_remote_tier_drops_rows_at_once_while_every_cpu_copy_thread_is_stalled(
    state: DepotState,
    redis_standalone: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(CopyQueue, "stall_seconds", 1.0)
    settings = RemoteSettings(
        url=redis_standalone.url,
        key_file=str(write_key_file(tmp_path / "fleet.key", new_secret())),
    )
    link = RemoteLink.from_settings(settings, state.index, state.arena, state.copy_queue)
    state.attach_tier(link)
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    rows = {i: os.urandom(SECTION) for i in (1, 2, 3)}
    stats = link.stats
    gate = threading.Event()

    async def run() -> None:
        link.start()
        try:
            # Before the stall: key 1 goes to the tier, then leaves the pool.
            await state.put(session.id, "ns", key(1), 0, rows[1])
            await until(lambda: stats.writes == 1)
            assert state.evict("ns", [key(1)])[0] == 1
            held = [
                asyncio.ensure_future(state.copy_queue.run(lambda: gate.wait(30)))
                for _ in range(state.copy_queue.threads)
            ]
            try:
                await asyncio.sleep(1.1)  # past stall_seconds: no housekeeping here
                # A row made ready by a GPU's threads is not written: dropped at once.
                store_off_the_cpu_threads(state, key(2), rows[2])
                await until(lambda: stats.write_drops["copies_stalled"] == 1, 3.0)
                # A fetched row is not loaded: dropped at once, nothing left claimed.
                await state.prefetch(session.id, "ns", [key(1)])
                await until(lambda: stats.fetch_drops["copies_stalled"] == 1, 3.0)
                assert stats.writes == 1 and stats.hits == 0
                assert state.index.counts()["writing"] == 0
                assert not any(held_copy.done() for held_copy in held)
            finally:
                gate.set()
            await asyncio.gather(*held)
            # The stall over, the same tier writes and fetches again.
            await state.put(session.id, "ns", key(3), 0, rows[3])
            await until(lambda: stats.writes == 2)
            await state.prefetch(session.id, "ns", [key(1)])
            await until(lambda: stats.hits == 1)
            assert await state.get(session.id, "ns", key(1), 0) == rows[1]
            assert sum(stats.write_drops.values()) == sum(stats.fetch_drops.values()) == 1
        finally:
            await link.close()

    asyncio.run(run())
    assert not [r for r in caplog.records if r.exc_info], "a drop is not an error"
