"""DMA descriptor planning: runs in both directions, batches, page-locking chunk
boundaries, and the same bytes as the CPU copy engine moves.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any

import numpy as np
import pytest

from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.core.planner import CopyPlan, plan_job, stride_period
from kvdepot.server.cuda.dma_plan import DmaBatch, DmaPlan, plan_dma
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine
from tests.support.regions import ArrayRegion

# -- DMA descriptors -------------------------------------------------------------------


def plan_descriptors(*args: Any, **kwargs: Any) -> list[DmaBatch]:
    """A job's DMA as descriptor batches alone (plan_dma without strided copies)."""
    return plan_dma(*args, strided=False, **kwargs).batches


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


def apply_dma(dma: DmaPlan) -> None:
    """Row by row, as cuMemcpy2DAsync would, then the batches."""
    if dma.strided is not None:
        for dst, src, n in dma.strided.descriptors():
            ctypes.memmove(dst, src, n)
    apply(dma.batches)


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


# -- strided (2-D) copies -------------------------------------------------------------


def reference_period(dev: list[int], host: list[int], size: list[int], min_rows: int) -> int:
    """stride_period by its definition, entry by entry."""
    m = len(size)
    for p in range(1, m // max(min_rows, 2) + 1):
        if m % p:
            continue
        d, h = dev[p] - dev[0], host[p] - host[0]
        if all(
            size[k + p] == size[k]
            and dev[k + p] - dev[k] == d
            and host[k + p] - host[k] == h
            and d >= size[k]
            and h >= size[k]
            for k in range(m - p)
        ):
            return p
    return 0


def columns(dev: list[int], host: list[int], size: list[int]) -> list[np.ndarray]:
    return [np.array(c, dtype=np.uint64) for c in (dev, host, size)]


@pytest.mark.parametrize(
    ("dev", "host", "size", "want"),
    [
        # 2 blocks x 4 layers, layer-major: layer stride 1000 on the GPU, pages one
        # after another (100 bytes) in each block's pool row.
        (
            [0, 10, 1000, 1010, 2000, 2010, 3000, 3010],
            [500, 0, 600, 100, 700, 200, 800, 300],
            [10] * 8,
            2,
        ),
        # Sizes differ along a chain: no period.
        (
            [0, 10, 1000, 1010, 2000, 2010, 3000, 3010],
            [500, 0, 600, 100, 700, 200, 800, 300],
            [10] * 7 + [9],
            0,
        ),
        # One chain of 8 rows (period 1).
        ([i * 64 for i in range(8)], [1 << 63 | i * 32 for i in range(8)], [32] * 8, 1),
        # A pitch narrower than the row: no 2-D copy.
        ([i * 8 for i in range(8)], [i * 64 for i in range(8)], [32] * 8, 0),
        # Descending addresses: no 2-D copy.
        ([(8 - i) * 64 for i in range(8)], [i * 64 for i in range(8)], [32] * 8, 0),
        # Too few rows for min_rows 4.
        ([0, 10, 1000, 1010, 2000, 2010], [500, 0, 600, 100, 700, 200], [10] * 6, 0),
    ],
)
def test_stride_period_finds_chains_of_equal_copies(
    dev: list[int], host: list[int], size: list[int], want: int, planner_impl: str
) -> None:
    assert reference_period(dev, host, size, 4) == want
    assert stride_period(*columns(dev, host, size), 4) == want


def test_stride_period_matches_its_definition_on_random_layouts(planner_impl: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(200):
        blocks, layers = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        page = int(rng.choice([8, 16]))
        slots = rng.permutation(blocks) * layers * page
        dev = [layer * 4096 + b * page for layer in range(layers) for b in range(blocks)]
        host = [int(slots[b]) + layer * page for layer in range(layers) for b in range(blocks)]
        size = [page] * len(dev)
        if rng.random() < 0.3:  # break the pattern somewhere
            i = int(rng.integers(len(dev)))
            dev[i] += int(rng.integers(1, 3)) * page * 16
        got = stride_period(*columns(dev, host, size), 4)
        assert got == reference_period(dev, host, size, 4), (dev, host)


def test_vllm_jobs_become_one_strided_copy_per_block(planner_impl: str) -> None:
    nb, page = 64, 64 << 10
    lay, mem, _ = vllm_geometry(nb)
    ids = [3, 7, 8, 20]
    slots = [5 * (2 << 20), 0, 9 * (2 << 20), 2 * (2 << 20)]
    plan = plan_job(lay, 0, mem, ids, [4], [0], slots)
    gpu, pool = 1 << 40, 1 << 32
    store = plan_dma(STORE, plan, [gpu], pool)
    assert store.batches == [] and store.strided is not None
    s = store.strided
    assert (len(s.widths), s.rows, set(s.widths)) == (4, 32, {page})
    assert (s.dst_pitch, s.src_pitch) == (page, nb * page)  # pool row, GPU layer stride
    assert list(s.srcs) == [gpu + b * page for b in ids]
    assert list(s.dsts) == [pool + o for o in slots]
    assert s.nbytes == 4 * (2 << 20)
    # The same copies as the descriptors, row for row.
    (batch,) = plan_descriptors(STORE, plan, [gpu], pool)
    assert sorted(s.descriptors()) == sorted(batch.descriptors())
    load = plan_dma(LOAD, plan, [gpu], pool).strided
    assert load is not None and (load.dst_pitch, load.src_pitch) == (nb * page, page)
    # Without strided copies, or with a page-locking boundary inside a block's row,
    # the job is descriptors.
    assert plan_dma(STORE, plan, [gpu], pool, strided=False).strided is None
    big_lay, big_mem, _ = vllm_geometry(40_000)  # layers 2.6 GB apart: over the max pitch
    big = plan_job(big_lay, 0, big_mem, ids, [4], [0], slots)
    assert plan_dma(STORE, big, [gpu], pool).strided is None
    split = plan_dma(STORE, plan, [gpu], pool, host_split=1 << 20)
    assert split.strided is None and sum(len(b) for b in split.batches) == 4 * 32


def test_a_row_across_a_page_locking_boundary_costs_only_its_own_pages(
    planner_impl: str,
) -> None:
    """Two of four blocks' rows straddle a page-locked piece of the pool: those two
    go as descriptors, the other two stay strided copies, and the bytes are the CPU
    engine's both ways."""
    nb, layers, page = 16, 8, 4096
    lay, mem, size = vllm_geometry(nb, layers=layers, page=page)
    row, split = layers * page, 4 * layers * page  # a block's row; a piece of 4 rows
    ids = [3, 7, 8, 12]
    slots = [0, split - row // 2, split + row, 2 * split - row // 4]  # 2nd and 4th cross
    plan = plan_job(lay, 0, mem, ids, [4], [0], slots)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    pool_a, pool_b = np.zeros(3 * split, np.uint8), np.zeros(3 * split, np.uint8)
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool_a.ctypes.data, plan)
    dma = plan_dma(STORE, plan, [src.ctypes.data], pool_b.ctypes.data, host_split=split)
    s = dma.strided
    assert s is not None and s.rows == layers
    assert list(s.dsts) == [pool_b.ctypes.data + slots[k] for k in (0, 2)]
    assert sum(len(b) for b in dma.batches) == 2 * layers  # the crossing rows' pages
    assert s.nbytes + sum(b.nbytes for b in dma.batches) == 4 * row
    for b in dma.batches:  # no descriptor spans a boundary
        for dst, _, n in b.descriptors():
            off = dst - pool_b.ctypes.data
            assert off // split == (off + n - 1) // split
    apply_dma(dma)
    assert pool_a.any() and np.array_equal(pool_a, pool_b)
    dst_a, dst_b = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    CpuCopyEngine().copy(LOAD, [ArrayRegion(dst_a)], pool_a.ctypes.data, plan)
    apply_dma(plan_dma(LOAD, plan, [dst_b.ctypes.data], pool_b.ctypes.data, host_split=split))
    assert dst_a.any() and np.array_equal(dst_a, dst_b)


@pytest.mark.parametrize(("bpc", "world", "rank"), [(1, 1, 0), (4, 2, 1), (2, 1, 0)])
def test_strided_copies_move_exactly_the_bytes_the_cpu_engine_moves(
    bpc: int, world: int, rank: int, planner_impl: str
) -> None:
    nb = 24
    lay, mem, size = vllm_geometry(nb, layers=6, page=4096, bpc=bpc, world=world)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    block_ids = [5, 6, 7, 2, 9, 10, 11, 12, 20, 3, 14, 15]
    chunks = lay.chunks_per_group([len(block_ids)], [0])[0]
    slot = lay.slot_bytes(0)
    offsets: list[int | None] = [(k * 3 + 2) * slot for k in reversed(range(chunks))]
    plan = plan_job(lay, rank, mem, block_ids, [len(block_ids)], [0], offsets)
    pool_a = np.zeros((3 * chunks + 3) * slot, np.uint8)
    pool_b = pool_a.copy()
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool_a.ctypes.data, plan)
    dma = plan_dma(STORE, plan, [src.ctypes.data], pool_b.ctypes.data, host_split=4 * slot)
    if bpc == 1:
        assert dma.strided is not None  # the path under test
    apply_dma(dma)
    assert pool_a.any() and np.array_equal(pool_a, pool_b)
    dst_a, dst_b = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    CpuCopyEngine().copy(LOAD, [ArrayRegion(dst_a)], pool_a.ctypes.data, plan)
    apply_dma(plan_dma(LOAD, plan, [dst_b.ctypes.data], pool_b.ctypes.data))
    assert dst_a.any() and np.array_equal(dst_a, dst_b)


def boundary_safe(dma: DmaPlan, pool: int, split: int, store: bool) -> bool:
    """No descriptor and no 2-D copy's rows leave one split-sized piece of the pool
    (the destination of a store, the source of a load)."""
    pieces = [(d if store else s, n) for b in dma.batches for d, s, n in b.descriptors()]
    if dma.strided is not None:
        c = dma.strided
        host, pitch = (c.dsts, c.dst_pitch) if store else (c.srcs, c.src_pitch)
        pieces += [(a, (c.rows - 1) * pitch + w) for a, w in zip(host, c.widths, strict=True)]
    return all((a - pool) // split == (a - pool + n - 1) // split for a, n in pieces)


@pytest.mark.parametrize("split_kind", ["none", "rows", "mid-page"])
@pytest.mark.parametrize(
    ("bpc", "world", "rank", "layers"), [(1, 1, 0, 6), (2, 4, 3, 8), (1, 1, 0, 3)]
)
def test_chained_plans_make_the_dma_of_their_pages(
    split_kind: str, bpc: int, world: int, rank: int, layers: int
) -> None:
    """A plan of chains goes to DMA from its chains alone (a 2-D copy per chain, the
    chains whose rows cross a page-locking boundary as descriptors cut there), and
    moves exactly the bytes of the per-page plan's DMA and of the CPU engine, both
    ways. Three layers are too few rows for 2-D copies: descriptors, the same bytes."""
    nb, page = 32, 4096
    lay, mem, size = vllm_geometry(nb, layers=layers, page=page, bpc=bpc, world=world)
    slot = lay.slot_bytes(0)
    split = {"none": 0, "rows": 2 * slot, "mid-page": 3 * page + 512}[split_kind]
    rng = np.random.default_rng(layers * 10 + bpc)
    # Runs of adjacent ids among scattered ones: a chunk's adjacent blocks are one
    # wider chain.
    block_ids = [5, 6, 7, 2, 9, 10, 11, 12, 20, 3, 14, 15, 28, 29]
    chunks = lay.chunks_per_group([14], [1 % bpc])[0]
    offsets: list[int | None] = [
        None if k == 2 else int(k * (slot + slot // 3)) for k in rng.permutation(chunks)
    ]
    plan = plan_job(lay, rank, mem, block_ids, [14], [1 % bpc], offsets)
    assert plan.chains is not None
    pool_bytes = (chunks + 2) * 2 * slot
    src = rng.integers(0, 256, size, dtype=np.uint8)
    pool_cpu, pool_chain, pool_pages = (np.zeros(pool_bytes, np.uint8) for _ in range(3))
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool_cpu.ctypes.data, plan)
    by_pages = CopyPlan(plan.runs)  # the same runs, planned page by page
    for pool, p in ((pool_chain, plan), (pool_pages, by_pages)):
        dma = plan_dma(STORE, p, [src.ctypes.data], pool.ctypes.data, host_split=split, max_batch=9)
        if p is plan:
            assert (dma.strided is not None) == (layers >= 4 and split_kind != "mid-page")
            assert dma.strided is None or dma.strided.rows == layers
        if split:
            assert boundary_safe(dma, pool.ctypes.data, split, True)
        moved = sum(b.nbytes for b in dma.batches)
        assert moved + (dma.strided.nbytes if dma.strided else 0) == plan.nbytes
        apply_dma(dma)
    assert pool_cpu.any()
    assert np.array_equal(pool_cpu, pool_chain) and np.array_equal(pool_cpu, pool_pages)
    dst_cpu, dst_chain = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    CpuCopyEngine().copy(LOAD, [ArrayRegion(dst_cpu)], pool_cpu.ctypes.data, plan)
    load = plan_dma(LOAD, plan, [dst_chain.ctypes.data], pool_chain.ctypes.data, host_split=split)
    if split:
        assert boundary_safe(load, pool_chain.ctypes.data, split, False)
    apply_dma(load)
    assert dst_cpu.any() and np.array_equal(dst_cpu, dst_chain)
