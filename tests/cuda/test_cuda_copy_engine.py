"""The CUDA copy engine against the fake driver: mapping per handle, refusals with
status codes, events, batches, streams per thread and the fallbacks on failure.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.cuda.dma import CudaCopyEngine, CudaIpcRegion
from kvdepot.server.cuda.driver import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CudaError
from kvdepot.server.memory.copy_engine import LOAD, STORE
from tests.support.fake_cuda import UUID0, UUID1, FakeDriver, ipc_msg
from tests.support.regions import ArrayRegion


def test_engine_maps_once_per_handle_and_unmaps_with_the_last_region() -> None:
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    handle, buf = drv.export(1 << 20)
    r1, e1 = eng.open_region(ipc_msg(handle, 4096, offset=8192))
    r2, _ = eng.open_region(ipc_msg(handle, 1 << 20))
    assert e1 is eng and isinstance(r1, CudaIpcRegion) and r1.kind == "cuda_ipc"
    assert r1.address == ctypes.addressof(buf) + 8192 and r1.size == 4096
    assert sum(1 for e in drv.log if e[0] == "open") == 1  # one cuIpcOpenMemHandle
    assert eng.open_mappings == 1 and len(drv.opened_events) == 1
    r1.close()
    r1.close()  # idempotent
    assert eng.open_mappings == 1 and drv.open_counts
    r2.close()
    assert eng.open_mappings == 0 and not drv.open_counts and not drv.opened_events
    assert drv.contexts == [0]


def test_engine_refuses_bad_registrations_with_status_codes() -> None:
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    handle, _ = drv.export(1 << 20)
    with pytest.raises(errors.DepotError) as exc:
        eng.open_region(ipc_msg(handle[:10], 4096))
    assert exc.value.code.name == "INVALID_ARGUMENT" and "64" in exc.value.message
    with pytest.raises(errors.DepotError) as exc:
        eng.open_region(ipc_msg(handle, 4096, uuid=UUID1))
    assert exc.value.code.name == "FAILED_PRECONDITION"
    assert UUID1 in exc.value.message and UUID0 in exc.value.message
    with pytest.raises(errors.DepotError) as exc:
        eng.open_region(ipc_msg(handle, 4096, offset=(1 << 20) - 100))
    assert exc.value.code.name == "INVALID_ARGUMENT" and "exceeds the allocation" in (
        exc.value.message
    )
    with pytest.raises(errors.DepotError) as exc:
        eng.open_region(ipc_msg(b"\x07" * 64, 4096))  # a handle nobody exported
    assert exc.value.code.name == "INVALID_ARGUMENT" and "still alive" in exc.value.message
    # Nothing leaked from the failed attempts.
    assert eng.open_mappings == 0 and not drv.open_counts and not drv.opened_events


def test_copy_waits_on_the_event_issues_batches_and_synchronises() -> None:
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices(), max_batch=3)
    handle, buf = drv.export(64 * 1024)
    region, _ = eng.open_region(ipc_msg(handle, 64 * 1024))
    ctypes.memmove(region.address, bytes(range(256)) * 256, 64 * 1024)
    pool = np.zeros(64 * 1024, np.uint8)
    plan = CopyPlan()
    for i in range(8):  # reverse the 8 KiB pieces into the pool
        plan.add(0, i * 8192, (7 - i) * 8192, 8192)
    drv.log.clear()
    eng.copy(STORE, [region], pool.ctypes.data, plan)
    kinds = [e[0] for e in drv.log]
    assert kinds == ["wait", "batch", "batch", "batch", "sync"]
    streams = {e[1] for e in drv.log}
    assert len(streams) == 1  # one stream for this thread and device
    got = pool.tobytes()
    src = ctypes.string_at(region.address, 64 * 1024)
    assert all(
        got[(7 - i) * 8192 : (8 - i) * 8192] == src[i * 8192 : (i + 1) * 8192] for i in range(8)
    )
    # A load waits on the event too (the worker's queued kernels may still use the
    # pages), and writes the bytes back.
    ctypes.memset(region.address, 0, 64 * 1024)
    drv.log.clear()
    eng.copy(LOAD, [region], pool.ctypes.data, plan)
    assert drv.log[0][0] == "wait" and drv.log[-1][0] == "sync"
    assert ctypes.string_at(region.address, 64 * 1024) == src
    assert eng.counters["copies"] == 2 and eng.counters["batches"] == 6
    region.close()


def test_each_copy_thread_gets_its_own_stream() -> None:
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    handle, _ = drv.export(8192)
    region, _ = eng.open_region(ipc_msg(handle, 8192, event=b""))
    pool = np.zeros(8192, np.uint8)
    plan = CopyPlan()
    plan.add(0, 0, 0, 4096)
    plan.add(0, 4096, 4096 + 0, 4096)
    seen: list[int] = []

    def work() -> None:
        eng.copy(STORE, [region], pool.ctypes.data, plan)
        seen.append(next(e[1] for e in reversed(drv.log) if e[0] == "sync"))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
        t.join()
    assert len(set(seen)) == 3
    assert not any(e[0] == "wait" for e in drv.log)  # no event registered: no wait
    region.close()
    eng.close()
    assert sum(1 for e in drv.log if e[0] == "destroy") == 3


def test_batch_failures_fall_back_to_one_copy_per_run() -> None:
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    handle, _ = drv.export(8192)
    region, _ = eng.open_region(ipc_msg(handle, 8192))
    ctypes.memmove(region.address, b"\x5a" * 8192, 8192)
    pool = np.zeros(8192, np.uint8)
    plan = CopyPlan()
    plan.add(0, 0, 4096, 4096)
    plan.add(0, 4096, 0, 4096)
    drv.fail_batch = CudaError(
        "cuMemcpyBatchAsync",
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    )
    eng.copy(STORE, [region], pool.ctypes.data, plan)
    assert (pool == 0x5A).all() and eng.use_batch  # a transient failure keeps batching on
    drv.fail_batch = CudaError(
        "cuMemcpyBatchAsync",
        CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    )
    pool[:] = 0
    eng.copy(STORE, [region], pool.ctypes.data, plan)
    assert (pool == 0x5A).all() and not eng.use_batch
    assert eng.counters["loop_fallbacks"] == 2
    region.close()


def test_a_failing_copy_still_synchronises_before_it_raises() -> None:
    drv = FakeDriver(has_batch=False)
    eng = CudaCopyEngine(drv, drv.devices())
    handle, _ = drv.export(8192)
    region, _ = eng.open_region(ipc_msg(handle, 8192))
    plan = CopyPlan()
    plan.add(0, 0, 0, 4096)
    drv.fail_memcpy = CudaError("cuMemcpyAsync", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", "boom")
    drv.log.clear()
    pool = np.zeros(8192, np.uint8)
    with pytest.raises(CudaError, match="ILLEGAL_ADDRESS"):
        eng.copy(LOAD, [region], pool.ctypes.data, plan)
    assert drv.log[-1][0] == "sync"
    region.close()
    with pytest.raises(ValueError, match="open cuda_ipc regions"):
        eng.copy(LOAD, [region], pool.ctypes.data, plan)
    with pytest.raises(ValueError, match="open cuda_ipc regions"):
        eng.copy(LOAD, [ArrayRegion(pool)], pool.ctypes.data, plan)
