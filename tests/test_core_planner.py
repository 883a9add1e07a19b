"""Layouts, copy planning and the CPU copy engine, checked byte for byte in-process."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.server.core.job_check import check_job
from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_key
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.core.planner import CopyPlan, plan_job
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
        MemoryMap.build(
            lay,
            [1 << 20],
            [TensorView(0, 0, 8, 2048, 2048)] * 5,
            [[LayerRef(0, 0, 2048)] * 2, [LayerRef(0, 0, 1024)] * 3],
        )
    with pytest.raises(LayoutError, match="spans bytes"):
        MemoryMap.build(
            lay,
            [1000],
            [TensorView(0, 0, 8, 4096, 4096)],
            [[LayerRef(0, 0, 4096)] * 2, [LayerRef(0, 0, 1024)] * 3],
        )


def test_plan_merges_contiguous_pages_and_rejects_out_of_range_blocks(planner_impl: str) -> None:
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
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_store_then_load_round_trips_bytes_for_both_ranks(
    first_index: int, compiled: bool, planner_impl: str
) -> None:
    """Two ranks store into shared slots; loads into other blocks get each rank's bytes."""
    lay = layout(world=2, bpc=2)
    mm, size = memmap(lay)
    rng = np.random.default_rng(first_index)
    pool = np.zeros(1 << 20, np.uint8)
    src = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2)]
    engine = CpuCopyEngine(compiled)
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
            for s, d in zip(
                src_blocks[g * n : (g + 1) * n], dst_blocks[g * n : (g + 1) * n], strict=True
            ):
                a = src[rank][t.region_offset + s * t.block_stride :][: t.page_bytes]
                b = dst[t.region_offset + d * t.block_stride :][: t.page_bytes]
                assert np.array_equal(a, b), (rank, layer, s, d)


def test_skipped_keys_leave_their_slots_untouched(planner_impl: str) -> None:
    lay = layout(world=1, bpc=1)
    mm, size = memmap(lay)
    src = np.full(size, 7, np.uint8)
    pool = np.zeros(1 << 16, np.uint8)
    plan = plan_job(lay, 0, mm, [1, 2], [2, 0], [0, 0], [None, 0])
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool.ctypes.data, plan)
    assert plan.nbytes == 8192
    assert pool[:8192].min() == 7 and pool[8192:].max() == 0


def reference_runs(
    lay: NamespaceLayout,
    rank: int,
    mm: MemoryMap,
    block_ids: list[int],
    sizes: list[int],
    first: list[int],
    slots: list[int | None],
) -> list[tuple[int, int, int, int]]:
    """The plan written the obvious way: page by page, merged greedily."""
    from kvdepot.common.chunks import block_positions

    runs: list[tuple[int, int, int, int]] = []
    pos = key0 = 0
    for g, n in enumerate(sizes):
        ids = block_ids[pos : pos + n]
        pos += n
        where = block_positions(n, first[g], lay.blocks_per_chunk)
        for layer, ref in enumerate(mm.groups[g]):
            t = mm.tensors[ref.tensor_index]
            for block, (c, j) in zip(ids, where, strict=True):
                slot = slots[key0 + c]
                if slot is None:
                    continue
                ro = t.region_offset + ref.page_offset + block * t.block_stride
                po = slot + lay.page_offset(g, rank, layer, j)
                if (
                    runs
                    and runs[-1][0] == t.region_index
                    and runs[-1][1] + runs[-1][3] == ro
                    and runs[-1][2] + runs[-1][3] == po
                ):
                    runs[-1] = (*runs[-1][:3], runs[-1][3] + ref.page_bytes)
                else:
                    runs.append((t.region_index, ro, po, ref.page_bytes))
        key0 += lay.chunks_per_group(sizes, first)[g] if n else 0
    return runs


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_plan_matches_the_page_by_page_reference(seed: int, planner_impl: str) -> None:
    """Random jobs (skipped keys, partial chunks, contiguous and scattered blocks):
    the planner's runs (compiled and numpy) are exactly the page-by-page ones, and
    a split plan holds every run once."""
    rng = np.random.default_rng(seed)
    lay = layout(world=2, bpc=2)
    mm, _ = memmap(lay)
    first = [int(rng.integers(0, 3)), int(rng.integers(0, 3))]
    sizes = [int(rng.integers(0, 9)), int(rng.integers(1, 9))]
    contiguous = seed % 2 == 0
    block_ids = [
        int(b)
        for n in sizes
        for b in (np.arange(3, 3 + n) if contiguous else rng.choice(64, n, replace=False))
    ]
    n_keys = sum(lay.chunks_per_group(sizes, first))
    slots: list[int | None] = []
    for k in range(n_keys):
        skip = rng.random() < 0.3
        slots.append(None if skip else k * 65536)
    rank = seed % 2
    plan = plan_job(lay, rank, mm, block_ids, sizes, first, slots)
    want = reference_runs(lay, rank, mm, block_ids, sizes, first, slots)
    assert plan.runs == want
    assert plan.nbytes == sum(r[3] for r in want)
    parts = plan.split(3, 1)
    assert [r for p in parts for r in p.runs] == want
    assert sum(p.nbytes for p in parts) == plan.nbytes


