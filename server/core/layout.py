"""Namespace layouts: how one chunk of one KV-cache group is laid out in a pool slot.

A slot holds one key (one chunk of `blocks_per_chunk` GPU blocks of one group) for
every rank: `world_size` equal sections side by side. Inside a rank's section the
pages are layer-major: layer 0's `blocks_per_chunk` pages, then layer 1's, and so
on, so that consecutive GPU blocks of one layer land in one contiguous run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

MAX_WORLD_SIZE = 64  # written-rank sets are 64-bit masks
MAX_BLOCKS_PER_CHUNK = 4096
MAX_LAYERS_PER_GROUP = 4096
MAX_GROUPS = 64
MAX_PAGE_BYTES = 1 << 30
MAX_KEY_BYTES = 256
MIN_KEY_BYTES = 5  # at least one hash byte plus the 4-byte group index


class LayoutError(ValueError):
    """A layout, key or job does not fit the namespace (maps to INVALID_ARGUMENT)."""


def group_of_key(key: bytes) -> int:
    """vLLM's OffloadKey ends with the group index as 4 big-endian bytes."""
    return int.from_bytes(key[-4:], "big")


def check_key(key: bytes, num_groups: int) -> int:
    """Validates a key's length and group suffix; returns its group index."""
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise LayoutError(
            f"key of {len(key)} bytes: a key is vLLM's OffloadKey (block hash + 4-byte "
            f"group index), {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes"
        )
    group = group_of_key(key)
    if group >= num_groups:
        raise LayoutError(
            f"key {key.hex()[:16]}… names group {group}, but the namespace has "
            f"{num_groups} group(s)"
        )
    return group


@dataclass(frozen=True)
class NamespaceLayout:
    """The byte layout every engine of a namespace shares."""

    id: str
    world_size: int
    blocks_per_chunk: int
    groups: tuple[tuple[int, ...], ...]  # per group: page bytes of each layer
    description: str = ""

    def __post_init__(self) -> None:
        if not 1 <= len(self.id) <= 128 or not self.id.isprintable():
            raise LayoutError("namespace id must be 1 to 128 printable characters")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise LayoutError(
                f"world_size {self.world_size} out of range [1, {MAX_WORLD_SIZE}]"
            )
        if not 1 <= self.blocks_per_chunk <= MAX_BLOCKS_PER_CHUNK:
            raise LayoutError(
                f"blocks_per_chunk {self.blocks_per_chunk} out of range "
                f"[1, {MAX_BLOCKS_PER_CHUNK}]"
            )
        if not 1 <= len(self.groups) <= MAX_GROUPS:
            raise LayoutError(f"a namespace needs 1 to {MAX_GROUPS} groups, got {len(self.groups)}")
        for g, pages in enumerate(self.groups):
            if not 1 <= len(pages) <= MAX_LAYERS_PER_GROUP:
                raise LayoutError(f"group {g} needs 1 to {MAX_LAYERS_PER_GROUP} layers")
            for page in pages:
                if not 1 <= page <= MAX_PAGE_BYTES:
                    raise LayoutError(
                        f"group {g} has a layer page of {page} bytes; pages are 1 byte "
                        f"to 1 GiB"
                    )

    def same_bytes_as(self, other: NamespaceLayout) -> bool:
        """True when the two layouts are byte-compatible (description aside)."""
        return (self.world_size, self.blocks_per_chunk, self.groups) == (
            other.world_size,
            other.blocks_per_chunk,
            other.groups,
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @cached_property
    def _layer_prefix(self) -> tuple[tuple[int, ...], ...]:
        out = []
        for pages in self.groups:
            acc, prefix = 0, []
            for p in pages:
                prefix.append(acc)
                acc += p
            out.append(tuple(prefix))
        return tuple(out)

    def block_bytes(self, group: int) -> int:
        """One GPU block of the group on one rank, all layers."""
        return sum(self.groups[group])

    def section_bytes(self, group: int) -> int:
        """One rank's share of one slot."""
        return self.blocks_per_chunk * self.block_bytes(group)

    def slot_bytes(self, group: int) -> int:
        return self.world_size * self.section_bytes(group)

    def page_offset(self, group: int, rank: int, layer: int, sub_block: int) -> int:
        """Offset inside a slot of (rank, layer, sub-block j of the chunk)."""
        return (
            rank * self.section_bytes(group)
            + self.blocks_per_chunk * self._layer_prefix[group][layer]
            + sub_block * self.groups[group][layer]
        )

    def chunks_per_group(
        self, group_sizes: list[int] | tuple[int, ...], block_indices: list[int] | tuple[int, ...]
    ) -> list[int]:
        """Keys a job must carry per group, given vLLM's group_sizes/block_indices."""
        if len(group_sizes) != self.num_groups:
            raise LayoutError(
                f"group_sizes has {len(group_sizes)} entries; the namespace has "
                f"{self.num_groups} group(s)"
            )
        if len(block_indices) != self.num_groups:
            raise LayoutError(
                f"block_indices has {len(block_indices)} entries; the namespace has "
                f"{self.num_groups} group(s)"
            )
        bpc = self.blocks_per_chunk
        out = []
        for n, first in zip(group_sizes, block_indices, strict=True):
            if n < 0 or first < 0:
                raise LayoutError("group_sizes and block_indices must not be negative")
            skip = first % bpc
            out.append(0 if n == 0 else (skip + n + bpc - 1) // bpc)
        return out
