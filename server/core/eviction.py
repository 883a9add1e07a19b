"""Which evictable block row goes first: the eviction policy behind the block index.

The index (`kvdepot.server.core.index.BlockIndex`) decides *whether* a row may be
evicted (READY, no pin, no reader, not dropped) and does the evicting; a policy only
keeps the evictable rows in the order they are to go. Its calls, all from the index,
on the daemon's event loop (a policy has no lock, no clock and no I/O):

- `admit(slot)`: the row became evictable (it became READY, or its last pin or
  read ended); this is its most recent use. A row is admitted at most once until
  it is withdrawn or popped.
- `withdraw(slot)`: an admitted row is no longer evictable (pinned, read, or
  removed by Evict/Clear).
- `refresh(slot)`: an admitted row was used without being held (a request that
  offered or reached it again: `BlockIndex.touch`); it becomes the most recent.
- `pop_victim()`: takes the row to evict next out of the policy; None when no row
  is evictable.
- `len()`, iteration (next victim first), `in`: for figures, warm-restart
  snapshots and the index's invariant check.

A lookup is not a use: an engine's scheduler looks up keys it may never load. A
use is a store, a pin or a read (a row in use is not evictable, so that use is its
withdrawal and re-admission), or a touch: the connector names the chunks a finished
request offered or loaded again, which costs no copy. This is the shape of vLLM's
`kv_offload.cpu.policies.base.CachePolicy` (insert/touch/evict,
mark_evictable/mark_non_evictable), less the slot storage, which the index keeps.

**Prefixes, not chunks.** A lookup walks a request's chunks from the first and stops
at the first miss, so a chunk is worth keeping only while every chunk before it is
kept. Rows used together (a store job's, a load's, a touch's: one request's chunks,
group-major and chunks ascending) are therefore admitted tail first
(`tail_first`): the head of a prefix is always younger than its tail, eviction
takes tails first, and what stays is a loadable prefix, never a hole followed by
chunks no lookup reaches. vLLM 0.33's CPU tier ranks a request's chunks the same
way (its `LRUCachePolicy`: rank (request, -position)).

`LruPolicy`, least recently used first, is the one the daemon runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from kvdepot.server.core.index_types import Slot


class EvictionPolicy(Protocol):
    """The order in which evictable rows go (see the module docstring)."""

    # Callables rather than methods in the interface, so that an implementation
    # may bind C functions there (LruPolicy does); a plain method serves as well.
    admit: Callable[[Slot], object]
    withdraw: Callable[[Slot], object]
    refresh: Callable[[Slot], object]

    def admit_coldest(self, slot: Slot) -> object:
        """Admits `slot` as the next victim: a hold that was not a use ended (the disk
        tier wrote the cold row behind; kvdepot.server.disk.link)."""
        ...

    def pop_victim(self) -> Slot | None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Slot]: ...

    def __contains__(self, slot: object) -> bool: ...


class LruPolicy:
    """Evicts the least recently used row first: an ordered dict, oldest first."""

    __slots__ = ("_order", "admit", "refresh", "withdraw")

    def __init__(self) -> None:
        order: OrderedDict[Slot, None] = OrderedDict()
        self._order = order
        # The dict's own C methods, bound once: the index calls these once per key
        # on its hottest paths (a Pin's keys, a load's reads, a store's rows becoming
        # READY), where a Python method would add a frame per key.
        # setdefault(slot) appends slot -> None at the young end (it is not there:
        # a row is admitted once); `del` raises KeyError for a row never admitted.
        self.admit: Callable[[Slot], object] = order.setdefault
        self.withdraw: Callable[[Slot], object] = order.__delitem__
        self.refresh: Callable[[Slot], object] = order.move_to_end

    def admit_coldest(self, slot: Slot) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot, last=False)

    def pop_victim(self) -> Slot | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._order)

    def __contains__(self, slot: object) -> bool:
        return slot in self._order


def tail_first(slots: Sequence[Slot]) -> Sequence[Slot]:
    """`slots` used together, in a job's order (group-major, chunks ascending), in the
    order to admit them: each group's last chunk first, its first chunk last, so that
    a request's head ends up youngest (see "Prefixes, not chunks" above).

    With several groups, chunks go by their distance from their group's last chunk
    (the chunks of one token position together: a hybrid model's prefix needs every
    group's chunk of it, and a sliding-window group stores only the last few)."""
    n = len(slots)
    if n < 2 or slots[0].group == slots[-1].group:  # one group: the common case
        return slots[::-1]
    from_end = [0] * n
    end = n - 1
    for i in range(n - 1, -1, -1):
        if slots[i].group != slots[end].group:
            end = i
        from_end[i] = end - i
    return [slots[i] for i in sorted(range(n), key=from_end.__getitem__)]
