"""The client side without CUDA: the module imports, tensors are grouped into regions
and vLLM's canonical views placed.
"""

from __future__ import annotations

import pytest

# -- the client side, without CUDA ----------------------------------------------------------


def test_client_module_imports_without_cuda_and_groups_tensors_into_regions() -> None:
    from kvdepot.client import cuda_ipc

    ps = [cuda_ipc.TensorPlacement(0x10000 + i * 0x1000, 4, 0x400, 0x400) for i in range(3)]
    allocs = [(0x10000, 0x10000)] * 3
    regions, tensors = cuda_ipc.group_regions(ps, allocs)
    assert regions == [(0x10000, 0, 0x2000 + 3 * 0x400 + 0x400)]
    assert [t.region_offset for t in tensors] == [0, 0x1000, 0x2000]
    assert all(t.region_index == 0 and t.block_stride_bytes == 0x400 for t in tensors)
    # Two allocations: two regions, offsets relative to each region's first byte.
    ps2 = [cuda_ipc.TensorPlacement(0x50000 + 0x800, 2, 0x100, 0x80)]
    regions, tensors = cuda_ipc.group_regions([*ps, *ps2], [*allocs, (0x50000, 0x1000)])
    assert regions[1] == (0x50000, 0x800, 0x180) and tensors[3].region_index == 1
    assert tensors[3].region_offset == 0
    with pytest.raises(ValueError, match="leave their allocation"):
        cuda_ipc.group_regions(ps2, [(0x50000, 0x100)])


def test_tensor_placement_reads_vllm_canonical_views() -> None:
    torch = pytest.importorskip("torch")
    from kvdepot.client.cuda_ipc import tensor_placement

    backing = torch.zeros(4 * 8 * 1024, dtype=torch.int8)
    layer = backing.view(4, 8, 1024)[:, 2]  # block stride 8 KiB, page 1 KiB
    p = tensor_placement(layer)
    assert (p.num_blocks, p.block_stride, p.page_bytes) == (4, 8192, 1024)
    assert p.ptr == backing.data_ptr() + 2048 and p.end == p.ptr + 3 * 8192 + 1024
    with pytest.raises(ValueError, match="2-D"):
        tensor_placement(backing)
    with pytest.raises(ValueError, match="contiguous"):
        tensor_placement(backing.view(4, 8192)[:, ::2])
