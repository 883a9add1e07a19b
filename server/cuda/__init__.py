"""The CUDA data path: CUDA IPC registrations, a page-locked pool, batched DMA.

Imports nothing beyond the standard library until used, so a daemon (or a
client) on a host without CUDA loads it at no cost; `cuda_available()` is False
there and `enable_cuda` leaves the daemon on the CPU path.
"""

from kvdepot.common.cuda_driver import cuda_available, unavailable_reason
from kvdepot.server.cuda.enable import CudaPath, cuda_path, enable_cuda

__all__ = ["CudaPath", "cuda_available", "cuda_path", "enable_cuda", "unavailable_reason"]
