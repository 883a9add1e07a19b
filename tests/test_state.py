"""DepotState's plug-in points and its event bus, on a real state (arena, index,
copy threads) without the gRPC layer."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from typing import Any

import pytest

from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.kinds import EventKind, EvictionReason, PutOutcome
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.state import DepotState

PAGE = 4096
LAYOUT = NamespaceLayout("ns", world_size=1, blocks_per_chunk=2, groups=((PAGE, PAGE),))
SECTION = 2 * 2 * PAGE


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


def test_listeners_and_watchers_hear_every_index_change(state: DepotState) -> None:
    heard: list[IndexEvent] = []
    state.add_event_listener(heard.append)
    state.add_event_listener(lambda e: 1 / 0)  # a broken listener changes nothing
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    watcher = state.add_watcher(session.id, "ns")
    assert state.ready_after("ns", None, 16) == ([], None)
    data = os.urandom(SECTION)

    async def run() -> None:
        outcome, is_ready, _ = await state.put(session.id, "ns", key(1), 0, data)
        assert (outcome, is_ready) == (PutOutcome.STORED, True)
        assert await state.get(session.id, "ns", key(1), 0) == data

    asyncio.run(run())
    assert state.evict("ns", [key(1)]) == (1, 0, 0)
    assert [(e.kind, e.keys, e.reason) for e in heard] == [
        (EventKind.STORED, (key(1),), None),
        (EventKind.REMOVED, (key(1),), EvictionReason.ADMIN),
    ]
    assert list(watcher.queue) == heard
    assert watcher.take_run(100) == heard[0] and watcher.take_run(100) == heard[1]
    assert watcher.take_run(100) is None
    state.remove_watcher(watcher)
    s = state.stats()
    assert (s["store_jobs"], s["stored_blocks"], s["load_jobs"], s["loaded_blocks"]) == (1, 1, 1, 1)
    assert (s["stored_bytes"], s["loaded_bytes"]) == (SECTION, SECTION)


def test_memory_paths_are_added_explicitly(state: DepotState) -> None:
    session = state.open_session("test", os.getpid(), "")
    with pytest.raises(errors.DepotError, match="not available in this daemon") as exc:
        state.register(session.id, LAYOUT, 0, [("pvm", object())], [], [])
    assert exc.value.code is errors.Code.INVALID_ARGUMENT
    opened = []

    class Path:
        kind = MemoryPath.PVM

        def open(self, handle: object, session_id: str) -> Any:
            opened.append((handle, session_id))
            raise ZeroDivisionError

    class Shm(Path):
        kind = MemoryPath.SHM

    with pytest.raises(ValueError, match="built in"):
        state.add_memory_path(Shm())
    state.add_memory_path(Path())
    with pytest.raises(ZeroDivisionError):  # the path opened (and its error propagated)
        state.register(session.id, LAYOUT, 0, [("pvm", "handle")], [], [])
    assert opened == [("handle", session.id)] and not state.registrations


def test_a_snapshot_is_read_in_key_order_a_slice_at_a_time(state: DepotState) -> None:
    """`ready_after` walks the namespace's sorted keys from a cursor: every READY key once,
    in order, whatever the slice; a key added or removed between slices changes only
    what is still ahead of the cursor (a watcher hears the rest as events)."""
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    data = os.urandom(SECTION)

    async def put(*indices: int) -> None:
        for i in indices:
            await state.put(session.id, "ns", key(i), 0, data)

    asyncio.run(put(*range(10)))
    for limit in (1, 3, 10, 11):
        got: list[bytes] = []
        after = None
        while True:
            batch, after = state.ready_after("ns", after, limit)
            got += batch
            if after is None:
                break
        assert got == sorted(key(i) for i in range(10)), limit
    first, after = state.ready_after("ns", None, 5)
    assert after == first[-1]
    ahead = next(i for i in range(10, 40) if key(i) > after)
    behind = next(i for i in range(10, 40) if key(i) < after)
    asyncio.run(put(ahead, behind))
    state.evict("ns", [first[0]])
    rest, end = state.ready_after("ns", after, 100)
    assert end is None and key(ahead) in rest and key(behind) not in rest
    assert state.ready_after("gone", None, 5) == ([], None)


def test_a_watcher_coalesces_runs_and_resyncs_when_it_falls_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvdepot.server.state import events

    def ev(kind: EventKind, i: int, reason: EvictionReason | None = None) -> IndexEvent:
        return IndexEvent("ns", kind, (key(i),), reason)

    async def run() -> None:
        w = events.Watcher("ns")
        stored, removed = EventKind.STORED, EventKind.REMOVED
        for e in [
            ev(stored, 0),
            ev(stored, 1),
            ev(removed, 0, EvictionReason.LRU),
            ev(removed, 1, EvictionReason.ADMIN),
            ev(stored, 2),
            ev(stored, 3),
        ]:
            w.push(e)
        runs = []
        while (r := w.take_run(max_keys=10)) is not None:
            runs.append((r.kind, len(r.keys), r.reason))
        assert runs == [
            (stored, 2, None),
            (removed, 1, EvictionReason.LRU),
            (removed, 1, EvictionReason.ADMIN),
            (stored, 2, None),
        ]
        monkeypatch.setattr(events, "WATCH_QUEUE_LIMIT", 3)
        for i in range(4):
            w.push(ev(stored, i))
        assert w.lagged and w.take_run(10) is None and w.wakeup.is_set()

    asyncio.run(run())


def test_put_and_get_fail_at_once_while_every_cpu_copy_thread_is_stalled(
    state: DepotState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inline engine's Put and Get use the shared CPU copy threads: while every one
    of them holds a copy past the stall threshold, both fail at once (UNAVAILABLE,
    nothing claimed) instead of queuing behind it; once a copy ends they work."""
    monkeypatch.setattr(CopyQueue, "stall_seconds", 1.0)
    session = state.open_session("test", os.getpid(), "")
    state.register(session.id, LAYOUT, 0, [], [], [])
    data = os.urandom(SECTION)
    gate = threading.Event()

    async def run() -> None:
        assert (await state.put(session.id, "ns", key(1), 0, data))[0] is PutOutcome.STORED
        held = [
            asyncio.ensure_future(state.copy_queue.run(lambda: gate.wait(30)))
            for _ in range(state.copy_queue.threads)
        ]
        try:
            await asyncio.sleep(1.1)  # past stall_seconds
            for call in (
                state.put(session.id, "ns", key(2), 0, data),
                state.get(session.id, "ns", key(1), 0),
            ):
                with pytest.raises(errors.DepotError) as err:
                    await asyncio.wait_for(call, 0.5)
                assert err.value.code.name == "UNAVAILABLE"
                assert "every copy thread has held one copy" in err.value.message
            assert state.index.counts()["writing"] == 0  # key 2 never claimed
        finally:
            gate.set()
        await asyncio.gather(*held)
        assert (await state.put(session.id, "ns", key(2), 0, data))[0] is PutOutcome.STORED
        assert await state.get(session.id, "ns", key(1), 0) == data

    asyncio.run(run())


