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

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvdepot.common import chunks
from kvdepot.server.core.layout import (
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    LayoutError,
    NamespaceLayout,
    check_key,
)
from kvdepot.server.core.memory_map import MemoryMap

# Block ids, key indices or sub-blocks of a group: a list or range, or an int64 array
# (read only), indexed alike.
Ints = Sequence[int] | npt.NDArray[np.int64]

# Jobs of up to this many block ids are bounds-checked on a Python list, larger ones
# with numpy (the same checks; whichever is cheaper at that size).
SMALL_JOB_BLOCKS = 256


@dataclass(frozen=True, slots=True)
class JobShape:
    """A job checked against its namespace and a rank's memory: safe to plan.

    Built once per job by `check_job`; `plan_copy` then needs no checks. Per
    group: its block ids and, per block, the index of its key in the job and its
    sub-block in that key's chunk.
    """

    num_keys: int
    groups: tuple[tuple[int, Ints, Ints, Ints | None], ...]
    # per non-empty group: (group, block ids, key index per block, sub-block per block
    # or None when blocks_per_chunk is 1)
    # The group of each key, as checked (empty when the keys were not given): the
    # index's claim takes it instead of decoding and checking every key again.
    key_groups: tuple[int, ...] = ()


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
    frame = _frame(
        layout.blocks_per_chunk, layout.group_ids, tuple(group_sizes), tuple(block_indices)
    )
    n_keys = len(keys) if keys is not None else num_keys
    if n_keys is None:
        raise ValueError("check_job needs keys or num_keys")
    if frame.num_keys != n_keys:
        raise LayoutError(
            f"job carries {n_keys} key(s) but group_sizes/block_indices describe "
            f"{frame.num_keys} chunk(s) ({frame.per_group} per group)"
        )
    key_groups: tuple[int, ...] = ()  # known once the keys are checked
    if keys is not None:
        # check_key for every key, in C-speed passes over one list (a job has
        # thousands of keys; a protobuf repeated field makes a bytes object per read).
        if not isinstance(keys, list):  # the daemon's codec hands a list already
            keys = list(keys)
        if len(set(keys)) != len(keys):
            raise LayoutError("a job names the same key twice")
        if keys and not (
            min(map(len, keys)) >= MIN_KEY_BYTES and max(map(len, keys)) <= MAX_KEY_BYTES
        ):
            check_key(next(k for k in keys if not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES), 1)
        # Group-major: each key's 4-byte suffix is its group's id, compared as bytes.
        wanted, key_groups = frame.suffixes, frame.key_groups
        found = [k[-4:] for k in keys]
        if found != wanted:
            i = next(i for i, (f, w) in enumerate(zip(found, wanted, strict=True)) if f != w)
            key = keys[i]
            layout.key_group(key)  # raises if the namespace holds no such group
            raise LayoutError(
                f"key {key.hex()[:16]}… is of group {int.from_bytes(key[-4:], 'big')} but "
                f"sits among group {int.from_bytes(wanted[i], 'big')}'s keys: keys are "
                f"group-major, like group_sizes"
            )
    if frame.num_blocks != len(block_ids):
        raise LayoutError(
            f"sum(group_sizes) = {frame.num_blocks} but {len(block_ids)} block id(s) given"
        )
    # Column-wise from here: no Python object per block (a job's blocks are many),
    # except that a small job's bounds are two builtin calls on a list (numpy's
    # reductions cost microseconds each, whatever their length).
    id_list: list[int] | None = None
    if len(block_ids) <= SMALL_JOB_BLOCKS:
        id_list = block_ids if isinstance(block_ids, list) else list(block_ids)
    try:
        all_ids = np.asarray(block_ids if id_list is None else id_list, dtype=np.int64)
    except OverflowError:
        raise LayoutError("a block id does not fit in 64 bits") from None
    tensors = memory.tensors
    groups = []
    for g, start, stop, key_of, subs in frame.groups:
        ids = all_ids[start:stop]
        # Block ids are checked per group with min/max against the fewest blocks of
        # the group's tensors (MemoryMap.group_blocks): not per page, nor per layer.
        if id_list is None:
            outside = ids.min() < 0 or ids.max() >= memory.group_blocks[g]
        else:
            part = id_list[start:stop]
            outside = min(part) < 0 or max(part) >= memory.group_blocks[g]
        if outside:
            for ref in memory.groups[g]:  # the first tensor, in layer order, it leaves
                t = tensors[ref.tensor_index]
                if (ids < 0).any() or (ids >= t.num_blocks).any():
                    bad = int(ids[np.flatnonzero((ids < 0) | (ids >= t.num_blocks))[0]])
                    raise LayoutError(
                        f"block id {bad} of group {g} is out of range: tensor "
                        f"{ref.tensor_index} has {t.num_blocks} blocks"
                    )
        groups.append((g, ids, key_of, subs))
    return JobShape(n_keys, tuple(groups), key_groups)


