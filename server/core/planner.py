"""Copy planning: a job (keys + vLLM's GPULoadStoreSpec) becomes a list of byte runs.

The planner knows nothing of sockets, CUDA or mmap. `check_job` validates a job
(keys, block ids, group sizes, block indices) against its namespace and a rank's
memory map once; `plan_copy` turns the checked job and its slot offsets into
`(region, region_offset, pool_offset, nbytes)` runs, merging runs that are
contiguous on both sides. Every copy engine (CPU, CUDA, process memory) executes
the same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvdepot.common.chunks import block_positions
from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_key


@dataclass(frozen=True, slots=True)
class TensorView:
    """One canonical KV tensor inside a registered region."""

    region_index: int
    region_offset: int
    num_blocks: int
    block_stride: int
    page_bytes: int


@dataclass(frozen=True, slots=True)
class LayerRef:
    """Where one layer of a group lives: a tensor and an offset in its page."""

    tensor_index: int
    page_offset: int
    page_bytes: int


@dataclass(frozen=True)
class MemoryMap:
    """A rank's registered KV memory, validated against its namespace layout."""

    region_sizes: tuple[int, ...]
    tensors: tuple[TensorView, ...]
    groups: tuple[tuple[LayerRef, ...], ...]

    @classmethod
    def build(
        cls,
        layout: NamespaceLayout,
        region_sizes: Sequence[int],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
    ) -> MemoryMap:
        """Checks every tensor fits its region and every layer matches the layout."""
        for t_idx, t in enumerate(tensors):
            if not 0 <= t.region_index < len(region_sizes):
                raise LayoutError(
                    f"tensor {t_idx} names region {t.region_index}; "
                    f"{len(region_sizes)} region(s) registered"
                )
            if t.num_blocks <= 0 or t.page_bytes <= 0 or t.block_stride < t.page_bytes:
                raise LayoutError(
                    f"tensor {t_idx}: need num_blocks > 0 and block_stride >= page_bytes > 0 "
                    f"(got {t.num_blocks} blocks, stride {t.block_stride}, page {t.page_bytes})"
                )
            end = t.region_offset + (t.num_blocks - 1) * t.block_stride + t.page_bytes
            if t.region_offset < 0 or end > region_sizes[t.region_index]:
                raise LayoutError(
                    f"tensor {t_idx} spans bytes [{t.region_offset}, {end}) but region "
                    f"{t.region_index} has {region_sizes[t.region_index]} bytes"
                )
        if len(groups) != layout.num_groups:
            raise LayoutError(
                f"{len(groups)} group(s) of layer refs for a namespace of "
                f"{layout.num_groups} group(s)"
            )
        for g, (refs, pages) in enumerate(zip(groups, layout.groups, strict=True)):
            if len(refs) != len(pages):
                raise LayoutError(
                    f"group {g}: {len(refs)} layer(s) registered, the namespace layout has "
                    f"{len(pages)}"
                )
            for layer, (ref, page) in enumerate(zip(refs, pages, strict=True)):
                if not 0 <= ref.tensor_index < len(tensors):
                    raise LayoutError(
                        f"group {g} layer {layer} names tensor {ref.tensor_index}; "
                        f"{len(tensors)} tensor(s) registered"
                    )
                if ref.page_bytes != page:
                    raise LayoutError(
                        f"group {g} layer {layer}: page of {ref.page_bytes} bytes registered, "
                        f"the namespace layout says {page}: every engine of a namespace "
                        f"must share its layout"
                    )
                t = tensors[ref.tensor_index]
                if ref.page_offset < 0 or ref.page_offset + ref.page_bytes > t.page_bytes:
                    raise LayoutError(
                        f"group {g} layer {layer}: bytes [{ref.page_offset}, "
                        f"{ref.page_offset + ref.page_bytes}) exceed tensor "
                        f"{ref.tensor_index}'s page of {t.page_bytes} bytes"
                    )
        return cls(tuple(region_sizes), tuple(tensors), tuple(tuple(r) for r in groups))

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(t.num_blocks for t in self.tensors)


@dataclass(slots=True)
class CopyPlan:
    """Runs of (region, region_offset, pool_offset, nbytes); direction-free."""

    runs: list[tuple[int, int, int, int]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, region: int, region_off: int, pool_off: int, n: int) -> None:
        runs = self.runs
        if runs:
            r, ro, po, pn = runs[-1]
            if r == region and ro + pn == region_off and po + pn == pool_off:
                runs[-1] = (r, ro, po, pn + n)
                self.nbytes += n
                return
        runs.append((region, region_off, pool_off, n))
        self.nbytes += n


@dataclass(frozen=True, slots=True)
class JobShape:
    """A job checked against its namespace and a rank's memory: safe to plan.

    Built once per job by `check_job`; `plan_copy` then needs no checks. Per
    group: its block ids and, per block, the index of its key in the job and its
    sub-block in that key's chunk.
    """

    num_keys: int
    groups: tuple[tuple[int, Sequence[int], Sequence[int], Sequence[int] | None], ...]
    # per non-empty group: (group, block ids, key index per block, sub-block per block
    # or None when blocks_per_chunk is 1)


