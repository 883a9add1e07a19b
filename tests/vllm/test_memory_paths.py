"""Which memory path the worker picks for plain CPU KV tensors ("auto"), and that the
reason it logs names why a faster path was out."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from kvdepot.client.vllm.memory_paths import describe_memory

pytestmark = pytest.mark.vllm

BLOCKS, PAGE = 64, 64 << 10


def caches(tensors: list[torch.Tensor]) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(len(tensors))]],
    )


def test_one_plain_allocation_is_moved_into_a_memfd() -> None:
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so its own anonymous
    # mapping, as a real engine's KV cache is; a smaller one may sit in the heap,
    # which is refused (the process's other allocations share its pages).
    backing = torch.zeros(2, 512, PAGE, dtype=torch.int8)
    views = list(backing)  # two tensors of one allocation
    views[1][3, 5] = 7  # a byte that must survive the move
    plan = describe_memory(caches(views), "auto")
    assert plan.path == "shm", plan.reason
    assert "plain CPU memory moved into a memfd in place" in plan.reason
    assert int(views[1][3, 5]) == 7


def test_when_the_memory_cannot_be_moved_the_reason_says_why() -> None:
    separate = [torch.zeros(BLOCKS, PAGE, dtype=torch.int8) for _ in range(2)]
    plan = describe_memory(caches(separate), "auto")
    assert plan.path in ("pvm", "inline")
    assert "2 separate allocations" in plan.reason, plan.reason
    if plan.path == "pvm":
        assert "not the shm path" in plan.reason
