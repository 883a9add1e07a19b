"""The CUDA data path's pure-Python pieces, on CPU: handles, DMA planning, the copy
engine and the registration lifecycle (real DepotState, a fake CUDA driver whose
"device memory" is host memory), pinning, and enabling CUDA on a host without it.

What needs a GPU (the real driver, IPC across processes, DMA speed) is in tests/gpu/.

The fake driver is tests/support/fake_cuda.py; the `state` fixture (a real DepotState)
is in tests/cuda/conftest.py.
"""
