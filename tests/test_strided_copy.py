"""Strided copies (server/memory/strided.py): runs grouped into progressions copy the
same bytes as one memmove per run, whatever the runs' order, sizes and steps."""

from __future__ import annotations

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.memory.strided import copy_ops, find_progressions, run_ops

PAGE = 64
SLOTS = 48


def _copy_both_ways(src_pages: list[int], dst_pages: list[int], sizes: list[int]) -> list:
    """Copies runs (page numbers on each side) run by run and with `copy_ops` (the
    destination side playing the pool); the bytes must match. Returns the ops."""
    rng = np.random.default_rng(len(src_pages))
    src = rng.integers(0, 256, SLOTS * PAGE, dtype=np.uint8)
    by_run = np.zeros(SLOTS * PAGE, dtype=np.uint8)
    by_ops = np.zeros(SLOTS * PAGE, dtype=np.uint8)
    s = np.array([src.ctypes.data + p * PAGE for p in src_pages], dtype=np.int64)
    n = np.array(sizes, dtype=np.int64)
    for d, sa, k in zip(dst_pages, s.tolist(), sizes, strict=True):
        ctypes.memmove(by_run.ctypes.data + d * PAGE, sa, k)
    d = np.array([by_ops.ctypes.data + p * PAGE for p in dst_pages], dtype=np.int64)
    ops = copy_ops(d, s, n, d)
    run_ops(ops)
    assert np.array_equal(by_run, by_ops)
    return ops


def _grid(layers: int, blocks: list[int], slots: list[int], layer_pages: int):
    """A store's runs in plan order (layer-major): layer l of block b (the layer
    tensors `layer_pages` apart) into page l of slot s (slots of `layers` pages)."""
    src = [layer * layer_pages + b for layer in range(layers) for b in blocks]
    dst = [s * layers + layer for layer in range(layers) for s in slots]
    return src, dst


def test_consecutive_blocks_into_side_by_side_slots_copy_a_layer_at_a_time() -> None:
    src, dst = _grid(3, [5, 6, 7, 8], [0, 1, 2, 3], 12)
    ops = _copy_both_ways(src, dst, [PAGE] * 12)
    assert [op[0].shape for op in ops] == [(4, PAGE)] * 3  # one view pair per layer


def test_scattered_blocks_copy_a_key_at_a_time() -> None:
    # Block ids out of order (as after some churn): in the pool's order each key's
    # layers step by one layer tensor on the source and one page on the destination.
    src, dst = _grid(4, [9, 2, 7, 0], [3, 0, 1, 2], 12)
    ops = _copy_both_ways(src, dst, [PAGE] * 16)
    assert [op[0].shape for op in ops] == [(4, PAGE)] * 4  # one view pair per key


def test_runs_without_progressions_stay_one_memmove_each() -> None:
    ops = _copy_both_ways([9, 2, 30, 4, 17], [1, 7, 3, 40, 22], [PAGE] * 5)
    assert all(len(op) == 3 for op in ops) and len(ops) == 5


def test_progressions_found_greedily() -> None:
    progs = find_progressions(
        np.array([0, 100, 200, 300, 50, 60]),
        np.array([7, 9, 11, 13, 1000, 990]),
        np.array([10, 10, 10, 10, 10, 10]),
    )
    assert progs == [(0, 7, 4, 100, 2, 10), (50, 1000, 2, 10, -10, 10)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, SLOTS - 1), st.sampled_from([PAGE, PAGE // 2, 8])),
        min_size=1,
        max_size=SLOTS,
    ),
    st.permutations(range(SLOTS)),
)
def test_any_runs_copy_the_same_bytes(runs: list[tuple[int, int]], dst_order: list[int]) -> None:
    # Destinations distinct (as the planner's are); sources may repeat.
    _copy_both_ways([r[0] for r in runs], dst_order[: len(runs)], [r[1] for r in runs])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(-3, 3), st.integers(1, 6)), max_size=5))
def test_runs_made_of_progressions_copy_the_same_bytes(
    pieces: list[tuple[int, int, int]],
) -> None:
    # Progressions (steps in pages, any sign, 0 on the source too) end to end; the
    # destination pages must stay distinct, so pieces that would reuse one are cut short.
    src, dst, used = [], [], set()
    s, d = SLOTS // 2, SLOTS // 2
    for s_step, d_step, count in pieces:
        for _ in range(count):
            if not (0 <= s < SLOTS and 0 <= d < SLOTS) or d in used:
                break
            src.append(s)
            dst.append(d)
            used.add(d)
            s, d = s + s_step, d + d_step
        s, d = (s * 7 + 3) % SLOTS, (d * 5 + 1) % SLOTS
    if src:
        _copy_both_ways(src, dst, [PAGE] * len(src))