@dataclass(frozen=True, slots=True)
class _Frame:
    """What check_job derives from a job's group_sizes and block_indices alone, shared
    by every job of that shape (read only)."""

    per_group: list[int]  # keys per group
    num_keys: int
    num_blocks: int
    suffixes: list[bytes]  # each key's 4-byte group suffix, group-major
    key_groups: tuple[int, ...]  # each key's group
    # per non-empty group: (group, first and end block position in the job, key index
    # per block, sub-block per block or None when blocks_per_chunk is 1)
    groups: tuple[tuple[int, int, int, Ints, Ints | None], ...]


# A node's few job shapes. Bounded for a client that sends many: a frame holds two
# int64 arrays of its blocks (blocks_per_chunk > 1), 256 KiB at --max-job-blocks'
# default, so 16 MiB at most.
@functools.lru_cache(maxsize=64)
def _frame(
    bpc: int,
    group_ids: tuple[int, ...],
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
) -> _Frame:
    """The frame of jobs of this shape in a namespace of groups `group_ids`; raises
    LayoutError on lists no job may have (an error is not cached)."""
    per_group = chunks.chunks_per_group(group_sizes, block_indices, bpc, len(group_ids))
    suffixes, key_groups = _group_major(tuple(per_group), group_ids)
    groups = []
    block_pos = key_pos = 0
    for g, n in enumerate(group_sizes):
        if n:
            if bpc == 1:
                key_of: Ints = range(key_pos, key_pos + n)
                subs = None
            else:
                # block_positions, column-wise: block i is sub-block (skip + i) % bpc
                # of the group's chunk (skip + i) // bpc.
                skip = block_indices[g] % bpc
                pos = np.arange(skip, skip + n, dtype=np.int64)
                key_of, subs = key_pos + pos // bpc, pos % bpc
                key_of.flags.writeable = subs.flags.writeable = False  # shared by jobs
            groups.append((g, block_pos, block_pos + n, key_of, subs))
        block_pos += n
        key_pos += per_group[g]
    return _Frame(per_group, sum(per_group), block_pos, suffixes, key_groups, tuple(groups))


@functools.lru_cache(maxsize=64)  # a node's few job shapes; 4 MB at most
def _group_major(
    per_group: tuple[int, ...], group_ids: tuple[int, ...]
) -> tuple[list[bytes], tuple[int, ...]]:
    """For a job of `per_group` keys per group: each key's 4-byte group suffix (its
    group's id) and each key's group (its index), in group-major order (shared by
    every such job: read only)."""
    wanted: list[bytes] = []
    for g, n in enumerate(per_group):
        wanted += [_suffix(group_ids[g])] * n
    return wanted, tuple(g for g, n in enumerate(per_group) for _ in range(n))


@functools.cache
def _suffix(group_id: int) -> bytes:
    """The last 4 bytes of a key of group `group_id` (NamespaceLayout.key_group)."""
    return group_id.to_bytes(4, "big")


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
