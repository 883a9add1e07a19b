"""Extent allocator for the pool arena: best fit, coalescing, no system calls.

Slots of several sizes live side by side in one arena (models and tensor-parallel
layouts differ), so this is an extent allocator rather than a fixed-size slab.
Free extents are indexed twice:

- by offset (a sorted list) to coalesce a freed extent with its neighbours;
- by size (a sorted list of distinct sizes, each with its set of offsets) to find
  the smallest extent that fits in O(log n). The common case, a model freeing and
  re-allocating slots of one size, is an exact-size hit.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class OutOfSpace(Exception):
    """No free extent is large enough (the caller may evict and retry)."""


@dataclass(frozen=True, slots=True)
class Extent:
    offset: int
    size: int


class ExtentAllocator:
    """Hands out byte extents of a `capacity`-byte arena.

    Every size is rounded up to a multiple of `granularity` (a power of two), and
    every offset is a multiple of it, which keeps slots page-aligned for DMA.
    Not thread-safe: the daemon calls it from its event loop only.
    """

    def __init__(self, capacity: int, granularity: int = 4096) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"granularity must be a power of two, got {granularity}")
        usable = capacity - capacity % granularity
        if usable <= 0:
            raise ValueError(
                f"pool of {capacity} bytes is smaller than one {granularity}-byte unit"
            )
        self.capacity = usable
        self.granularity = granularity
        self._free_offsets: list[int] = []  # sorted
        self._free_size_at: dict[int, int] = {}  # offset -> size
        self._sizes: list[int] = []  # sorted distinct free sizes
        self._offsets_of_size: dict[int, set[int]] = {}
        self._allocated: dict[int, int] = {}  # offset -> size
        self.used_bytes = 0
        self._insert_free(0, usable)

    # -- queries ---------------------------------------------------------------------

    def round_up(self, size: int) -> int:
        g = self.granularity
        return (size + g - 1) // g * g

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free_extent(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    @property
    def free_extent_count(self) -> int:
        return len(self._free_offsets)

    def allocated_extents(self) -> dict[int, int]:
        """A copy of offset -> size of every allocated extent."""
        return dict(self._allocated)

    # -- allocation ------------------------------------------------------------------

    def allocate(self, size: int) -> Extent:
        """Returns an extent of at least `size` bytes; raises OutOfSpace."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = self.round_up(size)
        i = bisect.bisect_left(self._sizes, need)
        if i == len(self._sizes):
            raise OutOfSpace(
                f"no free extent of {need} bytes (largest is {self.largest_free_extent})"
            )
        found_size = self._sizes[i]
        offset = next(iter(self._offsets_of_size[found_size]))  # O(1); any will do
        self._remove_free(offset, found_size)
        if found_size > need:
            self._insert_free(offset + need, found_size - need)
        self._allocated[offset] = need
        self.used_bytes += need
        return Extent(offset, need)

    def allocate_at(self, offset: int, size: int) -> Extent:
        """Claims exactly [offset, offset+size) (warm restart re-attaching slots)."""
        need = self.round_up(size)
        if offset % self.granularity:
            raise ValueError(f"offset {offset} is not {self.granularity}-aligned")
        i = bisect.bisect_right(self._free_offsets, offset) - 1
        if i < 0:
            raise OutOfSpace(f"[{offset}, +{need}) is not free")
        start = self._free_offsets[i]
        length = self._free_size_at[start]
        if offset + need > start + length:
            raise OutOfSpace(f"[{offset}, +{need}) is not free")
        self._remove_free(start, length)
        if offset > start:
            self._insert_free(start, offset - start)
        end = offset + need
        if end < start + length:
            self._insert_free(end, start + length - end)
        self._allocated[offset] = need
        self.used_bytes += need
        return Extent(offset, need)

    def free(self, extent: Extent) -> None:
        size = self._allocated.pop(extent.offset, None)
        if size is None or size != extent.size:
            if size is not None:
                self._allocated[extent.offset] = size
            raise ValueError(f"double free or foreign extent {extent}")
        self.used_bytes -= size
        offset, end = extent.offset, extent.offset + size
        # Coalesce with the free neighbours on either side.
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == end:
            right = self._free_size_at[end]
            self._remove_free(end, right)
            end += right
        if i > 0:
            left_off = self._free_offsets[i - 1]
            left_size = self._free_size_at[left_off]
            if left_off + left_size == offset:
                self._remove_free(left_off, left_size)
                offset = left_off
        self._insert_free(offset, end - offset)

    def check_invariants(self) -> None:
        """Raises AssertionError if the free and allocated sets are inconsistent."""
        spans = sorted(
            [(o, s, "free") for o, s in self._free_size_at.items()]
            + [(o, s, "used") for o, s in self._allocated.items()]
        )
        pos = 0
        prev_kind = ""
        for off, size, kind in spans:
            assert off == pos, f"gap or overlap at {pos}: next span starts at {off}"
            assert not (kind == prev_kind == "free"), f"uncoalesced free extents at {off}"
            pos = off + size
            prev_kind = kind
        assert pos == self.capacity, f"spans end at {pos}, capacity {self.capacity}"
        assert self.used_bytes == sum(self._allocated.values())
        assert sorted(self._sizes) == self._sizes
        assert set(self._sizes) == set(self._free_size_at.values())

    # -- internals -------------------------------------------------------------------

    def _insert_free(self, offset: int, size: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_size_at[offset] = size
        bucket = self._offsets_of_size.get(size)
        if bucket is None:
            self._offsets_of_size[size] = {offset}
            bisect.insort(self._sizes, size)
        else:
            bucket.add(offset)

    def _remove_free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        del self._free_offsets[i]
        del self._free_size_at[offset]
        bucket = self._offsets_of_size[size]
        bucket.discard(offset)
        if not bucket:
            del self._offsets_of_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