def reference_addresses(
    runs: list[tuple[int, int, int, int]], bases: list[int], pool: int, split: int
) -> list[tuple[int, int, int]]:
    """Address columns written the obvious way: run by run, cut byte-range by range."""
    out = []
    for r, ro, po, n in runs:
        while n:
            piece = min(n, split - po % split) if split else n
            out.append((bases[r] + ro, pool + po, piece))
            ro, po, n = ro + piece, po + piece, n - piece
    return out


@pytest.mark.parametrize("split", [0, 4096, 3 << 12])
def test_address_columns_match_the_run_by_run_reference(split: int, planner_impl: str) -> None:
    """Addresses with the top bit set (device memory may use it), runs that cross
    several cut points, and runs of one byte."""
    rng = np.random.default_rng(split)
    runs = [
        (int(rng.integers(0, 3)), int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 20)),
         int(rng.choice([1, 4096, 65536, int(rng.integers(1, 40000))])))
        for _ in range(700)
    ]  # fmt: skip
    bases = [1 << 63, 5 << 40, 12345]
    cols = CopyPlan(runs).address_columns(bases, (1 << 63) + (1 << 44), split)
    assert cols.dtype == np.uint64
    assert list(zip(*cols.tolist(), strict=True)) == reference_addresses(
        runs, bases, (1 << 63) + (1 << 44), split
    )


def test_address_columns_refuse_runs_no_planner_makes(planner_impl: str) -> None:
    for runs, match in (
        ([(0, 0, 0, 8), (0, 8, -1, 8)], r"bad run \(0, 8, -1, 8\)"),
        ([(0, 0, 0, 0)], r"bad run \(0, 0, 0, 0\)"),
        ([(0, 0, 0, 8), (2, 0, 0, 8)], "run names region 2; 2 mapped"),
        ([(-1, 0, 0, 8)], "run names region -1; 2 mapped"),
    ):
        with pytest.raises(ValueError, match=match):
            CopyPlan(runs).address_columns([0, 0], 0, 1024)
    with pytest.raises(ValueError, match="split"):
        CopyPlan([(0, 0, 0, 8)]).address_columns([0], 0, -1)
    assert CopyPlan().address_columns([0], 0).shape == (3, 0)


# -- plans of chains (vLLM's layout, planned per block) --------------------------------


def vllm_memmap(
    layers: int, page: int, bpc: int, world: int, num_blocks: int = 64, gap: int = 0
) -> tuple[NamespaceLayout, MemoryMap, int]:
    """One region, each layer a (num_blocks, page) tensor `gap` bytes after the one
    before: layers one pitch apart, as vLLM allocates them."""
    lay = NamespaceLayout("vllm", world, bpc, ((page,) * layers,))
    pitch = num_blocks * page + gap
    tensors = [TensorView(0, i * pitch, num_blocks, page, page) for i in range(layers)]
    refs = [[LayerRef(i, 0, page) for i in range(layers)]]
    return lay, MemoryMap.build(lay, [layers * pitch], tensors, refs), layers * pitch


