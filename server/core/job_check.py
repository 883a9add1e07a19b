"""The job checker: a job's keys and block ids, checked against its namespace and memory.

`check_job` validates one job (keys, block ids, group sizes, block indices) against
its namespace layout and a rank's memory map, once, before any slot is reserved,
and raises LayoutError saying what to fix; the `JobShape` it returns is what the
copy planner (`kvdepot.server.core.planner.plan_copy`) needs to plan the job with
no further checks. `slice_shape` cuts a shape into slices that plan in the same
order. Called by the daemon's job runner (kvdepot.server.state.jobs) on the event
loop; plain functions over plain values, no state of their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvdepot.server.core.layout import (
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    LayoutError,
    NamespaceLayout,
    check_key,
)

if TYPE_CHECKING:  # the planner imports this module, not the other way round
    from kvdepot.server.core.planner import MemoryMap


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
        # check_key for every key, in C-speed passes (a job has thousands of keys).
        lengths = list(map(len, keys))
        if keys and not MIN_KEY_BYTES <= min(lengths) <= max(lengths) <= MAX_KEY_BYTES:
            check_key(next(k for k in keys if not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES), 1)
        found = [int.from_bytes(k[-4:], "big") for k in keys]
        wanted = list(
            itertools.chain.from_iterable(itertools.repeat(g, n) for g, n in enumerate(per_group))
        )
        if found != wanted:
            i = next(i for i, (f, w) in enumerate(zip(found, wanted, strict=True)) if f != w)
            key = keys[i]
            check_key(key, layout.num_groups)  # raises if the group does not exist
            raise LayoutError(
                f"key {key.hex()[:16]}… is of group {key[-4:].hex()} but sits among "
                f"group {wanted[i]}'s keys: keys are group-major, like group_sizes"
            )
    if sum(group_sizes) != len(block_ids):
        raise LayoutError(
            f"sum(group_sizes) = {sum(group_sizes)} but {len(block_ids)} block id(s) given"
        )
    # Column-wise from here: no Python object per block (a job's blocks are many).
    try:
        all_ids = np.asarray(block_ids, dtype=np.int64)
    except OverflowError:
        raise LayoutError("a block id does not fit in 64 bits") from None
    bpc = layout.blocks_per_chunk
    tensors = memory.tensors
    groups = []
    block_pos = key_pos = 0
    for g, n in enumerate(group_sizes):
        ids = all_ids[block_pos : block_pos + n]
        block_pos += n
        if n == 0:
            continue
        # Block ids are checked per group with min/max, not per page.
        lo, hi = int(ids.min()), int(ids.max())
        for ref in memory.groups[g]:
            t = tensors[ref.tensor_index]
            if lo < 0 or hi >= t.num_blocks:
                bad = int(ids[np.flatnonzero((ids < 0) | (ids >= t.num_blocks))[0]])
                raise LayoutError(
                    f"block id {bad} of group {g} is out of range: tensor "
                    f"{ref.tensor_index} has {t.num_blocks} blocks"
                )
        if bpc == 1:
            key_of: Sequence[int] = range(key_pos, key_pos + n)
            subs = None
        else:
            # block_positions, column-wise: block i is sub-block (skip + i) % bpc
            # of the group's chunk (skip + i) // bpc.
            pos = np.arange(block_indices[g] % bpc, block_indices[g] % bpc + n, dtype=np.int64)
            key_of = key_pos + pos // bpc
            subs = pos % bpc
        groups.append((g, ids, key_of, subs))
        key_pos += per_group[g]
    return JobShape(n_keys, tuple(groups))


def slice_shape(layout: NamespaceLayout, shape: JobShape, max_pages: int) -> Iterator[JobShape]:
    """`shape` cut into shapes of at most `max_pages` pages (blocks x layers; at
    least one block each), in the job's order: planning each with `plan_copy` and the
    same slot offsets gives the job's runs, a slice at a time."""
    for g, ids, key_of, subs in shape.groups:
        step = max(1, max_pages // len(layout.groups[g]))
        for start in range(0, len(ids), step):
            end = start + step
            part = (g, ids[start:end], key_of[start:end], None if subs is None else subs[start:end])
            yield JobShape(shape.num_keys, (part,))
