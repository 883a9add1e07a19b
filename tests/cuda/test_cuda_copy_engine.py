"""The CUDA copy engine against the fake driver: mapping per handle, refusals with
status codes, events, batches, streams per worker and the fallbacks on failure.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from kvdepot.common.cuda_driver import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED, CudaError
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.cuda.dma import CudaCopyEngine
from kvdepot.server.cuda.ipc_region import CudaIpcRegion
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


def test_copy_waits_on_the_event_issues_batches_and_waits_for_them() -> None:
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
    assert kinds == ["wait", "batch", "batch", "batch", "record", "done"]
    streams = {e[1] for e in drv.log if e[0] != "done"}
    assert len(streams) == 1  # the worker's stream for stores
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
    assert drv.log[0][0] == "wait" and drv.log[-1][0] == "done"
    assert drv.log[0][1] not in streams  # loads have the worker's other stream
    assert ctypes.string_at(region.address, 64 * 1024) == src
    assert eng.counters["copies"] == 2 and eng.counters["batches"] == 6
    region.close()


def test_copy_threads_queue_a_workers_jobs_on_one_stream_and_wait_for_their_own() -> None:
    """Jobs of one worker and direction share a stream (each queues behind the one
    before, as on one engine's own stream); each thread waits on its own event; another
    worker gets its own streams, destroyed with its last region."""
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    regions = []
    for worker_event in (b"", bytes(range(64))):
        handle, _ = drv.export(8192)
        regions.append(eng.open_region(ipc_msg(handle, 8192, event=worker_event))[0])
    pool = np.zeros(8192, np.uint8)
    plan = CopyPlan()
    plan.add(0, 0, 0, 4096)
    plan.add(0, 4096, 4096 + 0, 4096)
    seen: list[tuple[int, int]] = []  # (stream, event) of each job's record

    def work(region: CudaIpcRegion, direction: int) -> None:
        eng.copy(direction, [region], pool.ctypes.data, plan)
        rec = next(e for e in reversed(drv.log) if e[0] == "record")
        seen.append((rec[1], rec[2]))

    threads = [threading.Thread(target=work, args=(regions[0], STORE)) for _ in range(3)]
    for t in threads:
        t.start()
        t.join()
    assert len({s for s, _ in seen}) == 1  # one stream for this worker's stores
    assert len({e for _, e in seen}) == 3  # each thread waited on its own event
    assert not any(e[0] == "wait" for e in drv.log)  # no event registered: no wait
    work(regions[0], LOAD)
    work(regions[1], STORE)
    assert len({s for s, _ in seen}) == 3  # its loads, and another worker's stores
    regions[1].close()  # that worker's stream goes with its last region
    assert sum(1 for e in drv.log if e[0] == "destroy") == 1
    regions[0].close()
    eng.close()
    assert sum(1 for e in drv.log if e[0] == "destroy") == 3
    assert not drv.own_events and not drv.opened_events


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
    assert drv.log[-1][0] == "done"  # waited for what was queued before raising
    region.close()
    with pytest.raises(ValueError, match="open cuda_ipc regions"):
        eng.copy(LOAD, [region], pool.ctypes.data, plan)
    with pytest.raises(ValueError, match="open cuda_ipc regions"):
        eng.copy(LOAD, [ArrayRegion(pool)], pool.ctypes.data, plan)


def test_strided_copies_and_their_fallback_to_one_copy_per_page() -> None:
    """vLLM's layout goes as one 2-D copy per block; when the driver refuses one, the
    job's pages go as descriptors instead (the same bytes), and a driver without 2-D
    copies is not asked again."""
    drv = FakeDriver()
    eng = CudaCopyEngine(drv, drv.devices())
    layers, blocks, page = 4, 2, 4096
    handle, _ = drv.export(layers * 4 * page)
    region, _ = eng.open_region(ipc_msg(handle, layers * 4 * page))
    size = layers * 4 * page
    ctypes.memmove(region.address, np.random.default_rng(1).bytes(size), size)
    plan = CopyPlan()
    for layer in range(layers):  # block b's row at pool slot (1 - b): no runs merge
        for b in range(blocks):
            plan.add(0, layer * 4 * page + b * page, (1 - b) * layers * page + layer * page, page)
    want = b"".join(
        ctypes.string_at(region.address + layer * 4 * page + b * page, page)
        for b in (1, 0)
        for layer in range(layers)
    )

    def store() -> bytes:
        pool = np.zeros(blocks * layers * page, np.uint8)
        drv.log.clear()
        eng.copy(STORE, [region], pool.ctypes.data, plan)
        return pool.tobytes()

    assert store() == want
    assert [e for e in drv.log if e[0] in ("2d", "batch")] == [("2d", drv.log[0][1], 4)] * 2
    drv.fail_2d = CudaError("cuMemcpy2DAsync", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument")
    assert store() == want and eng.use_strided  # one refusal keeps 2-D copies on
    assert [e[0] for e in drv.log if e[0] in ("2d", "batch")] == ["batch"]
    drv.fail_2d = CudaError(
        "cuMemcpy2DAsync", CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "not supported"
    )
    assert store() == want and not eng.use_strided
    assert store() == want  # planned as descriptors from now on
    assert [e[0] for e in drv.log if e[0] in ("2d", "batch")] == ["batch"]
    assert eng.counters["loop_fallbacks"] == 2 and eng.counters["strided"] == 6
    region.close()
