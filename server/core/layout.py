"""Namespace layouts: how one chunk of one KV-cache group is laid out in a pool slot.

A slot holds one key (one chunk of `blocks_per_chunk` GPU blocks of one group) for
every rank: `world_size` equal sections side by side. Inside a rank's section the
pages are layer-major: layer 0's `blocks_per_chunk` pages, then layer 1's, and so
on, so that consecutive GPU blocks of one layer land in one contiguous run. The
arithmetic itself lives in kvdepot.common.chunks (shared with the clients).

A layout's groups are the offloaded ones, in the order a job lists them; a key
names its group by the model's group id (its last 4 bytes), which skips groups the
engine does not offload. `group_ids` maps one to the other, once: everything past
`key_group` speaks of a group by its index in `groups`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kvdepot.common import chunks
from kvdepot.common.chunks import (
    MAX_KEY_BYTES,
    MIN_KEY_BYTES,
    LayoutError,
    check_key,
    group_of_key,
)

MAX_WORLD_SIZE = 64  # written-rank sets are 64-bit masks
MAX_BLOCKS_PER_CHUNK = 4096
# A layout's size bounds what registering it (and every job's planning) costs the
# event loop: 64 groups x 4096 layers took 98 ms per RegisterKV. Real models need
# far less: Llama-3-405B has 126 layers in one group, hybrid models a few groups.
MAX_GROUPS = 16
MAX_LAYOUT_LAYERS = 1024  # layers of all groups together
MAX_LAYERS_PER_GROUP = MAX_LAYOUT_LAYERS
MAX_PAGE_BYTES = 1 << 30

__all__ = [
    "MAX_GROUPS",
    "MAX_KEY_BYTES",
    "MAX_LAYOUT_LAYERS",
    "MIN_KEY_BYTES",
    "LayoutError",
    "NamespaceLayout",
    "check_key",
    "check_namespace_id",
    "group_of_key",
]


def check_namespace_id(namespace_id: str) -> None:
    """A namespace id: 1 to 128 printable characters (LayoutError otherwise). An
    observer join (a layout of the id alone) is checked with this only."""
    if not 1 <= len(namespace_id) <= 128 or not namespace_id.isprintable():
        raise LayoutError("namespace id must be 1 to 128 printable characters")


@dataclass(frozen=True)
class NamespaceLayout:
    """The byte layout every engine of a namespace shares."""

    id: str
    world_size: int
    blocks_per_chunk: int
    groups: tuple[tuple[int, ...], ...]  # per group: page bytes of each layer
    description: str = ""
    # Per group: the id its keys carry in their last 4 bytes. Empty when declared:
    # 0, 1, ... in order (what a layout without ids always meant).
    group_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        check_namespace_id(self.id)
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise LayoutError(f"world_size {self.world_size} out of range [1, {MAX_WORLD_SIZE}]")
        if not 1 <= self.blocks_per_chunk <= MAX_BLOCKS_PER_CHUNK:
            raise LayoutError(
                f"blocks_per_chunk {self.blocks_per_chunk} out of range [1, {MAX_BLOCKS_PER_CHUNK}]"
            )
        if not 1 <= len(self.groups) <= MAX_GROUPS:
            raise LayoutError(
                f"a namespace needs 1 to {MAX_GROUPS} groups (MAX_GROUPS), got {len(self.groups)}"
            )
        layers = sum(len(pages) for pages in self.groups)
        if layers > MAX_LAYOUT_LAYERS:
            raise LayoutError(
                f"a namespace has at most {MAX_LAYOUT_LAYERS} layers over all its groups "
                f"(MAX_LAYOUT_LAYERS), got {layers}"
            )
        if not self.group_ids:
            object.__setattr__(self, "group_ids", tuple(range(len(self.groups))))
        if len(self.group_ids) != len(self.groups):
            raise LayoutError(
                f"{len(self.group_ids)} group id(s) for {len(self.groups)} group(s): one "
                f"per group, or none for 0, 1, ..."
            )
        if len(set(self.group_ids)) != len(self.group_ids):
            raise LayoutError(f"group ids {list(self.group_ids)} name a group twice")
        if not all(0 <= g < 1 << 32 for g in self.group_ids):
            raise LayoutError("a group id is a key's last 4 bytes: 0 to 2**32 - 1")
        for g, pages in enumerate(self.groups):
            if not 1 <= len(pages) <= MAX_LAYERS_PER_GROUP:
                raise LayoutError(f"group {g} needs 1 to {MAX_LAYERS_PER_GROUP} layers")
            for page in pages:
                if not 1 <= page <= MAX_PAGE_BYTES:
                    raise LayoutError(
                        f"group {g} has a layer page of {page} bytes; pages are 1 byte to 1 GiB"
                    )

    def same_bytes_as(self, other: NamespaceLayout) -> bool:
        """True when the two layouts are byte-compatible (description aside)."""
        return (self.world_size, self.blocks_per_chunk, self.groups, self.group_ids) == (
            other.world_size,
            other.blocks_per_chunk,
            other.groups,
            other.group_ids,
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @cached_property
    def group_of_suffix(self) -> dict[bytes, int]:
        """A key's last 4 bytes -> its group's index in `groups` (read only)."""
        return {g.to_bytes(4, "big"): i for i, g in enumerate(self.group_ids)}

    @property
    def default_group_ids(self) -> bool:
        """Whether the groups are 0, 1, ... (a layout that need not say its ids)."""
        return self.group_ids == tuple(range(len(self.groups)))

    def key_group(self, key: bytes) -> int:
        """The index in `groups` of `key`'s group; LayoutError when the key's length is
        wrong or it names a group the namespace does not hold."""
        if MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            index = self.group_of_suffix.get(key[-4:])
            if index is not None:
                return index
        check_key(key, 1 << 32)  # raises when the length is wrong
        held = ", ".join(map(str, self.group_ids))
        raise LayoutError(
            f"key {key.hex()[:16]}… names group {group_of_key(key)}, but the namespace "
            f"holds group(s) {held}"
        )

    def block_bytes(self, group: int) -> int:
        """One GPU block of the group on one rank, all layers."""
        return chunks.block_bytes(self.groups[group])

    def section_bytes(self, group: int) -> int:
        """One rank's share of one slot."""
        return chunks.section_bytes(self.groups[group], self.blocks_per_chunk)

    def slot_bytes(self, group: int) -> int:
        return chunks.slot_bytes(self.groups[group], self.blocks_per_chunk, self.world_size)

    def page_offset(self, group: int, rank: int, layer: int, sub_block: int) -> int:
        """Offset inside a slot of (rank, layer, sub-block j of the chunk)."""
        return chunks.page_offset(self.groups[group], self.blocks_per_chunk, rank, layer, sub_block)

    def chunks_per_group(
        self, group_sizes: list[int] | tuple[int, ...], block_indices: list[int] | tuple[int, ...]
    ) -> list[int]:
        """Keys a job must carry per group, given vLLM's group_sizes/block_indices."""
        return chunks.chunks_per_group(
            group_sizes, block_indices, self.blocks_per_chunk, self.num_groups
        )
