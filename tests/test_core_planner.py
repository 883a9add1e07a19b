"""Layouts, copy planning and the CPU copy engine, checked byte for byte in-process."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_key
from kvdepot.server.core.planner import LayerRef, MemoryMap, TensorView, plan_job
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine
from tests.support.regions import ArrayRegion


def layout(world: int = 2, bpc: int = 2) -> NamespaceLayout:
    return NamespaceLayout("ns", world, bpc, ((4096, 4096), (1024, 1024, 1024)))


def memmap(lay: NamespaceLayout, num_blocks: int = 64) -> tuple[MemoryMap, int]:
    pages = [p for g in lay.groups for p in g]
    tensors, off = [], 0
    for p in pages:
        tensors.append(TensorView(0, off, num_blocks, p, p))
        off += num_blocks * p
    groups, t = [], 0
    for g in lay.groups:
        groups.append([LayerRef(t + i, 0, p) for i, p in enumerate(g)])
        t += len(g)
    return MemoryMap.build(lay, [off], tensors, groups), off


def test_slot_and_section_sizes() -> None:
    lay = layout()
    assert lay.section_bytes(0) == 2 * 8192 and lay.slot_bytes(0) == 2 * 2 * 8192
    assert lay.slot_bytes(1) == 2 * 2 * 3072
    # rank 1, layer 1, sub-block 1 of group 0: after rank 0's section, layer 0's pages.
    assert lay.page_offset(0, 1, 1, 1) == 16384 + 2 * 4096 + 4096


def test_chunk_counts_follow_block_indices() -> None:
    lay = layout(bpc=4)
    # 5 blocks starting at logical index 6: skip 2 -> chunks [6,7], [8..11] -> 2 keys
    assert lay.chunks_per_group([5, 0], [6, 0]) == [2, 0]
    assert lay.chunks_per_group([4, 8], [0, 4]) == [1, 2]
    with pytest.raises(LayoutError, match="group_sizes has 1"):
        lay.chunks_per_group([4], [0])


def test_bad_layouts_and_keys_are_refused_with_reasons() -> None:
    with pytest.raises(LayoutError, match="world_size"):
        NamespaceLayout("ns", 0, 1, ((16,),))
    with pytest.raises(LayoutError, match="groups"):
        NamespaceLayout("ns", 1, 1, ())
    with pytest.raises(LayoutError, match="page"):
        NamespaceLayout("ns", 1, 1, ((0,),))
    with pytest.raises(LayoutError, match="names group 7"):
        check_key(b"x" * 32 + (7).to_bytes(4, "big"), 2)
    with pytest.raises(LayoutError, match="4-byte"):
        check_key(b"abc", 2)


def test_memory_map_checks_page_sizes_and_bounds() -> None:
    lay = layout()
    with pytest.raises(LayoutError, match="namespace layout says 4096"):
        MemoryMap.build(lay, [1 << 20], [TensorView(0, 0, 8, 2048, 2048)] * 5,
                        [[LayerRef(0, 0, 2048)] * 2, [LayerRef(0, 0, 1024)] * 3])
    with pytest.raises(LayoutError, match="spans bytes"):
        MemoryMap.build(lay, [1000], [TensorView(0, 0, 8, 4096, 4096)],
                        [[LayerRef(0, 0, 4096)] * 2, [LayerRef(0, 0, 1024)] * 3])


def test_plan_merges_contiguous_pages_and_rejects_out_of_range_blocks() -> None:
    lay = layout(world=1, bpc=2)
    mm, _ = memmap(lay)
    # Group 0 only: blocks 10,11 (consecutive) -> one run per layer.
    plan = plan_job(lay, 0, mm, [10, 11], [2, 0], [0, 0], [0])
    assert len(plan.runs) == 2 and plan.nbytes == 2 * 2 * 4096
    with pytest.raises(LayoutError, match="out of range"):
        plan_job(lay, 0, mm, [10, 64], [2, 0], [0, 0], [0])
    with pytest.raises(LayoutError, match="describe 1 chunk"):
        plan_job(lay, 0, mm, [10, 11], [2, 0], [0, 0], [0, 8192])


@pytest.mark.parametrize("first_index", [0, 1, 3])
def test_store_then_load_round_trips_bytes_for_both_ranks(first_index: int) -> None:
    """Two ranks store into shared slots; loads into other blocks get each rank's bytes."""
    lay = layout(world=2, bpc=2)
    mm, size = memmap(lay)
    rng = np.random.default_rng(first_index)
    pool = np.zeros(1 << 20, np.uint8)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
    engine = CpuCopyEngine()
    n = 5  # blocks per group
    chunks = lay.chunks_per_group([n, n], [first_index, first_index])
    slot_offsets = []
    off = 0
    for g, c in enumerate(chunks):
        for _ in range(c):
            slot_offsets.append(off)
            off += lay.slot_bytes(g)
    src_blocks = list(range(7, 7 + n)) + list(range(20, 20 + n))
    dst_blocks = list(range(40, 40 + n)) + list(range(50, 50 + n))
    for rank in range(2):
        plan = plan_job(lay, rank, mm, src_blocks, [n, n], [first_index] * 2, slot_offsets)
        engine.copy(STORE, [ArrayRegion(src[rank])], pool.ctypes.data, plan)
    for rank in range(2):
        dst = np.zeros(size, np.uint8)
        plan = plan_job(lay, rank, mm, dst_blocks, [n, n], [first_index] * 2, slot_offsets)
        engine.copy(LOAD, [ArrayRegion(dst)], pool.ctypes.data, plan)
        for layer, t in enumerate(mm.tensors):
            g = 0 if layer < 2 else 1
            for s, d in zip(src_blocks[g * n:(g + 1) * n], dst_blocks[g * n:(g + 1) * n],
                            strict=True):
                a = src[rank][t.region_offset + s * t.block_stride:][: t.page_bytes]
                b = dst[t.region_offset + d * t.block_stride:][: t.page_bytes]
                assert np.array_equal(a, b), (rank, layer, s, d)


def test_skipped_keys_leave_their_slots_untouched() -> None:
    lay = layout(world=1, bpc=1)
    mm, size = memmap(lay)
    src = np.full(size, 7, np.uint8)
    pool = np.zeros(1 << 16, np.uint8)
    plan = plan_job(lay, 0, mm, [1, 2], [2, 0], [0, 0], [None, 0])
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool.ctypes.data, plan)
    assert plan.nbytes == 8192
    assert pool[:8192].min() == 7 and pool[8192:].max() == 0
