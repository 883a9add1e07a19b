"""ExtentAllocator: best fit, coalescing, accounting (sans-I/O, fast)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.core.allocator import Extent, ExtentAllocator, OutOfSpace


def test_sizes_round_up_to_granularity_and_extents_are_aligned() -> None:
    a = ExtentAllocator(1 << 20, granularity=4096)
    e = a.allocate(5000)
    assert e.size == 8192 and e.offset % 4096 == 0
    assert a.used_bytes == 8192
    a.check_invariants()


def test_free_coalesces_neighbours_back_into_one_extent() -> None:
    a = ExtentAllocator(64 * 4096)
    exts = [a.allocate(4096) for _ in range(64)]
    assert a.largest_free_extent == 0
    with pytest.raises(OutOfSpace):
        a.allocate(1)
    for e in exts[::2]:
        a.free(e)
    assert a.largest_free_extent == 4096 and a.free_extent_count == 32
    for e in exts[1::2]:
        a.free(e)
    assert a.largest_free_extent == a.capacity and a.free_extent_count == 1
    a.check_invariants()


def test_mixed_sizes_coexist_and_best_fit_keeps_large_extents() -> None:
    a = ExtentAllocator(16 * 4096)
    small = a.allocate(4096)
    big = a.allocate(8 * 4096)
    a.free(small)
    # The one-page hole is the best fit for a one-page request.
    again = a.allocate(4096)
    assert again.offset == small.offset
    assert a.largest_free_extent == 7 * 4096
    a.free(big)
    a.check_invariants()


def test_double_free_and_foreign_extents_are_refused() -> None:
    a = ExtentAllocator(1 << 16)
    e = a.allocate(4096)
    a.free(e)
    with pytest.raises(ValueError):
        a.free(e)
    with pytest.raises(ValueError):
        a.free(Extent(8192, 4096))
    a.check_invariants()


def test_allocate_at_claims_exact_ranges_for_reattaching() -> None:
    a = ExtentAllocator(16 * 4096)
    a.allocate_at(4 * 4096, 2 * 4096)
    a.allocate_at(0, 4096)
    with pytest.raises(OutOfSpace):
        a.allocate_at(5 * 4096, 4096)  # overlaps
    assert a.used_bytes == 3 * 4096
    a.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=200), st.integers(0, 2**32)
)
def test_random_alloc_free_keeps_invariants(ops: list[tuple[bool, int]], seed: int) -> None:
    rng = random.Random(seed)
    a = ExtentAllocator(256 * 4096)
    live: list[Extent] = []
    for do_alloc, size in ops:
        if do_alloc or not live:
            try:
                live.append(a.allocate(size))
            except OutOfSpace:
                assert a.largest_free_extent < a.round_up(size)
        else:
            a.free(live.pop(rng.randrange(len(live))))
        a.check_invariants()
    spans = sorted((e.offset, e.offset + e.size) for e in live)
    assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans))
    for e in live:
        a.free(e)
    assert a.used_bytes == 0 and a.largest_free_extent == a.capacity
