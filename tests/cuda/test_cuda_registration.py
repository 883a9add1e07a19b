"""The registration lifecycle through the real DepotState and the fake driver: every
byte stored and loaded, unmapping after the last copy, bad handles leave nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import re
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvdepot.common.cuda_driver import DeviceInfo
from kvdepot.common.cuda_handles import parse_uuid
from kvdepot.server import errors
from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.memory_map import LayerRef
from kvdepot.server.cuda import cuda_path, enable_cuda
from kvdepot.server.memory.copy_engine import LOAD, STORE
from kvdepot.server.state import DepotState
from tests.support.fake_cuda import (
    UUID0,
    UUID1,
    FakeDriver,
    FakeGpuHost,
    ipc_msg,
    job,
    make_key,
    register_fake_engine,
)

# -- registration lifecycle through the real DepotState --------------------------------


def test_depot_state_stores_and_loads_every_byte_through_the_cuda_engine(
    state: DepotState, gpu_host: FakeGpuHost
) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={}, senders=gpu_host.senders)
    assert cuda_path(state) is not None
    session, reg, buf, lay, tensors = register_fake_engine(state, drv)
    assert reg.memory_path == "cuda_ipc" and reg.registered_bytes == 8 * 16 * 16384
    base = ctypes.addressof(buf) + 4096
    rng = np.random.default_rng(1)
    gpu = np.frombuffer(buf, np.uint8)[4096:]
    gpu[:] = rng.integers(0, 256, gpu.size, dtype=np.uint8)
    keys = [make_key(i) for i in range(5)]

    async def run() -> None:
        out = await state.run_job(job(reg, session, 1, STORE, keys, [1, 2, 3, 4, 5]))
        assert out.success and out.stored_keys == 5, out
        assert out.bytes == 5 * 8 * 16384
        out = await state.run_job(job(reg, session, 2, LOAD, keys, [10, 11, 12, 13, 14]))
        assert out.success and out.bytes == 5 * 8 * 16384, out

    asyncio.run(run())
    for t in tensors:
        for s, d in zip([1, 2, 3, 4, 5], [10, 11, 12, 13, 14], strict=True):
            a, b = t.region_offset + s * t.block_stride, t.region_offset + d * t.block_stride
            assert np.array_equal(gpu[a : a + t.page_bytes], gpu[b : b + t.page_bytes])
    assert ctypes.addressof(buf) in drv.open_counts and base
    # The session ends (the engine died): the mapping and the event go.
    state.close_session(session.id)
    assert not state.registrations and not drv.open_counts and not drv.opened_events


def test_a_session_closed_mid_copy_unmaps_only_after_the_copy(
    state: DepotState, gpu_host: FakeGpuHost
) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={}, senders=gpu_host.senders)
    session, reg, buf, _, _ = register_fake_engine(state, drv)
    drv.copy_gate = threading.Event()

    async def run() -> None:
        task = asyncio.ensure_future(state.run_job(job(reg, session, 1, STORE, [make_key(0)], [0])))
        while not state.traffic.inflight_jobs or reg.inflight == 0:
            await asyncio.sleep(0.01)
        state.close_session(session.id)
        assert drv.open_counts, "unmapped while a copy was running"
        drv.copy_gate.set()
        out = await task
        assert out.success
        assert not drv.open_counts and not state.registrations

    asyncio.run(run())


def test_unregister_closes_the_mapping_and_bad_handles_leave_no_registration(
    state: DepotState, gpu_host: FakeGpuHost
) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={}, senders=gpu_host.senders)
    session, reg, _, lay, tensors = register_fake_engine(state, drv)
    state.unregister(session.id, reg.id)
    assert not drv.open_counts and not state.registrations
    refs = [[LayerRef(i, 0, 16384) for i in range(8)]]
    with pytest.raises(ValueError) as exc:  # tensors beyond the registered size
        state.register(
            session.id, lay, 0, [("cuda_ipc", ipc_msg(*drv.export(8192)[:1], 8192))], tensors, refs
        )
    err = errors.as_depot_error(exc.value)  # the status the service answers with
    assert err is not None and err.code.name == "INVALID_ARGUMENT"
    assert not drv.open_counts and not state.registrations


def _two_gpus_with_gpu0_gated(
    state: DepotState, gpu_host: FakeGpuHost
) -> tuple[Any, Any, Any, Any, threading.Event]:
    """Two fake GPUs, each registered in a namespace of its own, GPU 0's DMA held until
    the gate opens: (session 0, registration 0, session 1, registration 1, gate)."""
    drv = FakeDriver(
        [
            DeviceInfo(0, parse_uuid(UUID0), "H200 a", "0000:18:00.0"),
            DeviceInfo(1, parse_uuid(UUID1), "H200 b", "0000:9A:00.0"),
        ]
    )
    assert enable_cuda(state, state.arena, driver=drv, env={}, senders=gpu_host.senders)
    s0, r0, _, _, _ = register_fake_engine(state, drv, uuid=UUID0, namespace="gpu-a")
    s1, r1, _, _, _ = register_fake_engine(state, drv, uuid=UUID1, namespace="gpu-b")
    assert (r0.copy_device, r1.copy_device) == ((UUID0, "0000:18:00.0"), (UUID1, "0000:9A:00.0"))
    drv.sync_gates[0] = gate = threading.Event()
    return s0, r0, s1, r1, gate


async def _hold_every_gpu0_thread(state: DepotState, s0: Any, r0: Any) -> list[Any]:
    """A store on GPU 0 for each of its copy threads, returned once all have started (a
    copy's busy time and age run from its start, not from when it was queued)."""
    threads = state.copy_queues.device_threads
    hung = [
        asyncio.ensure_future(state.run_job(job(r0, s0, 1 + i, STORE, [make_key(10 + i)], [i])))
        for i in range(threads)
    ]
    for _ in range(1000):
        if state.stats()["gpu_copies_started"][:1] == [threads]:
            break
        await asyncio.sleep(0.01)
    assert state.stats()["gpu_copies_started"] == [threads], "GPU 0's copies never started"
    return hung


def _assert_said_one_gpu0_stall(caplog: pytest.LogCaptureFixture) -> None:
    """The copy log holds exactly GPU 0's stall: its start (at least 1 s old, one job
    queued behind failed) and its end."""
    said = [r.getMessage() for r in caplog.records if r.name == "kvdepot.copy"]
    assert len(said) == 2, said
    began = re.fullmatch(
        rf"GPU {UUID0}: every copy thread has held one copy for (\d+) s or more \(a hung "
        r"DMA\?\); refusing new jobs for these threads until a copy ends \(1 queued "
        r"behind failed\)",
        said[0],
    )
    assert began and int(began.group(1)) >= 1, said
    assert said[1] == f"GPU {UUID0}: a stalled copy ended; taking jobs again", said


def test_a_gpus_jobs_never_wait_behind_another_gpus(
    state: DepotState, gpu_host: FakeGpuHost
) -> None:
    """Each GPU copies on threads of its own: with GPU 0's DMA hung on every one of its
    threads, GPU 1's job still runs; GPU 0's jobs end once its DMA does."""
    s0, r0, s1, r1, gate = _two_gpus_with_gpu0_gated(state, gpu_host)
    threads = state.copy_queues.device_threads

    async def run() -> None:
        hung: list[Any] = []
        try:
            hung = await _hold_every_gpu0_thread(state, s0, r0)
            await asyncio.sleep(0.1)
            out = await asyncio.wait_for(
                state.run_job(job(r1, s1, 9, STORE, [make_key(20)], [0])), 10
            )
            assert out.success and out.stored_keys == 1, out
            assert not any(h.done() for h in hung)
            # While GPU 0's copies hang they show as running: old, and busy meanwhile.
            during = state.stats()
            assert during["gpu_copy_longest_running_seconds"][0] >= 0.1
            assert during["gpu_copy_longest_running_seconds"][1] == 0.0  # GPU 1's ended
            assert during["gpu_copy_busy_seconds"][0] >= 0.1 * threads
        finally:
            gate.set()
        assert all(o.success for o in await asyncio.gather(*hung))

    asyncio.run(run())
    assert list(state.copy_queues.devices) == [UUID0, UUID1]
    # Each GPU counts its own copies; GPU 0's threads were busy the whole time it hung.
    stats = state.stats()
    assert stats["gpu_copies_started"] == [threads, 1]
    assert stats["gpu_copy_busy_seconds"][0] >= 0.1 * threads  # each hung 0.1 s or more
    assert stats["gpu_copy_longest_running_seconds"] == [0.0, 0.0]


def test_a_hung_gpus_new_jobs_fail_at_once_and_the_other_gpu_goes_on(
    state: DepotState,
    gpu_host: FakeGpuHost,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every one of GPU 0's copy threads holds a DMA that does not end: GPU 0's next job
    fails at once (UNAVAILABLE, its claimed slot released, nothing stored) instead of
    queuing behind them, and so does the job queued behind them before; GPU 1's job
    runs; once the DMA ends, GPU 0 takes jobs again. The log says when the stall began
    and ended."""
    # A second: room for a slow machine between the copies' start and the queued job.
    monkeypatch.setattr(CopyQueue, "stall_seconds", 1.0)
    s0, r0, s1, r1, gate = _two_gpus_with_gpu0_gated(state, gpu_host)
    threads = state.copy_queues.device_threads

    async def run() -> None:
        hung: list[Any] = []
        try:
            hung = await _hold_every_gpu0_thread(state, s0, r0)
            # Not yet stalled: a job queues behind the hung copies.
            queued = asyncio.ensure_future(
                state.run_job(job(r0, s0, 7, STORE, [make_key(30)], [6]))
            )
            await asyncio.sleep(1.0)  # past stall_seconds
            assert not queued.done()
            started = time.monotonic()
            out = await asyncio.wait_for(
                state.run_job(job(r0, s0, 8, STORE, [make_key(31)], [7])), 2
            )
            assert time.monotonic() - started < 1.0  # at once, not behind the hung DMA
            assert not out.success and out.error_code == "UNAVAILABLE", out
            assert f"GPU {UUID0}: every copy thread" in out.error and "hung" in out.error
            # The job queued behind them fails as the stall is found; both slots go back.
            before = await asyncio.wait_for(queued, 2)
            assert not before.success and before.error_code == "UNAVAILABLE", before
            assert state.index.counts()["writing"] == threads
            out = await asyncio.wait_for(
                state.run_job(job(r1, s1, 9, STORE, [make_key(20)], [0])), 10
            )
            assert out.success and out.stored_keys == 1, out
        finally:
            gate.set()
        assert all(o.success for o in await asyncio.gather(*hung))
        # The DMA ended: GPU 0 takes jobs again, and the refused keys can be stored.
        out = await state.run_job(job(r0, s0, 10, STORE, [make_key(30), make_key(31)], [6, 7]))
        assert out.success and out.stored_keys == 2, out

    caplog.set_level(logging.WARNING, logger="kvdepot.copy")
    asyncio.run(run())
    assert state.index.counts()["writing"] == 0
    assert state.stats()["gpu_copy_longest_running_seconds"] == [0.0, 0.0]
    _assert_said_one_gpu0_stall(caplog)


def test_a_hung_gpus_queued_jobs_fail_with_no_new_job_to_find_the_stall(
    state: DepotState,
    gpu_host: FakeGpuHost,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No new job comes to GPU 0 once its DMA hangs: the daemon's once-a-second
    housekeeping finds the stall, and the job queued behind the hung copies fails
    (UNAVAILABLE, its slot released) instead of waiting out its engine's timeout.
    Housekeeping before the stall threshold fails nothing; after the DMA ends it logs
    the end, and GPU 0 stores again."""
    # A second: room for a slow machine between the copies' start and the first look.
    monkeypatch.setattr(CopyQueue, "stall_seconds", 1.0)
    s0, r0, _, _, gate = _two_gpus_with_gpu0_gated(state, gpu_host)
    threads = state.copy_queues.device_threads

    async def run() -> None:
        hung: list[Any] = []
        try:
            hung = await _hold_every_gpu0_thread(state, s0, r0)
            queued = asyncio.ensure_future(
                state.run_job(job(r0, s0, 7, STORE, [make_key(30)], [6]))
            )
            await asyncio.sleep(0.05)
            state.housekeeping()  # young copies: not a stall
            await asyncio.sleep(0.05)
            assert not queued.done()
            await asyncio.sleep(1.0)  # past stall_seconds
            assert not queued.done()  # nothing looked yet
            state.housekeeping()
            out = await asyncio.wait_for(queued, 2)
            assert not out.success and out.error_code == "UNAVAILABLE", out
            assert f"GPU {UUID0}: every copy thread" in out.error
            assert state.index.counts()["writing"] == threads
        finally:
            gate.set()
        assert all(o.success for o in await asyncio.gather(*hung))
        state.housekeeping()
        out = await state.run_job(job(r0, s0, 8, STORE, [make_key(30)], [6]))
        assert out.success and out.stored_keys == 1, out

    caplog.set_level(logging.WARNING, logger="kvdepot.copy")
    asyncio.run(run())
    assert state.index.counts()["writing"] == 0
    _assert_said_one_gpu0_stall(caplog)