def random_vllm_job(seed: int, min_blocks: int = 1, skipped: float = 0.0) -> tuple:
    """A random one-group job over vLLM's layout (6 layers): its layout, memory map,
    region size and plan_job's arguments after the map (rank, block_ids, sizes, first,
    slots). Seeds mod 4 pick (blocks_per_chunk, world), odd seeds take consecutive GPU
    blocks (a chunk's sub-blocks follow one another); `skipped`: the share of keys
    without a slot."""
    rng = np.random.default_rng(100 + seed)
    bpc, world = [(1, 1), (2, 2), (4, 1), (1, 8)][seed % 4]
    rank = int(rng.integers(0, world))
    lay, mm, size = vllm_memmap(6, 4096, bpc, world, gap=4096 * (seed % 3))
    first = [int(rng.integers(0, bpc))]
    sizes = [int(rng.integers(min_blocks, 20))]
    if seed % 2:
        start = int(rng.integers(0, 40))
        block_ids = list(range(start, start + sizes[0]))
    else:
        block_ids = [int(b) for b in rng.choice(64, sizes[0], replace=False)]
    slot = lay.slot_bytes(0)
    n_keys = lay.chunks_per_group(sizes, first)[0]
    slots = [
        None if skipped and rng.random() < skipped else int(k) * slot
        for k in rng.permutation(n_keys)
    ]
    return lay, mm, size, (rank, block_ids, sizes, first, slots)


@pytest.mark.parametrize("seed", range(8))
def test_chained_plans_are_the_page_by_page_runs(seed: int) -> None:
    """vLLM's layout plans per block (a plan of chains, its runs built only when
    asked for), and those runs are exactly the page-by-page reference, skipped keys,
    sub-blocks, partial chunks and a chunk's adjacent blocks (one wider chain)
    included."""
    lay, mm, size, job = random_vllm_job(seed, skipped=0.25)
    rank = job[0]
    plan = plan_job(lay, rank, mm, *job[1:])
    want = reference_runs(lay, rank, mm, *job[1:])
    if not want:
        assert len(plan) == 0 and plan.nbytes == 0
        return
    chains = plan.chains
    assert chains is not None and chains.rows == 6
    assert len(plan) == len(want) and plan.nbytes == sum(r[3] for r in want)  # before runs
    assert plan.runs == want
    # The chains hold the same runs, and their bounds are the runs' own.
    runs = sorted(
        (chains.region, int(r0) + i * chains.region_pitch, int(p0) + i * chains.pool_pitch, int(w))
        for r0, p0, w in zip(chains.region_starts, chains.pool_starts, chains.widths, strict=True)
        for i in range(chains.rows)
    )
    assert runs == sorted(want)
    assert chains.widest == max(r[3] for r in want)
    assert (chains.region_low, chains.region_end) == (
        min(r[1] for r in want),
        max(r[1] + r[3] for r in want),
    )
    assert (chains.pool_low, chains.pool_end) == (
        min(r[2] for r in want),
        max(r[2] + r[3] for r in want),
    )
    assert chains.inside([size], chains.pool_end)
    assert not chains.inside([size], chains.pool_end - 1)
    assert not chains.inside([chains.region_end - 1], None)


