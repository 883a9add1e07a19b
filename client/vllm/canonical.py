"""A worker rank's place in a canonical namespace: the KV-head units its pages hold.

In a canonical namespace (docs/architecture.md §4; client/vllm/namespace.py) a block
row holds one section per KV head of the model (a *unit*), so engines of every TP
size write and read the same rows. vLLM 0.33 certifies, per layer and rank, how the
rank's page maps into the topology-free canonical page (all heads of one block:
`CanonicalKVCacheRef.mapping`, derived by `derive_canonical_mappings` in every
worker's `register_kv_caches`). Under the LBHNC layout with K and V packed per head
a rank's mapping is one run: its whole page at `head_shard x page` of the canonical
page, head after head. The rank then stands for the consecutive units its page
covers, each unit's page a slice of the rank's page at `k x unit page`; at TP larger
than the heads, ranks that hold the same head stand for the same unit (its first
writer copies, the others find it written).

Anything else (no mapping: vLLM could not certify the layer; a mapping that is not
parallelism-agnostic; runs that are not the whole page in one piece, as under NHD or
split K/V) is refused here: such a rank must not write into a canonical namespace.
Pure functions of vLLM's refs, called once when the worker is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches


class Uncertified(ValueError):
    """This rank's pages cannot be split into the namespace's units (the reason)."""


@dataclass(frozen=True)
class UnitSpan:
    """The units [first, first + count) a rank's pages hold."""

    first: int
    count: int
    # Per offloaded group, one unit's page of each layer (the namespace layout's pages).
    layer_pages: list[list[int]]


def _layer_span(ref: CanonicalKVCacheRef, units: int, where: str) -> tuple[int, int, int]:
    """(first unit, units, unit page) of one layer's page."""
    mapping = ref.mapping
    if mapping is None:
        raise Uncertified(f"{where}: vLLM did not certify its canonical mapping")
    if not mapping.parallelism_agnostic:
        raise Uncertified(f"{where}: vLLM's mapping is not independent of the parallel layout")
    page = ref.page_size_bytes
    if mapping.local_page_size_bytes != page or mapping.canonical_page_size_bytes % units:
        raise Uncertified(f"{where}: the canonical page does not split into {units} units")
    unit = mapping.canonical_page_size_bytes // units
    runs = mapping.runs
    whole = (
        len(runs) == 1
        and runs[0].local_offset == 0
        and runs[0].fragment_size * runs[0].num_fragments == page
        and (
            runs[0].num_fragments == 1
            or runs[0].local_stride == runs[0].canonical_stride == runs[0].fragment_size
        )
    )
    if not whole:
        raise Uncertified(
            f"{where}: the page maps into the canonical page in {len(runs)} run(s), not as "
            f"one contiguous slice (kvdepot needs LBHNC with K and V packed per head)"
        )
    offset = runs[0].canonical_offset
    if unit == 0 or page % unit or offset % unit:
        raise Uncertified(f"{where}: the page is not a whole number of {unit}-byte units")
    return offset // unit, page // unit, unit


def unit_span(kv_caches: CanonicalKVCaches, units: int) -> UnitSpan:
    """The units this rank's pages hold in a namespace of `units` (the model's KV heads).
    Raises Uncertified (with the reason) where any layer's page cannot be split so, or
    its layers disagree on the units."""
    span: tuple[int, int] | None = None
    pages: list[list[int]] = []
    for g, refs in enumerate(kv_caches.group_data_refs):
        group_pages = []
        for i, ref in enumerate(refs):
            first, count, unit = _layer_span(ref, units, f"group {g} layer {i}")
            if span is not None and span != (first, count):
                raise Uncertified(
                    f"group {g} layer {i} holds units {first}..{first + count - 1}, another "
                    f"layer {span[0]}..{span[0] + span[1] - 1}"
                )
            span = (first, count)
            group_pages.append(unit)
        pages.append(group_pages)
    if span is None:
        raise Uncertified("no offloaded layer")
    return UnitSpan(span[0], span[1], pages)
