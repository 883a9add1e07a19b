"""The crash journal: its records and replay, compaction, and a crash recovery
run step by step on a real state (arena in a pool file, index, copy threads)
without the gRPC layer. End to end with SIGKILL: test_crash_recovery.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from kvdepot.server.config import ServeConfig
from kvdepot.server.core import journal
from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.memory import journal_file
from kvdepot.server.state import DepotState

PAGE = 4096
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=2, groups=((PAGE, PAGE),))
SECTION = 2 * 2 * PAGE
ROWS = 40


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


def data(i: int) -> bytes:
    return hashlib.shake_256(i.to_bytes(8, "big")).digest(SECTION)


def test_replay_keeps_live_rows_and_stops_at_a_torn_record() -> None:
    recs = [
        journal.header(1 << 20, 4096, "boot"),
        journal.layout(0, LAYOUT),
        journal.ready(0, key(1), 0, SECTION),
        journal.ready(0, key(2), SECTION, SECTION),
        journal.checksum(0, key(1), 111),
        journal.freed(0, key(2)),
        journal.ready(0, key(3), SECTION, SECTION, 333),
        journal.ready(0, key(1), 2 * SECTION, SECTION),  # stored again: no checksum yet
    ]
    st = journal.replay(b"".join(recs))
    assert (st.pool_size, st.granularity, st.records) == (1 << 20, 4096, len(recs))
    assert st.layouts == {"ns": LAYOUT}
    assert list(st.rows) == [("ns", key(3)), ("ns", key(1))]
    assert st.rows["ns", key(3)] == journal.Row(SECTION, SECTION, 333)
    assert st.rows["ns", key(1)] == journal.Row(2 * SECTION, SECTION, None)
    # A record cut short (the process killed mid-write) ends the replay there.
    whole = b"".join(recs[:4])
    torn = journal.replay(whole + recs[4][:-3])
    assert torn.records == 4 and torn.torn_bytes == len(recs[4]) - 3
    assert torn.rows["ns", key(1)].crc is None
    damaged = bytearray(b"".join(recs))
    damaged[len(whole) + 12] ^= 1  # inside the SUM record's payload
    assert journal.replay(bytes(damaged)).records == 4
    with pytest.raises(journal.JournalError):
        journal.replay(recs[2])  # no header
    assert journal.replay(b"").records == 0


def crash(st: DepotState) -> None:
    """What a SIGKILL leaves: the journal and the pool file, no snapshot."""
    assert st.journal is not None
    st.journal.close()
    st.copy_queue.close()
    st.arena.close()
    assert st._pool_lock is not None
    os.close(st._pool_lock)


async def until(cond: object, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_chunk_events_are_journaled_and_format_1_journals_still_replay() -> None:
    """An EVENT record gives the row just listed its chunk event (what routers index
    it by); the row re-stored without one has none; a journal an older kvdepot wrote
    (format 1) replays as before; an event past the bound ends the replay there."""
    event = os.urandom(300)
    row = journal.Row(0, SECTION, 111, event)
    recs = [
        journal.header(1 << 20, 4096, "boot"),
        journal.layout(0, LAYOUT),
        journal.listed(0, key(1), row),
        journal.listed(0, key(2), journal.Row(SECTION, SECTION, 222)),
    ]
    st = journal.replay(b"".join(recs))
    assert st.rows["ns", key(1)] == row
    assert st.rows["ns", key(2)].chunk_event == b""
    again = journal.ready(0, key(1), 2 * SECTION, SECTION)  # re-stored: a new row
    assert journal.replay(b"".join([*recs, again])).rows["ns", key(1)].chunk_event == b""

    old_head = journal._frame(
        journal.HEADER + b'{"format":1,"pool_size":1048576,"granularity":4096}'
    )
    old = [old_head, recs[1], journal.ready(0, key(3), 0, SECTION, 333)]
    assert journal.replay(b"".join(old)).rows["ns", key(3)] == journal.Row(0, SECTION, 333)

    too_long = journal.chunk_event(0, key(1), b"x" * (MAX_CHUNK_EVENT_BYTES + 1))
    cut = journal.replay(b"".join([*recs, too_long]))
    assert cut.records == st.records and "malformed" in cut.stopped


def test_a_layouts_group_ids_are_journaled() -> None:
    lay = NamespaceLayout("ids", 1, 1, ((PAGE,),), group_ids=(1,))
    st = journal.replay(journal.header(1 << 20, 4096, "boot") + journal.layout(0, lay))
    assert st.layouts == {"ids": lay} and st.layouts["ids"].group_ids == (1,)


def test_recovery_serves_rows_as_they_are_verified(tmp_path: Path) -> None:
    config = ServeConfig(
        socket="/nonexistent/kvdepot.sock",
        pool_size=4 << 20,
        copy_threads=1,
        pool_file=str(tmp_path / "pool"),
    )

    async def run() -> None:
        st = DepotState.create(config)
        session = st.open_session("test", os.getpid(), "")
        st.register(session.id, LAYOUT, 0, [], [], [])
        for i in range(ROWS):
            assert (await st.put(session.id, "ns", key(i), 0, data(i)))[1]
        j = st.journal
        assert j is not None
        await until(lambda: all(r.crc is not None for r in j.live.values()))
        crash(st)

        st = DepotState.create(config)
        st.debug_invariants = True
        # Nothing verified yet (results come back on this loop): the rows are
        # claimed but invisible, and GetStats says how far the recovery is.
        s = st.stats()
        assert (s["recovery_blocks_total"], s["recovery_blocks_verified"]) == (ROWS, 0)
        assert not s["recovery_complete"] and s["ready_blocks"] == 0
        assert s["used_bytes"] == ROWS * SECTION
        reader = st.open_session("reader", os.getpid(), "")
        st.register(reader.id, LAYOUT, 0, [], [], [])  # joins "ns": it may Lookup and Get
        assert st.lookup(reader.id, "ns", [key(i) for i in range(ROWS)]) == [False] * ROWS
        assert st.verify_invariants() is None
        await until(lambda: st.recovery.complete)
        s = st.stats()
        assert (s["recovery_blocks_verified"], s["recovery_blocks_rejected"]) == (ROWS, 0)
        assert s["ready_blocks"] == ROWS
        for i in range(ROWS):
            assert await st.get(reader.id, "ns", key(i), 0) == data(i)
        assert st.verify_invariants() is None
        st.close()

    asyncio.run(run())


def test_compaction_keeps_exactly_the_live_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_file, "COMPACT_MIN_BYTES", 1)
    monkeypatch.setattr(journal_file, "COMPACT_SLICE", 7)
    config = ServeConfig(
        socket="/nonexistent/kvdepot.sock",
        pool_size=1 << 20,  # 16 rows: stores evict by LRU all along
        copy_threads=1,
        pool_file=str(tmp_path / "pool"),
    )

    async def run() -> None:
        st = DepotState.create(config)
        session = st.open_session("test", os.getpid(), "")
        st.register(session.id, LAYOUT, 0, [], [], [])
        j = st.journal
        assert j is not None
        for i in range(200):
            await st.put(session.id, "ns", key(i), 0, data(i))
        await until(lambda: all(r.crc is not None for r in j.live.values()))
        assert j.wants_compaction()
        size = os.path.getsize(j.path)

        async def more() -> None:  # stores while the compaction runs
            for i in range(200, 230):
                await st.put(session.id, "ns", key(i), 0, data(i))
                await asyncio.sleep(0)

        await asyncio.gather(j.compact(), more())
        await until(lambda: all(r.crc is not None for r in j.live.values()))
        assert os.path.getsize(j.path) < size
        replayed = journal.replay(Path(j.path).read_bytes()).rows
        assert replayed == j.live
        assert set(replayed) == {("ns", k) for k in st.ready_keys("ns")}
        st.close()

    asyncio.run(run())