@pytest.mark.parametrize("seed", range(6))
def test_the_cpu_engine_copies_chains_as_the_page_by_page_runs(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled CPU engine copies a plan of chains in one call over its chains (no
    run table), whole and cut between chains for several copy threads
    (CopyPlan.split); both ways the bytes it moves are those of the page-by-page runs,
    copied run by run, and nothing else changes."""
    lay, mm, size, job = random_vllm_job(seed, min_blocks=4)
    rank = job[0]
    want = reference_runs(lay, rank, mm, *job[1:])
    pool_size = max(r[2] + r[3] for r in want) + 4096
    rng = np.random.default_rng(seed)
    mem0 = rng.integers(0, 256, size, dtype=np.uint8)
    pool0 = rng.integers(0, 256, pool_size, dtype=np.uint8)

    def copied(direction: int, plans: list[CopyPlan], compiled: bool) -> tuple:
        mem, pool = mem0.copy(), pool0.copy()
        for plan in plans:
            CpuCopyEngine(compiled).copy(direction, [ArrayRegion(mem)], pool.ctypes.data, plan)
        return mem, pool

    whole = plan_job(lay, rank, mm, *job[1:])
    parts = plan_job(lay, rank, mm, *job[1:]).split(3, 1)
    assert whole.chains is not None and len(parts) == min(3, len(whole.chains))
    assert all(p.chains is not None for p in parts)
    assert sum(len(p.chains) for p in parts) == len(whole.chains)
    assert sum(p.nbytes for p in parts) == whole.nbytes
    # Each part's own runs (for engines that copy runs) are the reference's, together.
    assert sorted(r for p in parts for r in p.runs) == sorted(want)
    from kvdepot.server.memory import copy_engine

    if copy_engine.copy_chains is None:
        pytest.skip("the compiled run copier was not built")
    references = {d: copied(d, [CopyPlan(want)], compiled=False) for d in (STORE, LOAD)}

    def no_run_table(*args: object) -> None:
        raise AssertionError("a plan of chains was copied run by run")

    monkeypatch.setattr(copy_engine, "copy_runs", no_run_table)
    for direction, reference in references.items():
        for plans in ([whole], parts):
            got = copied(direction, plans, compiled=True)
            assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))


def test_layouts_that_are_not_chains_plan_page_by_page() -> None:
    """Hybrid jobs, layers at uneven distances, one layer, and jobs whose pages the
    per-page plan merges are planned page by page: the same runs either way."""
    hybrid = layout(world=1, bpc=1)
    mm, _ = memmap(hybrid)
    assert plan_job(hybrid, 0, mm, [1, 2, 3], [2, 1], [0, 0], [0, 8192, 16384]).chains is None
    # Layers at uneven distances.
    lay = NamespaceLayout("uneven", 1, 1, ((4096,) * 3,))
    tensors = [TensorView(0, off, 16, 4096, 4096) for off in (0, 65536, 200_000)]
    uneven = MemoryMap.build(lay, [300_000], tensors, [[LayerRef(i, 0, 4096) for i in range(3)]])
    plan = plan_job(lay, 0, uneven, [1, 5], [2], [0], [0, 3 * 4096])
    assert plan.chains is None
    assert plan.runs == reference_runs(lay, 0, uneven, [1, 5], [2], [0], [0, 3 * 4096])
    one, mm1, _ = vllm_memmap(1, 4096, 1, 1)
    assert plan_job(one, 0, mm1, [1, 2], [2], [0], [0, 8192]).chains is None
    # A layer's last page followed by the next layer's first on both sides: the
    # per-page plan merges across layers, which chains do not.
    lay2 = NamespaceLayout("packed", 1, 1, ((4096,) * 2,))
    packed = MemoryMap.build(
        lay2, [8192], [TensorView(0, i * 4096, 1, 4096, 4096) for i in range(2)],
        [[LayerRef(i, 0, 4096) for i in range(2)]],
    )  # fmt: skip
    across = plan_job(lay2, 0, packed, [0], [1], [0], [0])
    assert across.chains is None and across.runs == [(0, 0, 0, 8192)]
    # A chunk's two sub-blocks in adjacent GPU blocks: one chain two pages wide, as
    # the per-page plan merges them in every layer.
    lay6, mm6, _ = vllm_memmap(6, 4096, 2, 1)
    merged = plan_job(lay6, 0, mm6, [3, 4], [2], [0], [0])
    assert merged.chains is not None and merged.chains.widths.tolist() == [8192]
    assert merged.runs == reference_runs(lay6, 0, mm6, [3, 4], [2], [0], [0])
    assert len(merged) == 6  # one run of two pages per layer
    # Slots that overlap (no index hands them out) would make a chain's rows overlap:
    # page by page.
    lay1, mm1, _ = vllm_memmap(6, 4096, 1, 1)
    overlapping = plan_job(lay1, 0, mm1, [3, 4], [2], [0], [0, 4096])
    assert overlapping.chains is None
    assert overlapping.runs == reference_runs(lay1, 0, mm1, [3, 4], [2], [0], [0, 4096])


def test_copy_engines_refuse_a_chained_plan_outside_its_region_or_the_pool() -> None:
    """check_runs, every engine's defence in depth, bounds a plan of chains by its
    chains' ends: a region or pool one byte short refuses the job; the exact sizes
    pass, and the CPU engine then moves the pages."""
    from kvdepot.server.errors import DepotError
    from kvdepot.server.memory.copy_engine import check_runs

    lay, mm, size = vllm_memmap(4, 4096, 1, 1)
    slot = lay.slot_bytes(0)
    plan = plan_job(lay, 0, mm, [9, 2], [2], [0], [3 * slot, slot])
    assert plan.chains is not None
    pool_size = 4 * slot
    src = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy()
    check_runs([ArrayRegion(src)], plan, pool_size)
    for regions, pool in (
        ([ArrayRegion(src[: plan.chains.region_end - 1])], pool_size),
        ([ArrayRegion(src)], pool_size - 1),
        ([], pool_size),
    ):
        with pytest.raises(DepotError) as err:
            check_runs(regions, plan, pool)
        assert err.value.code.name == "INVALID_ARGUMENT"
    pool = np.zeros(pool_size, np.uint8)
    CpuCopyEngine().copy(STORE, [ArrayRegion(src)], pool.ctypes.data, plan)
    for layer in range(4):
        t = mm.tensors[layer]
        for block, off in ((9, 3 * slot), (2, slot)):
            got = pool[off + layer * 4096 :][:4096]
            assert np.array_equal(got, src[t.region_offset + block * 4096 :][:4096])


def gkey(i: int, group_id: int) -> bytes:
    return i.to_bytes(32, "big") + group_id.to_bytes(4, "big")


def test_group_ids_map_a_keys_group_id_to_the_namespaces_group() -> None:
    """vLLM offloads groups 0 and 2 of a model (group 1 is not offloaded): its keys end
    with 0 and 2, its jobs list the two groups in that order."""
    lay = NamespaceLayout("ns", 1, 1, ((4096, 4096), (1024, 1024, 1024)), group_ids=(0, 2))
    assert (lay.key_group(gkey(5, 0)), lay.key_group(gkey(5, 2))) == (0, 1)
    assert lay.slot_bytes(lay.key_group(gkey(5, 2))) == 3 * 1024
    with pytest.raises(
        LayoutError, match=r"names group 1, but the namespace holds group\(s\) 0, 2"
    ):
        lay.key_group(gkey(5, 1))
    with pytest.raises(LayoutError, match="4-byte"):
        lay.key_group(b"\x00\x02")
    mm, _ = memmap(lay)
    shape = check_job(lay, mm, [3, 4], [1, 1], [0, 0], keys=[gkey(1, 0), gkey(1, 2)])
    assert shape.key_groups == (0, 1)
    with pytest.raises(LayoutError, match="names group 1"):
        check_job(lay, mm, [3, 4], [1, 1], [0, 0], keys=[gkey(1, 0), gkey(1, 1)])
    with pytest.raises(LayoutError, match="is of group 2 but sits among group 0's keys"):
        check_job(lay, mm, [3, 4], [1, 1], [0, 0], keys=[gkey(1, 2), gkey(1, 0)])
    # HiSparse: group 1 alone.
    hisparse = NamespaceLayout("hs", 1, 1, ((1024,),), group_ids=(1,))
    hmm, _ = memmap(hisparse)
    assert check_job(hisparse, hmm, [3], [1], [0], keys=[gkey(1, 1)]).key_groups == (0,)
    with pytest.raises(LayoutError, match="names group 0"):
        check_job(hisparse, hmm, [3], [1], [0], keys=[gkey(1, 0)])


def test_a_layout_without_group_ids_is_groups_0_to_n() -> None:
    """What every layout meant before group ids (an older client's): equal, byte for
    byte, to one that names 0, 1, ...; another set of ids is another layout."""
    pages = ((4096,), (4096,))
    old = NamespaceLayout("ns", 1, 1, pages)
    assert old.group_ids == (0, 1) and old.default_group_ids
    assert old == NamespaceLayout("ns", 1, 1, pages, group_ids=(0, 1))
    assert old.same_bytes_as(NamespaceLayout("ns", 1, 1, pages, group_ids=(0, 1)))
    assert not old.same_bytes_as(NamespaceLayout("ns", 1, 1, pages, group_ids=(0, 2)))
    for ids, why in (((0,), "1 group id"), ((3, 3), "twice"), ((0, 1 << 32), "2\\*\\*32")):
        with pytest.raises(LayoutError, match=why):
            NamespaceLayout("ns", 1, 1, pages, group_ids=ids)
