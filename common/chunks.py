"""Chunk and section arithmetic: which key a block belongs to, where its pages sit.

The one place this arithmetic lives; the daemon's layout and planner, the
connector's inline path, the benchmarks and the tests all import it. Standard
library only.

Terms (vLLM's offloading spec, and the daemon's pool):
- A key is vLLM's OffloadKey: a block hash followed by the KV-cache group id (the
  group's index in the model's KVCacheConfig) as 4 big-endian bytes. One key names
  one *chunk*: `blocks_per_chunk` (bpc) consecutive blocks of one group.
- A namespace holds the offloaded groups only, in vLLM's order; "group g" below is
  the g-th of them, whose keys end with the namespace's g-th group id (0..n-1 when
  every group is offloaded; the daemon's NamespaceLayout.key_group maps).
- A job names, per group g, `group_sizes[g]` block ids whose first block is block
  `block_indices[g]` of the request. The first chunk of group g therefore skips
  `block_indices[g] % bpc` sub-blocks, and block i of the group lands in chunk
  `(skip + i) // bpc` at sub-block `(skip + i) % bpc`. Keys are group-major.
- A key's pool *slot* holds one *section* per rank, side by side; inside a
  section the pages are layer-major (layer 0's bpc pages, then layer 1's, ...),
  so consecutive blocks of one layer form one contiguous run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

MAX_KEY_BYTES = 256
MIN_KEY_BYTES = 5  # at least one hash byte plus the 4-byte group id


class LayoutError(ValueError):
    """A layout, key or job does not fit the namespace (the daemon answers
    INVALID_ARGUMENT)."""


def group_of_key(key: bytes) -> int:
    """vLLM's OffloadKey ends with the group id as 4 big-endian bytes."""
    return int.from_bytes(key[-4:], "big")


def key_suffixes(group_ids: Iterable[int]) -> frozenset[bytes]:
    """The last 4 bytes of the keys of these groups (`group_of_key`'s inverse): what a
    hot path compares a key's `key[-4:]` with, to tell its group without decoding it."""
    return frozenset(g.to_bytes(4, "big") for g in group_ids)


def check_key(key: bytes, num_groups: int) -> int:
    """Validates a key's length and that its group id is below `num_groups`; returns
    the id (a namespace whose group ids are not 0..n-1 maps them itself)."""
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise LayoutError(
            f"key of {len(key)} bytes: a key is vLLM's OffloadKey (block hash + 4-byte "
            f"group id), {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes"
        )
    group = group_of_key(key)
    if group >= num_groups:
        raise LayoutError(
            f"key {key.hex()[:16]}… names group {group}, but the namespace has "
            f"{num_groups} group(s)"
        )
    return group


def chunks_per_group(
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
    num_groups: int | None = None,
) -> list[int]:
    """Keys a job must carry per group, given vLLM's group_sizes/block_indices.

    `num_groups`, when given, is checked against both lists (raises LayoutError).
    """
    if num_groups is not None:
        if len(group_sizes) != num_groups:
            raise LayoutError(
                f"group_sizes has {len(group_sizes)} entries; the namespace has "
                f"{num_groups} group(s)"
            )
        if len(block_indices) != num_groups:
            raise LayoutError(
                f"block_indices has {len(block_indices)} entries; the namespace has "
                f"{num_groups} group(s)"
            )
    bpc = blocks_per_chunk
    out = []
    for n, first in zip(group_sizes, block_indices, strict=True):
        if n < 0 or first < 0:
            raise LayoutError("group_sizes and block_indices must not be negative")
        skip = first % bpc
        out.append(0 if n == 0 else (skip + n + bpc - 1) // bpc)
    return out


def block_positions(n: int, first_index: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
    """(chunk within the group's keys, sub-block) of each of a group's `n` blocks."""
    skip = first_index % blocks_per_chunk
    return [divmod(skip + i, blocks_per_chunk) for i in range(n)]


def job_chunks(
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    blocks_per_chunk: int,
) -> Iterator[tuple[bytes, int, list[tuple[int, int]]]]:
    """(key, group, [(sub_block, block_id), ...]) per key of a job, in key order.

    A chunk with fewer than `blocks_per_chunk` entries is partial (the job
    starts or ends inside it).
    """
    pos = key_pos = 0
    for g, n in enumerate(group_sizes):
        ids = block_ids[pos : pos + n]
        pos += n
        if n == 0:
            continue
        per_chunk: dict[int, list[tuple[int, int]]] = {}
        for (c, j), block_id in zip(
            block_positions(n, block_indices[g], blocks_per_chunk), ids, strict=True
        ):
            per_chunk.setdefault(c, []).append((j, block_id))
        for c in sorted(per_chunk):
            yield keys[key_pos + c], g, per_chunk[c]
        key_pos += len(per_chunk)


def block_bytes(layer_pages: Sequence[int]) -> int:
    """One block of a group on one rank, all layers."""
    return sum(layer_pages)


def section_bytes(layer_pages: Sequence[int], blocks_per_chunk: int) -> int:
    """One rank's share of one key's slot: bpc blocks of every layer."""
    return blocks_per_chunk * sum(layer_pages)


def slot_bytes(layer_pages: Sequence[int], blocks_per_chunk: int, world_size: int) -> int:
    """One key's slot: a section per rank."""
    return world_size * section_bytes(layer_pages, blocks_per_chunk)


def page_offset(
    layer_pages: Sequence[int], blocks_per_chunk: int, rank: int, layer: int, sub_block: int
) -> int:
    """Offset inside a slot of (rank, layer, sub-block j of the chunk)."""
    return (
        rank * section_bytes(layer_pages, blocks_per_chunk)
        + blocks_per_chunk * sum(layer_pages[:layer])
        + sub_block * layer_pages[layer]
    )
