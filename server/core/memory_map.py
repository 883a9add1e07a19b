"""A rank's registered KV memory as the planner reads it: its regions, the canonical
KV tensors in them and where each layer of each group lives, checked once against the
namespace layout when the rank registers (`MemoryMap.build`). Plain frozen values,
built by the daemon's registration code on the event loop and read by the job check
and the copy planner (kvdepot.server.core.job_check, kvdepot.server.core.planner).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.server.core.layout import LayoutError, NamespaceLayout


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

    @functools.cached_property
    def group_blocks(self) -> tuple[int, ...]:
        """Per group, the fewest blocks of the tensors its layers live in: a block id
        below it is inside every one (check_job checks a group's ids against it once,
        not once per layer)."""
        return tuple(
            min((self.tensors[r.tensor_index].num_blocks for r in refs), default=0)
            for refs in self.groups
        )