class _Gated:
    """A registration's memory as an address range nothing reads, whose copies (the
    bench's NullCopyEngine: planned, nothing moved) wait for `gate` first: a copy
    held in flight for as long as the test wants."""

    kind = MemoryPath.PVM

    def __init__(self, size: int, gate: threading.Event) -> None:
        self.size, self.gate, self.regions = size, gate, []  # type: ignore[var-annotated]

    def open(self, handle: object, session_id: str) -> Any:
        from kvdepot.bench.ceiling import NullCopyEngine
        from kvdepot.bench.inproc import LocalRegion

        gate = self.gate

        class Engine(NullCopyEngine):
            def prepare(self, *args: Any, **kwargs: Any) -> Any:
                copy = super().prepare(*args, **kwargs)
                return lambda: (gate.wait(30), copy())

        region = LocalRegion(1 << 40, self.size)
        self.regions.append(region)
        return region, Engine()


def _gated_registration(state: DepotState, gate: threading.Event) -> tuple[str, int]:
    from kvdepot.server.core.memory_map import LayerRef, TensorView

    state.add_memory_path(_Gated(2 * 64 * PAGE, gate))
    session = state.open_session("test", os.getpid(), "")
    tensors = [TensorView(0, i * 64 * PAGE, 64, PAGE, PAGE) for i in range(2)]
    groups = [[LayerRef(i, 0, PAGE) for i in range(2)]]
    layout = NamespaceLayout("ns", 1, 1, ((PAGE, PAGE),))
    reg = state.register(session.id, layout, 0, [("pvm", None)], tensors, groups)
    return session.id, reg.id


def _store_job(session_id: str, registration_id: int, keys: list[bytes]) -> Any:
    from kvdepot.common.jobs import Job
    from kvdepot.common.kinds import Direction

    n = len(keys)
    return Job(1, int(Direction.STORE), keys, list(range(n)), [n], [0], False,
               registration_id, "", session_id)  # fmt: skip


def test_a_registration_ended_mid_copy_stays_mapped_until_the_copy_ends(
    state: DepotState,
) -> None:
    """A store job's copy holds its registration mapped (Sessions.begin_use/end_use):
    the session closing meanwhile ends the registration, which stays, closing, until
    the copy has ended, and then goes."""
    gate = threading.Event()
    session_id, reg_id = _gated_registration(state, gate)

    async def run() -> None:
        job = asyncio.ensure_future(state.run_job(_store_job(session_id, reg_id, [key(1)])))
        while state.traffic.inflight_jobs == 0 or state.copy_queue.idle == 2:
            await asyncio.sleep(0.01)  # the copy has started, held at the gate
        state.close_session(session_id)
        reg = state.registrations.get(reg_id)
        assert reg is not None and reg.closing and reg.inflight == 1
        gate.set()
        await job
        assert reg_id not in state.registrations and reg.inflight == 0

    asyncio.run(run())
    state.check_invariants()


def test_the_invariants_are_checked_after_each_job_when_asked(state: DepotState) -> None:
    """With KVDEPOT_CHECK_INVARIANTS=1 (debug_invariants) a job is a `mutation`: the
    invariants are checked when it ends, and a broken one sticks; without, a job runs
    as the runner's own coroutine and checks nothing."""
    gate = threading.Event()
    gate.set()
    session_id, reg_id = _gated_registration(state, gate)
    state.traffic.inflight_jobs = -1  # broken: a job in flight fewer than none

    async def job(i: int) -> None:
        result = await state.run_job(_store_job(session_id, reg_id, [key(i)]))
        assert result.success and result.stored_keys == 1, result

    asyncio.run(job(1))
    assert state.invariant_failure is None  # not checked
    state.debug_invariants = True
    asyncio.run(job(2))
    assert state.invariant_failure is not None and "invariant broken" in state.invariant_failure
