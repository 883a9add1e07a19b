"""DMA descriptor planning: runs in both directions, batches, page-locking chunk
boundaries, and the same bytes as the CPU copy engine moves.
"""

from __future__ import annotations

import ctypes
from array import array

import numpy as np
import pytest

from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.planner import LayerRef, MemoryMap, TensorView, plan_job
from kvdepot.server.cuda.dma import DmaBatch, plan_descriptors
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine
from tests.support.regions import ArrayRegion

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


def test_runs_are_cut_at_page_locking_chunk_boundaries(planner_impl: str) -> None:
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


def test_descriptor_planning_refuses_nonsense(planner_impl: str) -> None:
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
    bpc: int, world: int, rank: int, planner_impl: str
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
