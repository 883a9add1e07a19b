"""What the block index's parts share (kvdepot.server.core.index.BlockIndex).

The index makes one `IndexShared` and hands it to each part (evictions, writes,
pins, recovery): the index's own namespaces dict, its allocator, its eviction
policy, its counters, where its events go and its clock. One of each, owned by the
index; the parts read and change them on the daemon's event loop only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.eviction import EvictionPolicy
from kvdepot.server.core.index_types import IndexEvent, IndexStats, Namespace


class IndexShared(NamedTuple):
    namespaces: dict[str, Namespace]
    allocator: ExtentAllocator
    policy: EvictionPolicy
    stats: IndexStats
    emit: Callable[[IndexEvent], None]
    clock: Callable[[], float]


class IndexPart:
    """A part of the index: the shared objects as its own attributes (read on the hot
    paths, so bound once here rather than looked up through `IndexShared`)."""

    def __init__(self, shared: IndexShared) -> None:
        self._namespaces = shared.namespaces
        self._allocator = shared.allocator
        self._policy = shared.policy
        self._stats = shared.stats
        self._emit = shared.emit
        self._clock = shared.clock