def check_job(
    layout: NamespaceLayout,
    memory: MemoryMap,
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    keys: Sequence[bytes] | None = None,
    num_keys: int | None = None,
) -> JobShape:
    """Validates one job; raises LayoutError with what to fix.

    Checks the group lists, that the job carries one key per chunk (`keys`, or
    just `num_keys`), that keys are distinct and group-major like group_sizes,
    and that every block id is inside every tensor its group's layers live in.
    """
    per_group = layout.chunks_per_group(group_sizes, block_indices)
    n_keys = len(keys) if keys is not None else num_keys
    if n_keys is None:
        raise ValueError("check_job needs keys or num_keys")
    if sum(per_group) != n_keys:
        raise LayoutError(
            f"job carries {n_keys} key(s) but group_sizes/block_indices describe "
            f"{sum(per_group)} chunk(s) ({per_group} per group)"
        )
    if keys is not None:
        if len(set(keys)) != len(keys):
            raise LayoutError("a job names the same key twice")
        pos = 0
        for g, n in enumerate(per_group):
            for key in keys[pos : pos + n]:
                if check_key(key, layout.num_groups) != g:
                    raise LayoutError(
                        f"key {key.hex()[:16]}… is of group {key[-4:].hex()} but sits among "
                        f"group {g}'s keys: keys are group-major, like group_sizes"
                    )
            pos += n
    if sum(group_sizes) != len(block_ids):
        raise LayoutError(
            f"sum(group_sizes) = {sum(group_sizes)} but {len(block_ids)} block id(s) given"
        )
    bpc = layout.blocks_per_chunk
    tensors = memory.tensors
    groups = []
    block_pos = key_pos = 0
    for g, n in enumerate(group_sizes):
        ids = block_ids[block_pos : block_pos + n]
        block_pos += n
        if n == 0:
            continue
        # Block ids are checked per group with min/max, not per page.
        lo, hi = min(ids), max(ids)
        for ref in memory.groups[g]:
            t = tensors[ref.tensor_index]
            if lo < 0 or hi >= t.num_blocks:
                bad = next(b for b in ids if not 0 <= b < t.num_blocks)
                raise LayoutError(
                    f"block id {bad} of group {g} is out of range: tensor "
                    f"{ref.tensor_index} has {t.num_blocks} blocks"
                )
        if bpc == 1:
            key_of: Sequence[int] = range(key_pos, key_pos + n)
            subs = None
        else:
            pos = block_positions(n, block_indices[g], bpc)
            key_of = [key_pos + c for c, _ in pos]
            subs = [j for _, j in pos]
        groups.append((g, ids, key_of, subs))
        key_pos += per_group[g]
    return JobShape(n_keys, tuple(groups))


def plan_copy(
    layout: NamespaceLayout,
    rank: int,
    memory: MemoryMap,
    shape: JobShape,
    slot_offsets: Sequence[int | None],
) -> CopyPlan:
    """Plans the copy of a checked job for one rank.

    `slot_offsets` holds the pool offset of each key's slot, in the job's key
    order (group-major, chunks ascending); None skips that key's pages (a store
    of a key that is already present, or dropped).
    """
    if len(slot_offsets) != shape.num_keys:
        raise ValueError(f"{len(slot_offsets)} slot offsets for {shape.num_keys} keys")
    plan = CopyPlan()
    runs = plan.runs
    tensors = memory.tensors
    # This loop runs once per page (2048 times for a 64-chunk Llama-8B job), so
    # it is written for CPython: the run being grown lives in locals (merged in
    # place) instead of going through CopyPlan.add.
    cur_r = -1  # the pending run: region, region offset, pool offset, bytes
    cur_ro = cur_po = cur_n = 0
    nbytes = 0
    for g, ids, key_of, subs in shape.groups:
        slots = [slot_offsets[k] for k in key_of]
        if all(s is None for s in slots):
            continue
        pages = layout.groups[g]
        for layer, ref in enumerate(memory.groups[g]):
            t = tensors[ref.tensor_index]
            page = pages[layer]
            region = t.region_index
            stride = t.block_stride
            base = t.region_offset + ref.page_offset
            layer_base = layout.page_offset(g, rank, layer, 0)
            for i, block_id in enumerate(ids):
                slot_off = slots[i]
                if slot_off is None:
                    continue
                ro = base + block_id * stride
                po = slot_off + layer_base
                if subs is not None:
                    po += subs[i] * page
                if region == cur_r and cur_ro + cur_n == ro and cur_po + cur_n == po:
                    cur_n += page
                else:
                    if cur_r >= 0:
                        runs.append((cur_r, cur_ro, cur_po, cur_n))
                    cur_r, cur_ro, cur_po, cur_n = region, ro, po, page
                nbytes += page
    if cur_r >= 0:
        runs.append((cur_r, cur_ro, cur_po, cur_n))
    plan.nbytes += nbytes
    return plan


def plan_job(
    layout: NamespaceLayout,
    rank: int,
    memory: MemoryMap,
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_offsets: Sequence[int | None],
) -> CopyPlan:
    """`check_job` then `plan_copy` in one call (tests and benchmarks; the daemon's
    job runner keeps the two apart so that it checks before it reserves slots).

    Every block id is validated against its tensor's block count, skipped or
    not; raises LayoutError with what to fix.
    """
    shape = check_job(
        layout, memory, block_ids, group_sizes, block_indices, num_keys=len(slot_offsets)
    )
    return plan_copy(layout, rank, memory, shape, slot_offsets)
