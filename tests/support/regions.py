"""A numpy array as a MappedRegion: copy engines only need an address and a size."""

from __future__ import annotations

import numpy as np

from kvdepot.server.memory.copy_engine import MappedRegion


class ArrayRegion(MappedRegion):
    kind = "test"

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr  # keeps the memory alive
        self.size = arr.nbytes
        self.address = arr.ctypes.data

    def close(self) -> None:
        pass
