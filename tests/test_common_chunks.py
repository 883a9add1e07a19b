"""kvdepot.common.chunks: the one chunk/section arithmetic, checked against the
daemon's planner (which copies by it) and importable without the daemon."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.common.chunks import (
    LayoutError,
    block_positions,
    check_key,
    chunks_per_group,
    job_chunks,
    page_offset,
    section_bytes,
    slot_bytes,
)
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.core.planner import plan_job


def key(i: int, group: int) -> bytes:
    return i.to_bytes(8, "big") + group.to_bytes(4, "big")


@settings(max_examples=200, deadline=None)
@given(
    bpc=st.integers(1, 5),
    sizes=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    firsts=st.lists(st.integers(0, 20), min_size=3, max_size=3),
)
def test_job_chunks_puts_every_block_where_the_planner_copies_it(
    bpc: int, sizes: list[int], firsts: list[int]
) -> None:
    """Each block's (key, sub-block) from job_chunks is the slot position the
    daemon's planner copies that block's page to (one 1-byte page per block)."""
    groups = len(sizes)
    firsts = firsts[:groups]
    layout = NamespaceLayout("ns", 1, bpc, ((1,),) * groups)
    per_group = chunks_per_group(sizes, firsts, bpc, groups)
    keys = [key(c, g) for g, n in enumerate(per_group) for c in range(n)]
    num_blocks = sum(sizes) + 1
    block_ids = list(range(sum(sizes)))
    memory = MemoryMap.build(
        layout,
        [num_blocks * groups],
        [TensorView(0, g * num_blocks, num_blocks, 1, 1) for g in range(groups)],
        [[LayerRef(g, 0, 1)] for g in range(groups)],
    )
    slot = 1000  # slot k at pool offset k * slot: a page's pool offset names its key
    plan = plan_job(
        layout, 0, memory, block_ids, sizes, firsts, [k * slot for k in range(len(keys))]
    )
    copied = {}
    for _, region_off, pool_off, n in plan.runs:
        for i in range(n):
            copied[(region_off + i) % num_blocks] = divmod(pool_off + i, slot)
    expected = {}
    for k, g, subs in job_chunks(keys, block_ids, sizes, firsts, bpc):
        assert check_key(k, groups) == g
        for sub, block_id in subs:
            expected[block_id] = (keys.index(k), sub)
    assert copied == expected
    assert len(list(job_chunks(keys, block_ids, sizes, firsts, bpc))) == len(keys)


def test_positions_sections_and_offsets() -> None:
    assert block_positions(5, 3, 4) == [(0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert chunks_per_group([5, 0], [3, 7], 4) == [2, 0]
    pages = (100, 50)
    assert section_bytes(pages, 4) == 600 and slot_bytes(pages, 4, 2) == 1200
    assert page_offset(pages, 4, rank=1, layer=1, sub_block=2) == 600 + 400 + 100


@pytest.mark.parametrize(
    ("sizes", "firsts", "groups", "words"),
    [
        ([1], [0, 0], 2, "group_sizes has 1"),
        ([1, 1], [0], 2, "block_indices has 1"),
        ([-1], [0], 1, "must not be negative"),
    ],
)
def test_bad_job_shapes_say_what_is_wrong(
    sizes: list[int], firsts: list[int], groups: int, words: str
) -> None:
    with pytest.raises(LayoutError, match=words):
        chunks_per_group(sizes, firsts, 2, groups)


def test_importable_without_the_daemon_or_grpc() -> None:
    """The connector imports it in vLLM's processes: standard library only."""
    code = (
        "import sys, kvdepot.common.chunks, kvdepot.common.kinds\n"
        "bad = [m for m in sys.modules if m.startswith(('grpc', 'google', 'kvdepot.server',"
        " 'kvdepot.client', 'numpy'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
