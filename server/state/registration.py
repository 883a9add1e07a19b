"""A registration: one rank's KV memory (or several ranks', a canonical namespace's
units) that a session mapped through one memory path, and what its copies need of it.
Made and ended by `Sessions` (kvdepot.server.state.sessions), which keeps its regions
mapped while copies use them (`inflight`, `closing`); on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.common.kinds import MemoryPath
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import MemoryMap
from kvdepot.server.memory.copy_engine import CopyEngine
from kvdepot.server.memory.regions import MappedRegion

__all__ = ["Registration"]


@dataclass(eq=False)
class Registration:
    id: int
    session_id: str
    layout: NamespaceLayout
    rank: int
    memory_path: MemoryPath
    regions: list[MappedRegion]
    memory: MemoryMap | None  # None: inline (Put/Get only)
    engine: CopyEngine | None
    registered_bytes: int
    # The device that makes this registration's copies (CopyEngine.copy_device: its
    # key and PCI address; None: the CPUs): its jobs go to that device's copy threads.
    copy_device: tuple[str, str] | None = None
    inflight: int = 0  # copies using the regions now
    closing: bool = False  # ended; unmapped when the last copy ends
    # A registration of several ranks (RegisterKVRequest.unit_count > 1): the memory of
    # each of ranks rank + 1, rank + 2, ... (`memory` is rank's), each unit's pages
    # one page after the one before in every layer's tensor page. Empty: rank alone.
    more_units: tuple[MemoryMap, ...] = ()

    @property
    def unit_count(self) -> int:
        return 1 + len(self.more_units)

    def units(self) -> list[tuple[int, MemoryMap]]:
        """(rank, memory) of each rank this registration stands for, in rank order."""
        assert self.memory is not None
        return [(self.rank, self.memory)] + [
            (self.rank + 1 + k, m) for k, m in enumerate(self.more_units)
        ]

    def close_regions(self) -> None:
        for r in self.regions:
            r.close()
        self.regions = []
