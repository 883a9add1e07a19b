"""The CUDA data path's pure-Python pieces, on CPU: handles, DMA planning, the copy
engine and the registration lifecycle (real DepotState, a fake CUDA driver whose
"device memory" is host memory), pinning, and enabling CUDA on a host without it.

What needs a GPU (the real driver, IPC across processes, DMA speed) is in tests/gpu/.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import itertools
import logging
import threading
from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvdepot.server import errors
from kvdepot.server.config import ServeConfig
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.planner import CopyPlan, LayerRef, MemoryMap, TensorView, plan_job
from kvdepot.server.cuda import cuda_available, cuda_path, enable_cuda, unavailable_reason
from kvdepot.server.cuda import driver as cuda_driver
from kvdepot.server.cuda.dma import CudaCopyEngine, CudaIpcRegion, DmaBatch, plan_descriptors
from kvdepot.server.cuda.driver import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CudaError,
    CudaUnavailable,
    DeviceInfo,
)
from kvdepot.server.cuda.enable import select_devices
from kvdepot.server.cuda.handles import (
    HandleError,
    UnexportableMemory,
    decode,
    encode,
    expandable_segments_enabled,
    format_uuid,
    parse_uuid,
    raw_handle_from_torch,
    unexportable_message,
    validate,
)
from kvdepot.server.cuda.pinning import PoolPinner
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine
from kvdepot.server.state import DepotState, JobSpec
from kvdepot.v1 import depot_pb2 as pb
from tests.support.regions import ArrayRegion

UUID0 = "GPU-8f5e2a1c-0b3d-4e6f-9a7b-1c2d3e4f5a6b"
UUID1 = "GPU-00112233-4455-6677-8899-aabbccddeeff"
HANDLE = bytes(range(1, 65))
EVENT = bytes(range(100, 164))


# -- handles -------------------------------------------------------------------------


def test_uuid_forms_parse_to_the_same_bytes_and_format_canonically() -> None:
    raw = parse_uuid(UUID0)
    assert len(raw) == 16
    for text in (
        UUID0.upper(),
        UUID0[4:],
        UUID0.replace("-", "").replace("GPU", "GPU-"),
        "  " + UUID0 + " ",
        "MIG-" + UUID0[4:],
    ):
        assert parse_uuid(text) == raw, text
    assert format_uuid(raw) == UUID0
    with pytest.raises(HandleError, match="never a device index"):
        parse_uuid("0")
    with pytest.raises(HandleError, match="not a device UUID"):
        parse_uuid("GPU-8f5e2a1c-0b3d-4e6f-9a7b")
    with pytest.raises(HandleError, match="16 bytes"):
        format_uuid(b"\x00" * 15)


def test_a_valid_handle_round_trips_through_the_wire_message() -> None:
    spec = validate(HANDLE, UUID0, 4096, 1 << 30, EVENT)
    msg = encode(spec)
    assert isinstance(msg, pb.CudaIpcHandle)
    wire = pb.CudaIpcHandle.FromString(msg.SerializeToString())
    back = decode(wire)
    assert back == spec
    assert back.device == UUID0 and back.end == 4096 + (1 << 30)
    no_event = decode(pb.CudaIpcHandle(ipc_handle=HANDLE, device_uuid=UUID0, size=8))
    assert no_event.event_handle is None and no_event.offset == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mem_handle": HANDLE[:63]}, "has 63 bytes; a cudaIpcMemHandle_t has 64"),
        ({"mem_handle": b"\x01c" + HANDLE}, "_share_cuda_"),
        ({"mem_handle": b"\x00" * 64}, "all zeros"),
        ({"device_uuid": ""}, "device_uuid is empty"),
        ({"device_uuid": "1"}, "never a device index"),
        ({"size": 0}, "size is 0"),
        ({"offset": (1 << 64) - 8, "size": 16}, "overflows 64 bits"),
        ({"offset": 1 << 48, "size": 1}, "beyond any GPU allocation"),
        ({"offset": -1}, "unsigned 64-bit"),
        ({"event_handle": EVENT[:10]}, "event_handle has 10 bytes"),
    ],
)
def test_bad_handles_are_refused_with_what_to_send(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "mem_handle": HANDLE,
        "device_uuid": UUID0,
        "offset": 0,
        "size": 4096,
        "event_handle": b"",
    }
    args.update(kwargs)
    with pytest.raises(HandleError, match=message):
        validate(**args)


def test_torch_share_cuda_handles_are_unwrapped_or_refused() -> None:
    assert raw_handle_from_torch(HANDLE) == HANDLE
    assert raw_handle_from_torch(b"\x01c" + HANDLE) == HANDLE
    with pytest.raises(UnexportableMemory, match="expandable_segments"):
        raw_handle_from_torch(b"\x01e" + b"\x00" * 80)
    with pytest.raises(HandleError, match="unknown PyTorch shareable handle"):
        raw_handle_from_torch(b"\x01x" + HANDLE)


def test_unexportable_memory_names_the_setting_to_change() -> None:
    assert expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments_enabled(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:true"}
    )
    assert not expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_enabled({})
    msg = unexportable_message({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, where="cuda:0")
    assert "PYTORCH_ALLOC_CONF" in msg and "expandable_segments:False" in msg and "cuda:0" in msg
    vmm = unexportable_message({})
    assert "sleep mode" in vmm and "enable_sleep_mode" in vmm and "cuMemCreate" in vmm


# -- DMA descriptors -------------------------------------------------------------------


def test_descriptors_follow_the_runs_in_both_directions() -> None:
    runs = [(0, 0, 4096, 100), (1, 50, 0, 10)]
    store = plan_descriptors(STORE, runs, [1_000_000, 2_000_000], 9_000_000)
    assert len(store) == 1
    assert store[0].descriptors() == [
        (9_004_096, 1_000_000, 100),  # (dst, src, size): GPU -> pool
        (9_000_000, 2_000_050, 10),
    ]
    assert store[0].nbytes == 110
    load = plan_descriptors(LOAD, runs, [1_000_000, 2_000_000], 9_000_000)
    assert load[0].descriptors() == [(1_000_000, 9_004_096, 100), (2_000_050, 9_000_000, 10)]


def test_batches_split_at_max_batch_and_keep_order() -> None:
    runs = [(0, i * 64, i * 64, 64) for i in range(10)]
    batches = plan_descriptors(STORE, runs, [0], 1 << 20, max_batch=4)
    assert [len(b) for b in batches] == [4, 4, 2]
    flat = [d for b in batches for d in b.descriptors()]
    assert flat == [((1 << 20) + i * 64, i * 64, 64) for i in range(10)]
    assert all(isinstance(b.sizes, array) and b.sizes.typecode == "Q" for b in batches)


def test_runs_are_cut_at_page_locking_chunk_boundaries() -> None:
    # A run of 300 bytes from pool offset 900 crosses the 1024 boundary once; one
    # of 3000 bytes from 1000 crosses 1024, 2048 and 3072.
    batches = plan_descriptors(
        LOAD, [(0, 0, 900, 300), (0, 5000, 1000, 3000)], [10_000], 0, host_split=1024
    )
    d = batches[0].descriptors()
    assert d == [
        (10_000, 900, 124),
        (10_124, 1024, 176),
        (15_000, 1000, 24),
        (15_024, 1024, 1024),
        (16_048, 2048, 1024),
        (17_072, 3072, 928),
    ]
    assert sum(s for _, _, s in d) == 3300


def test_descriptor_planning_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="direction"):
        plan_descriptors(0, [], [], 0)
    with pytest.raises(ValueError, match="names region 2"):
        plan_descriptors(STORE, [(2, 0, 0, 8)], [0, 0], 0)
    with pytest.raises(ValueError, match="bad run"):
        plan_descriptors(STORE, [(0, 0, 0, 0)], [0], 0)
    with pytest.raises(ValueError, match="max_batch"):
        plan_descriptors(STORE, [], [0], 0, max_batch=0)
    assert plan_descriptors(STORE, [], [0], 0) == []


def vllm_geometry(
    num_blocks: int, layers: int = 32, page: int = 64 << 10, bpc: int = 1, world: int = 1
) -> tuple[NamespaceLayout, MemoryMap, int]:
    """vLLM's canonical layout: one region, each layer a (num_blocks, page) tensor in it."""
    lay = NamespaceLayout("vllm", world, bpc, ((page,) * layers,))
    tensors = [TensorView(0, i * num_blocks * page, num_blocks, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    size = layers * num_blocks * page
    return lay, MemoryMap.build(lay, [size], tensors, refs), size


def apply(batches: list[DmaBatch]) -> None:
    for b in batches:
        for dst, src, n in b.descriptors():
            ctypes.memmove(dst, src, n)


@pytest.mark.parametrize(("bpc", "world", "rank"), [(1, 1, 0), (4, 2, 1)])
def test_descriptors_move_exactly_the_bytes_the_cpu_engine_moves(
    bpc: int, world: int, rank: int
) -> None:
    """The same plan through the CPU engine and through DMA descriptors (applied with
    memmove) leaves identical pools and identical GPU-side memory."""
    nb = 24
    lay, mem, size = vllm_geometry(nb, layers=6, page=4096, bpc=bpc, world=world)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    block_ids = [5, 6, 7, 2, 9, 10, 11, 12, 20, 3]
    chunks = lay.chunks_per_group([len(block_ids)], [3])[0]
    slot = lay.slot_bytes(0)
    offsets: list[int | None] = [(k * 2 + 1) * slot for k in range(chunks)]  # gaps between
    plan = plan_job(lay, rank, mem, block_ids, [len(block_ids)], [3], offsets)
    pool_a = np.zeros((2 * chunks + 2) * slot, np.uint8)
    pool_b = pool_a.copy()
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool_a.ctypes.data, plan)
    apply(
        plan_descriptors(
            STORE,
            plan.runs,
            [src.ctypes.data],
            pool_b.ctypes.data,
            max_batch=7,
            host_split=3 * 4096,
        )
    )
    assert pool_a.any() and np.array_equal(pool_a, pool_b)
    # Load into other blocks: both ways agree, and the pages equal the stored ones.
    load_ids = [b + 1 for b in block_ids]
    lplan = plan_job(lay, rank, mem, load_ids, [len(load_ids)], [3], offsets)
    dst_a, dst_b = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    CpuCopyEngine().copy(LOAD, [ArrayRegion(dst_a)], pool_a.ctypes.data, lplan)
    apply(
        plan_descriptors(
            LOAD, lplan.runs, [dst_b.ctypes.data], pool_b.ctypes.data, max_batch=5, host_split=4096
        )
    )
    assert np.array_equal(dst_a, dst_b)
    for t in mem.tensors:
        for s, d in zip(block_ids, load_ids, strict=True):
            a = t.region_offset + s * t.block_stride
            b = t.region_offset + d * t.block_stride
            assert np.array_equal(src[a : a + t.page_bytes], dst_b[b : b + t.page_bytes])


def test_vllm_pages_of_one_block_are_32_descriptors_of_64k() -> None:
    """32 layers x 64 KiB: a 2 MiB block is 32 scattered GPU pages, one pool run each."""
    lay, mem, _ = vllm_geometry(64)
    plan = plan_job(lay, 0, mem, [3], [1], [0], [0])
    batches = plan_descriptors(STORE, plan.runs, [1 << 40], 1 << 32)
    (b,) = batches
    assert len(b) == 32 and set(b.sizes) == {64 << 10} and b.nbytes == 2 << 20
    assert sorted(b.dsts) == [(1 << 32) + i * (64 << 10) for i in range(32)]
    # 64 consecutive blocks, one chunk each: still 32 pages per block (pool rows are
    # layer-major per chunk, so a layer's pages of adjacent chunks are not adjacent).
    ids = list(range(64))
    plan = plan_job(lay, 0, mem, ids, [64], [0], [i * (2 << 20) for i in range(64)])
    batches = plan_descriptors(STORE, plan.runs, [1 << 40], 1 << 32, max_batch=1024)
    assert [len(b) for b in batches] == [1024, 1024]


# -- a fake CUDA driver: "device memory" is host memory ---------------------------------


class FakeDriver:
    """Implements the CudaDriver methods the engine and pinner use, on host memory."""

    def __init__(self, devices: list[DeviceInfo] | None = None, has_batch: bool = True) -> None:
        self.device_list = devices or [DeviceInfo(0, parse_uuid(UUID0), "Fake H200")]
        self.has_batch = has_batch
        self.batch_abi = 2 if has_batch else 0
        self.exports: dict[bytes, Any] = {}  # handle -> ctypes buffer (the "allocation")
        self.open_counts: dict[int, int] = {}  # mapped base -> refs
        self.opened_events: dict[int, bytes] = {}
        self.contexts: list[int] = []  # ordinals whose primary context was created
        self.current = threading.local()
        self.log: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}  # host ptr -> size
        self.fail_batch: CudaError | None = None
        self.fail_memcpy: CudaError | None = None
        self.fail_register_after: int | None = None
        self.fail_open: CudaError | None = None
        self.copy_gate: threading.Event | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # exporting side (what the worker would do)
    def export(self, size: int) -> tuple[bytes, Any]:
        buf = (ctypes.c_char * size)()
        handle = hashlib.sha256(b"h%d" % next(self._ids)).digest() * 2
        self.exports[handle] = buf
        return handle, buf

    def devices(self) -> list[DeviceInfo]:
        return list(self.device_list)

    def version(self) -> int:
        return 13000

    def primary_context(self, ordinal: int) -> int:
        if ordinal not in self.contexts:
            self.contexts.append(ordinal)
        return 1000 + ordinal

    def set_current(self, ctx: int) -> None:
        self.current.ctx = ctx

    def _need_ctx(self) -> None:
        assert getattr(self.current, "ctx", None), "no current context on this thread"

    def ipc_open_mem(self, handle: bytes) -> int:
        self._need_ctx()
        if self.fail_open is not None:
            raise self.fail_open
        buf = self.exports.get(handle)
        if buf is None:
            raise CudaError(
                "cuIpcOpenMemHandle",
                CUDA_ERROR_INVALID_HANDLE,
                "CUDA_ERROR_INVALID_HANDLE",
                "invalid resource handle",
            )
        base = ctypes.addressof(buf)
        with self._lock:
            self.open_counts[base] = self.open_counts.get(base, 0) + 1
        self.log.append(("open", base))
        return base

    def ipc_close_mem(self, ptr: int) -> None:
        self._need_ctx()
        with self._lock:
            self.open_counts[ptr] -= 1
            if self.open_counts[ptr] == 0:
                del self.open_counts[ptr]
        self.log.append(("close", ptr))

    def address_range(self, ptr: int) -> tuple[int, int]:
        for buf in self.exports.values():
            base = ctypes.addressof(buf)
            if base <= ptr < base + ctypes.sizeof(buf):
                return base, ctypes.sizeof(buf)
        raise CudaError(
            "cuMemGetAddressRange",
            CUDA_ERROR_INVALID_VALUE,
            "CUDA_ERROR_INVALID_VALUE",
            "invalid argument",
        )

    def ipc_open_event(self, handle: bytes) -> int:
        self._need_ctx()
        ev = next(self._ids) + 5000
        self.opened_events[ev] = handle
        return ev

    def event_destroy(self, event: int) -> None:
        del self.opened_events[event]

    def host_register(self, ptr: int, size: int, flags: int = 1) -> None:
        self._need_ctx()
        if self.fail_register_after is not None and len(self.registered) >= (
            self.fail_register_after
        ):
            raise CudaError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
        self.registered[ptr] = size

    def host_unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def stream_create(self) -> int:
        self._need_ctx()
        return next(self._ids) + 9000

    def stream_destroy(self, stream: int) -> None:
        self.log.append(("destroy", stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        assert event in self.opened_events
        self.log.append(("wait", stream, event))

    def stream_synchronize(self, stream: int) -> None:
        self.log.append(("sync", stream))

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self._need_ctx()
        if self.fail_memcpy is not None:
            raise self.fail_memcpy
        if self.copy_gate is not None:
            self.copy_gate.wait(10)
        ctypes.memmove(dst, src, n)
        self.log.append(("copy", stream, n))

    def memcpy_batch_async(self, dsts: array, srcs: array, sizes: array, stream: int) -> None:
        self._need_ctx()
        if self.fail_batch is not None:
            raise self.fail_batch
        if self.copy_gate is not None:
            self.copy_gate.wait(10)
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            ctypes.memmove(d, s, n)
        self.log.append(("batch", stream, len(sizes)))


def ipc_msg(
    handle: bytes, size: int, offset: int = 0, uuid: str = UUID0, event: bytes = EVENT
) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(
        ipc_handle=handle, device_uuid=uuid, offset=offset, size=size, event_handle=event
    )


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


# -- registration lifecycle through the real DepotState --------------------------------


def make_key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


@pytest.fixture
def state() -> Iterator[DepotState]:
    st = DepotState.create(
        ServeConfig(socket="/nonexistent/kvdepot.sock", pool_size=64 << 20, copy_threads=2)
    )
    yield st
    st.close()


def register_fake_engine(
    st: DepotState, drv: FakeDriver, nb: int = 16, layers: int = 8, page: int = 16384
) -> tuple[Any, Any, Any, NamespaceLayout, Any]:
    handle, buf = drv.export(layers * nb * page + 4096)
    session = st.open_session("fake-engine", 1234, "e0")
    lay = NamespaceLayout("cuda-ns", 1, 1, ((page,) * layers,))
    tensors = [TensorView(0, i * nb * page, nb, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    reg = st.register(
        session.id,
        lay,
        0,
        [("cuda_ipc", ipc_msg(handle, layers * nb * page, offset=4096))],
        tensors,
        refs,
    )
    return session, reg, buf, lay, tensors


def job(
    reg: Any, session: Any, jid: int, direction: int, keys: list[bytes], blocks: list[int]
) -> JobSpec:
    return JobSpec(jid, direction, reg.id, keys, blocks, [len(blocks)], [0], False, session.id)


def test_depot_state_stores_and_loads_every_byte_through_the_cuda_engine(
    state: DepotState,
) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={})
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


def test_a_session_closed_mid_copy_unmaps_only_after_the_copy(state: DepotState) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={})
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
    state: DepotState,
) -> None:
    drv = FakeDriver()
    assert enable_cuda(state, state.arena, driver=drv, env={})
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


# -- enabling CUDA --------------------------------------------------------------------------


def test_cuda_is_unavailable_here_and_says_why() -> None:
    # This suite runs on CPU machines; on a GPU host this test has nothing to prove.
    if cuda_available():
        pytest.skip("a CUDA driver and device are present")
    reason = unavailable_reason()
    assert reason and ("libcuda" in reason or "device" in reason)
    with pytest.raises(CudaUnavailable):
        cuda_driver.load()
    with pytest.raises(CudaUnavailable, match="no CUDA driver library"):
        cuda_driver.load("/nonexistent/libcuda.so.1")


def test_enabling_cuda_without_cuda_leaves_the_cpu_path(
    state: DepotState, caplog: pytest.LogCaptureFixture
) -> None:
    if cuda_available():
        pytest.skip("a CUDA driver and device are present")
    with caplog.at_level(logging.INFO, logger="kvdepot.cuda"):
        assert enable_cuda(state, state.arena) is False
    assert "CUDA is off" in caplog.text
    assert cuda_path(state) is None
    session = state.open_session("x", 1, "")
    lay = NamespaceLayout("ns", 1, 1, ((4096,),))
    with pytest.raises(errors.DepotError) as exc:
        state.register(
            session.id,
            lay,
            0,
            [("cuda_ipc", ipc_msg(HANDLE, 4096))],
            [TensorView(0, 0, 1, 4096, 4096)],
            [[LayerRef(0, 0, 4096)]],
        )
    assert exc.value.code.name == "INVALID_ARGUMENT" and "not available" in exc.value.message
    # The shared-memory path still has its CPU engine.
    assert isinstance(state.cpu_engine, CpuCopyEngine)


def test_device_selection() -> None:
    devs = [DeviceInfo(0, parse_uuid(UUID0), "a"), DeviceInfo(1, parse_uuid(UUID1), "b")]
    assert select_devices(devs, None) == devs and select_devices(devs, "all") == devs
    assert select_devices(devs, "none") == []
    assert select_devices(devs, "1") == [devs[1]]
    assert select_devices(devs, UUID1.upper() + ", 0, " + UUID0[4:]) == [devs[1], devs[0]]
    with pytest.raises(ValueError, match="no visible device matches '7'"):
        select_devices(devs, "7")
    with pytest.raises(ValueError, match="neither a device UUID"):
        select_devices(devs, "GPU-zz")


def test_only_served_devices_get_a_context(state: DepotState) -> None:
    devs = [DeviceInfo(0, parse_uuid(UUID0), "a"), DeviceInfo(1, parse_uuid(UUID1), "b")]
    drv = FakeDriver(devs)
    assert enable_cuda(state, state.arena, driver=drv, env={"KVDEPOT_CUDA_DEVICES": UUID1})
    assert drv.contexts == [1]  # the pinning context, on the served device only
    handle, _ = drv.export(8192)
    with pytest.raises(errors.DepotError) as exc:
        state.register(
            state.open_session("x", 1, "").id,
            NamespaceLayout("n", 1, 1, ((8192,),)),
            0,
            [("cuda_ipc", ipc_msg(handle, 8192))],
            [TensorView(0, 0, 1, 8192, 8192)],
            [[LayerRef(0, 0, 8192)]],
        )
    assert exc.value.code.name == "FAILED_PRECONDITION"
    assert drv.contexts == [1]
    assert enable_cuda(state, state.arena, driver=drv, env={})  # once per pool
    assert len(drv.contexts) == 1


@pytest.mark.parametrize("spec", ["none", "5", "GPU-nonsense"])
def test_cuda_stays_off_when_no_device_is_selected(spec: str) -> None:
    from types import SimpleNamespace

    added: list[object] = []
    st = SimpleNamespace(
        memory_path=lambda kind: None, add_memory_path=lambda kind, opener: added.append(kind)
    )
    arena = SimpleNamespace(address=0, size=1 << 20, warmup_done_bytes=0)
    drv = FakeDriver([DeviceInfo(0, parse_uuid(UUID0), "a")])
    assert not enable_cuda(st, arena, driver=drv, env={"KVDEPOT_CUDA_DEVICES": spec})
    assert added == [] and drv.contexts == []


# -- page-locking the pool ------------------------------------------------------------------


class FakeDevice:
    def __init__(self, drv: FakeDriver) -> None:
        self.drv = drv

    def make_current(self) -> None:
        self.drv.set_current(1000)


def test_pinner_registers_chunks_and_unregisters_them_at_close() -> None:
    drv = FakeDriver()
    p = PoolPinner(drv, FakeDevice(drv), base=1 << 30, size=10 << 20)
    for off in range(0, 10 << 20, 4 << 20):
        p.after_chunk(off, min(4 << 20, (10 << 20) - off))
    assert p.complete and p.split_bytes == 4 << 20
    assert drv.registered == {
        (1 << 30): 4 << 20,
        (1 << 30) + (4 << 20): 4 << 20,
        (1 << 30) + (8 << 20): 2 << 20,
    }
    p.close()
    p.close()
    assert drv.registered == {}
    p.after_chunk(0, 4096)  # after close: ignored
    assert drv.registered == {}


def test_pinner_stops_at_the_first_failure_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drv = FakeDriver()
    drv.fail_register_after = 2
    p = PoolPinner(drv, FakeDevice(drv), base=0, size=8 << 20)
    with caplog.at_level(logging.WARNING, logger="kvdepot.cuda"):
        for off in range(0, 8 << 20, 2 << 20):
            p.after_chunk(off, 2 << 20)
    assert p.pinned_bytes == 4 << 20 and p.failed and not p.complete
    assert "LimitMEMLOCK" in caplog.text
    assert len(drv.registered) == 2
    p.close()
    assert drv.registered == {}


def test_pinner_counts_memory_someone_else_registered_but_leaves_it_alone() -> None:
    class Already(FakeDriver):
        def host_register(self, ptr: int, size: int, flags: int = 1) -> None:
            raise CudaError(
                "cuMemHostRegister",
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                "already registered",
            )

    drv = Already()
    p = PoolPinner(drv, FakeDevice(drv), base=0, size=4096)
    p.after_chunk(0, 4096)
    assert p.complete and p.failed is None
    p.close()  # nothing of ours to unregister


def test_the_arena_warmup_hook_page_locks_the_whole_pool(state: DepotState) -> None:
    drv = FakeDriver()
    arena = state.arena
    assert enable_cuda(state, arena, driver=drv, env={})
    path = cuda_path(state)
    assert path is not None
    arena.start_warmup(chunk_bytes=8 << 20)  # enable_cuda added the page-locking hook
    assert arena.wait_warmup(30)
    assert sum(drv.registered.values()) == arena.size
    assert min(drv.registered) == arena.address
    assert path.engine.host_split() == 8 << 20
    arena.close()  # its close hook unregisters before unmapping, destroys the streams
    assert drv.registered == {}


def test_enabling_after_the_warmup_began_follows_it(state: DepotState) -> None:
    arena = state.arena
    arena.start_warmup(chunk_bytes=8 << 20)
    assert arena.wait_warmup(30)
    drv = FakeDriver()
    assert enable_cuda(state, arena, driver=drv, env={})
    deadline = threading.Event()
    for _ in range(200):
        if sum(drv.registered.values()) == arena.size:
            break
        deadline.wait(0.02)
    assert sum(drv.registered.values()) == arena.size


# -- the client side, without CUDA ----------------------------------------------------------


def test_client_module_imports_without_cuda_and_groups_tensors_into_regions() -> None:
    from kvdepot.client import cuda_ipc

    ps = [cuda_ipc.TensorPlacement(0x10000 + i * 0x1000, 4, 0x400, 0x400) for i in range(3)]
    allocs = [(0x10000, 0x10000)] * 3
    regions, tensors = cuda_ipc.group_regions(ps, allocs)
    assert regions == [(0x10000, 0, 0x2000 + 3 * 0x400 + 0x400)]
    assert [t.region_offset for t in tensors] == [0, 0x1000, 0x2000]
    assert all(t.region_index == 0 and t.block_stride_bytes == 0x400 for t in tensors)
    # Two allocations: two regions, offsets relative to each region's first byte.
    ps2 = [cuda_ipc.TensorPlacement(0x50000 + 0x800, 2, 0x100, 0x80)]
    regions, tensors = cuda_ipc.group_regions([*ps, *ps2], [*allocs, (0x50000, 0x1000)])
    assert regions[1] == (0x50000, 0x800, 0x180) and tensors[3].region_index == 1
    assert tensors[3].region_offset == 0
    with pytest.raises(ValueError, match="leave their allocation"):
        cuda_ipc.group_regions(ps2, [(0x50000, 0x100)])


def test_tensor_placement_reads_vllm_canonical_views() -> None:
    torch = pytest.importorskip("torch")
    from kvdepot.client.cuda_ipc import tensor_placement

    backing = torch.zeros(4 * 8 * 1024, dtype=torch.int8)
    layer = backing.view(4, 8, 1024)[:, 2]  # block stride 8 KiB, page 1 KiB
    p = tensor_placement(layer)
    assert (p.num_blocks, p.block_stride, p.page_bytes) == (4, 8192, 1024)
    assert p.ptr == backing.data_ptr() + 2048 and p.end == p.ptr + 3 * 8192 + 1024
    with pytest.raises(ValueError, match="2-D"):
        tensor_placement(backing)
    with pytest.raises(ValueError, match="contiguous"):
        tensor_placement(backing.view(4, 8192)[:, ::2])


# -- the real ctypes bindings, against a fake libcuda built from the real cuda.h ------------
#
# The fake implements each driver entry point with the prototype from cuda.h (the
# compiler checks it, and cuda.h's macros give the symbols their versioned names,
# e.g. cuMemHostRegister -> cuMemHostRegister_v2, as the real driver exports them).
# "Device memory" is host memory; calls that need a current context fail without
# one, as the real driver's do. It proves the marshalling (argument order and
# types, structs by value, the batch ABI), not the GPU.

FAKE_LIBCUDA_C = r"""
#include <cuda.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 256
#define OK return CUDA_SUCCESS
#define NEED_CTX if (!current) return CUDA_ERROR_INVALID_CONTEXT
static struct { CUdeviceptr base; size_t size; int vmm; int opened; } allocs[MAXN];
static struct { void *p; size_t n; } regs[MAXN];
static __thread CUcontext current;
static long n_batch, n_batch_copies, n_memcpy, n_waits, n_sync, n_events, n_streams, n_ctx;
static int init_rc;
static char CTX0;

long fake_count(const char *w) {
  long k = 0;
  if (!strcmp(w, "batch")) return n_batch;
  if (!strcmp(w, "batch_copies")) return n_batch_copies;
  if (!strcmp(w, "memcpy")) return n_memcpy;
  if (!strcmp(w, "waits")) return n_waits;
  if (!strcmp(w, "sync")) return n_sync;
  if (!strcmp(w, "events")) return n_events;
  if (!strcmp(w, "streams")) return n_streams;
  if (!strcmp(w, "contexts")) return n_ctx;
  if (!strcmp(w, "opened")) { for (int i = 0; i < MAXN; i++) k += allocs[i].opened; return k; }
  if (!strcmp(w, "hostregs")) { for (int i = 0; i < MAXN; i++) k += regs[i].p != 0; return k; }
  return -1;
}
void fake_set_init_rc(int rc) { init_rc = rc; }
CUdeviceptr fake_alloc(size_t size, int vmm) {
  for (int i = 0; i < MAXN; i++) {
    if (allocs[i].base) continue;
    allocs[i].base = (CUdeviceptr)(size_t)calloc(1, size);
    allocs[i].size = size;
    allocs[i].vmm = vmm;
    return allocs[i].base;
  }
  return 0;
}
static int find(CUdeviceptr p) {
  for (int i = 0; i < MAXN; i++)
    if (allocs[i].base && allocs[i].base <= p && p < allocs[i].base + allocs[i].size) return i;
  return -1;
}

CUresult CUDAAPI cuInit(unsigned int f) {
  return f ? CUDA_ERROR_INVALID_VALUE : (CUresult)init_rc;
}
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = 13000; OK; }
CUresult CUDAAPI cuGetErrorName(CUresult e, const char **s) {
  switch (e) {
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      *s = "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN";
  }
  OK;
}
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "fake error"; OK; }
CUresult CUDAAPI cuDeviceGetCount(int *n) { *n = 1; OK; }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int o) {
  if (o != 0) return CUDA_ERROR_INVALID_DEVICE;
  *d = 0; OK;
}
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d; strncpy(name, "Fake H200", len); OK;
}
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *u, CUdevice d) {
  (void)d;
  for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xa0 + i);
  OK;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  (void)d; n_ctx++; *c = (CUcontext)&CTX0; OK;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice d) { (void)d; n_ctx--; OK; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { current = c; OK; }
CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0 || allocs[i].base != p || allocs[i].vmm) return CUDA_ERROR_INVALID_VALUE;
  memset(h, 0, sizeof *h);
  memcpy(h->reserved, "FAKEIPC", 8);
  memcpy(h->reserved + 8, &p, 8);
  OK;
}
CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *out, CUipcMemHandle h, unsigned int flags) {
  CUdeviceptr p;
  NEED_CTX;
  if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) return CUDA_ERROR_INVALID_VALUE;
  if (memcmp(h.reserved, "FAKEIPC", 8)) return CUDA_ERROR_INVALID_HANDLE;
  memcpy(&p, h.reserved + 8, 8);
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_HANDLE;
  allocs[i].opened++;
  *out = p;
  OK;
}
CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0 || !allocs[i].opened) return CUDA_ERROR_INVALID_VALUE;
  allocs[i].opened--;
  OK;
}
CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h) {
  NEED_CTX;
  if (memcmp(h.reserved, "FAKEEVT", 8)) return CUDA_ERROR_INVALID_HANDLE;
  *e = (CUevent)malloc(1); n_events++; OK;
}
CUresult CUDAAPI cuEventDestroy(CUevent e) { free(e); n_events--; OK; }
CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *b, size_t *s, CUdeviceptr p) {
  NEED_CTX;
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  *b = allocs[i].base; *s = allocs[i].size; OK;
}
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) {
  int i = find(p);
  if (i < 0) return CUDA_ERROR_INVALID_VALUE;
  switch (a) {
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = allocs[i].base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = allocs[i].size; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE: *(int *)data = !allocs[i].vmm; break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  OK;
}
CUresult CUDAAPI cuMemHostRegister(void *p, size_t n, unsigned int flags) {
  NEED_CTX;
  if (flags != CU_MEMHOSTREGISTER_PORTABLE || !n) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < MAXN; i++)
    if (regs[i].p == p) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  for (int i = 0; i < MAXN; i++)
    if (!regs[i].p) { regs[i].p = p; regs[i].n = n; OK; }
  return CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemHostUnregister(void *p) {
  NEED_CTX;
  for (int i = 0; i < MAXN; i++)
    if (regs[i].p == p) { regs[i].p = 0; OK; }
  return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
}
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int flags) {
  NEED_CTX;
  if (flags != CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
  *s = (CUstream)malloc(1); n_streams++; OK;
}
CUresult CUDAAPI cuStreamDestroy(CUstream s) { free(s); n_streams--; OK; }
CUresult CUDAAPI cuStreamWaitEvent(CUstream s, CUevent e, unsigned int f) {
  NEED_CTX;
  if (!s || !e || f) return CUDA_ERROR_INVALID_VALUE;
  n_waits++; OK;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
  NEED_CTX;
  if (!s) return CUDA_ERROR_INVALID_VALUE;
  n_sync++; OK;
}
CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
  NEED_CTX;
  if (!st) return CUDA_ERROR_INVALID_VALUE;
  memcpy((void *)(size_t)d, (void *)(size_t)s, n);
  n_memcpy++; OK;
}
CUresult CUDAAPI cuMemcpyBatchAsync(CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t count,
                                    CUmemcpyAttributes *attrs, size_t *idx, size_t nattrs,
                                    CUstream st) {
  NEED_CTX;
  if (!st || !count || nattrs != 1 || idx[0] != 0) return CUDA_ERROR_INVALID_VALUE;
  if (attrs[0].srcAccessOrder != CU_MEMCPY_SRC_ACCESS_ORDER_STREAM || attrs[0].flags)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; i++) memcpy((void *)(size_t)d[i], (void *)(size_t)s[i], n[i]);
  n_batch++; n_batch_copies += count; OK;
}
"""


def _cuda_include() -> str | None:
    import glob
    import os
    import sys

    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    candidates += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    for sp in sys.path:
        candidates += glob.glob(os.path.join(sp, "nvidia", "cu1*", "include"))
        candidates += glob.glob(os.path.join(sp, "nvidia", "cuda_runtime", "include"))
    for c in candidates:
        if os.path.exists(os.path.join(c, "cuda.h")):
            with open(os.path.join(c, "cuda.h"), errors="replace") as f:
                if "cuMemcpyBatchAsync_v2" in f.read():  # the CUDA 13 header
                    return c
    return None


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    include = _cuda_include()
    if cc is None or include is None:
        pytest.skip("needs a C compiler and CUDA 13's cuda.h to build the fake driver")
    d = tmp_path_factory.mktemp("fakecuda")
    src, lib = d / "fake_libcuda.c", d / "libcuda.so.1"
    src.write_text(FAKE_LIBCUDA_C)
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Werror",
            f"-I{include}",
            "-o",
            str(lib),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    return str(lib)


def test_real_bindings_marshal_every_call_right(fake_libcuda: str) -> None:
    drv = cuda_driver.load(fake_libcuda)
    fake = ctypes.CDLL(fake_libcuda)
    fake.fake_alloc.restype = ctypes.c_uint64
    fake.fake_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    fake.fake_count.restype = ctypes.c_long
    fake.fake_count.argtypes = [ctypes.c_char_p]
    assert drv.batch_abi == 2 and drv.has_batch and drv.version() == 13000
    (dev,) = drv.devices()
    assert dev.ordinal == 0 and dev.name == "Fake H200"
    assert dev.uuid == bytes(range(0xA0, 0xB0))
    assert fake.fake_count(b"contexts") == 0  # listing devices creates no context
    base = fake.fake_alloc(1 << 20, 0)
    with pytest.raises(CudaError) as exc:  # no current context yet
        drv.ipc_get_mem_handle(base)
    assert exc.value.name == "CUDA_ERROR_INVALID_CONTEXT" and "fake error" in str(exc.value)
    drv.set_current(drv.primary_context(0))
    assert drv.primary_context(0) == drv.primary_context(0) and fake.fake_count(b"contexts") == 1
    # Pointer attributes of various widths read right through the 64-bit buffer.
    inner = base + 4096
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) == base
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_RANGE_SIZE) == 1 << 20
    assert drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) == 0
    assert (
        drv.pointer_attribute(inner, cuda_driver.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
        == 1
    )
    vmm = fake.fake_alloc(4096, 1)
    assert (
        drv.pointer_attribute(vmm, cuda_driver.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE) == 0
    )
    # IPC: the handle goes by value both ways.
    handle = drv.ipc_get_mem_handle(base)
    assert len(handle) == 64 and handle.startswith(b"FAKEIPC")
    ptr = drv.ipc_open_mem(handle)
    assert ptr == base and drv.address_range(ptr + 100) == (base, 1 << 20)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_HANDLE"):
        drv.ipc_open_mem(b"\x01" * 64)
    ev = drv.ipc_open_event(b"FAKEEVT\x00" + b"\x00" * 56)
    assert ev and fake.fake_count(b"events") == 1
    stream = drv.stream_create()
    drv.stream_wait_event(stream, ev)
    # Copies: one by one, and batched (the CUDA 13 ABI, one attribute record).
    host = (ctypes.c_char * 8192)()
    ctypes.memmove(base, b"\x11" * 4096 + b"\x22" * 4096, 8192)
    drv.memcpy_async(ctypes.addressof(host), base, 4096, stream)
    dsts = array("Q", [ctypes.addressof(host) + 4096, ctypes.addressof(host) + 6144])
    srcs = array("Q", [base + 4096, base + 6144])
    drv.memcpy_batch_async(dsts, srcs, array("Q", [2048, 2048]), stream)
    drv.stream_synchronize(stream)
    assert host.raw == b"\x11" * 4096 + b"\x22" * 4096
    assert fake.fake_count(b"batch") == 1 and fake.fake_count(b"batch_copies") == 2
    assert fake.fake_count(b"memcpy") == 1 and fake.fake_count(b"waits") == 1
    # Host registration.
    drv.host_register(ctypes.addressof(host), 8192)
    with pytest.raises(CudaError) as exc:
        drv.host_register(ctypes.addressof(host), 8192)
    assert exc.value.code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    drv.host_unregister(ctypes.addressof(host))
    with pytest.raises(CudaError, match="NOT_REGISTERED"):
        drv.host_unregister(ctypes.addressof(host))
    drv.event_destroy(ev)
    drv.ipc_close_mem(ptr)
    drv.stream_destroy(stream)
    assert fake.fake_count(b"opened") == 0 and fake.fake_count(b"events") == 0
    drv.release_contexts()
    assert fake.fake_count(b"contexts") == 0


def test_a_driver_that_fails_cuinit_reads_as_unavailable(fake_libcuda: str) -> None:
    fake = ctypes.CDLL(fake_libcuda)
    fake.fake_set_init_rc(cuda_driver.CUDA_ERROR_STUB_LIBRARY)
    try:
        with pytest.raises(CudaUnavailable, match="stub"):
            cuda_driver.load(fake_libcuda)
        fake.fake_set_init_rc(cuda_driver.CUDA_ERROR_NO_DEVICE)
        with pytest.raises(CudaUnavailable, match="no device"):
            cuda_driver.load(fake_libcuda)
    finally:
        fake.fake_set_init_rc(0)


def test_depot_state_end_to_end_through_the_real_bindings(
    fake_libcuda: str, state: DepotState
) -> None:
    """enable_cuda + register + store + load + session end + pool pinning, with the
    real CudaDriver on the fake libcuda: every ctypes path the daemon takes."""
    drv = cuda_driver.load(fake_libcuda)
    fake = ctypes.CDLL(fake_libcuda)
    fake.fake_alloc.restype = ctypes.c_uint64
    fake.fake_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int]
    fake.fake_count.restype = ctypes.c_long
    fake.fake_count.argtypes = [ctypes.c_char_p]
    assert enable_cuda(state, state.arena, driver=drv, env={})
    state.arena.start_warmup(chunk_bytes=16 << 20)
    assert state.arena.wait_warmup(30)
    assert fake.fake_count(b"hostregs") == 4  # 64 MiB in 16 MiB chunks
    nb, layers, page = 16, 32, 4096
    size = nb * layers * page
    base = fake.fake_alloc(size + 65536, 0)
    rng = np.random.default_rng(3)
    ctypes.memmove(base + 65536, rng.bytes(size), size)
    drv.set_current(drv.primary_context(0))
    handle = drv.ipc_get_mem_handle(base)
    session = state.open_session("engine", 1, "")
    lay = NamespaceLayout("real", 1, 1, ((page,) * layers,))
    tensors = [TensorView(0, i * nb * page, nb, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    reg = state.register(
        session.id,
        lay,
        0,
        [
            (
                "cuda_ipc",
                ipc_msg(
                    handle,
                    size,
                    offset=65536,
                    uuid=format_uuid(bytes(range(160, 176))),
                    event=b"FAKEEVT" + b"\x00" * 57,
                ),
            )
        ],
        tensors,
        refs,
    )
    keys = [make_key(100 + i) for i in range(4)]
    batches, waits = fake.fake_count(b"batch"), fake.fake_count(b"waits")

    async def run() -> None:
        out = await state.run_job(job(reg, session, 1, STORE, keys, [0, 1, 2, 3]))
        assert out.success and out.bytes == 4 * layers * page, out
        out = await state.run_job(job(reg, session, 2, LOAD, keys, [8, 9, 10, 11]))
        assert out.success, out

    asyncio.run(run())
    gpu = ctypes.string_at(base + 65536, size)
    for t in tensors:
        for s, d in zip([0, 1, 2, 3], [8, 9, 10, 11], strict=True):
            a, b = t.region_offset + s * page, t.region_offset + d * page
            assert gpu[a : a + page] == gpu[b : b + page]
    assert fake.fake_count(b"batch") == batches + 2  # one batch per job (128 pages each)
    assert fake.fake_count(b"waits") == waits + 2  # the event, before each job
    assert fake.fake_count(b"opened") == 1 and fake.fake_count(b"events") == 1
    state.close_session(session.id)
    assert fake.fake_count(b"opened") == 0 and fake.fake_count(b"events") == 0
    state.close()  # copy threads, regions, then the wrapped arena close: unregister
    assert fake.fake_count(b"hostregs") == 0 and fake.fake_count(b"streams") == 0


def test_a_daemon_process_turns_cuda_on_and_refuses_bad_handles_over_grpc(
    fake_libcuda: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A real daemon process (tests/gpu/serve_cuda.py, i.e. `kvdepot serve` with CUDA
    wired in) on the fake driver: CUDA on, the pool page-locked during warm-up, bad
    handles refused with status codes, and the pool unregistered at shutdown."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import grpc

    from kvdepot.client import DepotClient
    from kvdepot.v1 import admin_pb2, admin_pb2_grpc

    work = tmp_path_factory.mktemp("kvdcuda")
    sock, log_path = str(work / "k.sock"), work / "daemon.log"
    serve = Path(__file__).parent / "gpu" / "serve_cuda.py"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(serve), "serve", "--socket", sock, "--pool-size", "64MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVDEPOT_LIBCUDA": fake_libcuda},
        )
    client = DepotClient(f"unix://{sock}").start()
    try:
        assert client.wait_connected(30), log_path.read_text()
        admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"unix://{sock}"))
        for _ in range(300):
            if admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5).warmup_complete:
                break
            time.sleep(0.05)
        text = log_path.read_text()
        assert "CUDA is on" in text and "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf" in text, text
        assert "pool page-locked: 64.0 MiB of 64.0 MiB (100%" in text, text
        fake_uuid = format_uuid(bytes(range(160, 176)))
        layout = pb.NamespaceLayout(
            id="n",
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[4096])],
        )
        for handle, code, words in [
            (ipc_msg(b"\x01" * 64, 4096, uuid=fake_uuid), "INVALID_ARGUMENT", "cannot open"),
            (ipc_msg(HANDLE, 4096, uuid=UUID1), "FAILED_PRECONDITION", "not served"),
            (ipc_msg(HANDLE[:60], 4096, uuid=fake_uuid), "INVALID_ARGUMENT", "60 bytes"),
        ]:
            with pytest.raises(grpc.RpcError) as exc:
                client.stub.RegisterKV(
                    pb.RegisterKVRequest(
                        session_id=client.session_id,
                        namespace=layout,
                        rank=0,
                        regions=[pb.MemoryRegion(cuda_ipc=handle)],
                        tensors=[
                            pb.KVTensor(
                                region_index=0,
                                num_blocks=1,
                                block_stride_bytes=4096,
                                page_bytes=4096,
                            )
                        ],
                        groups=[
                            pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])
                        ],
                    ),
                    timeout=10,
                )
            assert exc.value.code().name == code and words in exc.value.details()
        assert admin.GetStats(admin_pb2.GetStatsRequest(), timeout=5).registrations == 0
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0 and "pool unregistered from CUDA" in log_path.read_text()
