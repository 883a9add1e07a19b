"""Which evictable block row goes first: the eviction policy behind the block index.

The index (`kvdepot.server.core.index.BlockIndex`) decides *whether* a row may be
evicted (READY, no pin, no reader, not dropped) and does the evicting; a policy only
keeps the evictable rows in the order they are to go. Its calls, all from the index,
on the daemon's event loop (a policy has no lock, no clock and no I/O):

- `insert(slots)`: new rows became READY together (a store job's, a tier's
  promotion, a warm restart's), in the order to admit them (`tail_first`); each is
  admitted as its most recent use. A row is admitted (by `insert`, `admit` or
  `admit_coldest`) at most once until it is withdrawn or popped.
- `admit(slot)`: a row's last pin or read ended: it is evictable again, and this was
  its most recent use.
- `withdraw(slot)`: an admitted row is no longer evictable (pinned, read, or
  removed by Evict/Clear).
- `admit_coldest(slot)`: a row popped off and passed over (kept in place by a
  tier writing it behind, or spared by its namespace's share) goes back to the old
  end: rows passed over are put back coldest last, so they keep their order.
- `refresh(slot)`: an admitted row was used without being held (a request that
  offered or reached it again: `BlockIndex.touch`); it becomes the most recent.
- `pop_victim()`: takes the row to evict next out of the policy; None when no row
  is evictable.
- `len()`, iteration (next victim first), `in`: for figures, warm-restart
  snapshots and the index's invariant check.

A lookup is not a use: an engine's scheduler looks up keys it may never load. A
use is a store, a pin or a read (a row in use is not evictable, so that use is its
withdrawal and re-admission), or a touch: the connector names the chunks a finished
request offered or loaded again, which costs no copy. A tier writing a row behind
is no use: the row stays where it is in the policy (`BlockIndex.begin_keep`), and
the index passes over it while the write runs. This is the shape of vLLM's
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

Two policies (`kvdepot serve --eviction-policy`, `make_policy`):

- `LruPolicy` (`lru`, the default): least recently used first.
- `ArcPolicy` (`arc`): adaptive replacement (Megiddo and Modha, FAST 2003) over the
  same calls: rows used once (stored, and touched by the request that stored them)
  in T1, rows used again (pinned, read, or touched again) in T2, and the ghosts of
  rows evicted from each (B1, B2) steering how much of the pool T1 may keep. It keeps
  a prefix many requests share (T2) from being pushed out by a stream of rows used
  once (questions asked once, prompts never repeated), where LRU keeps whatever
  came last. It evicts from one list, in the order of the calls, so it keeps
  loadable prefixes as LRU does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from kvdepot.server.core.index_types import Slot


class EvictionPolicy(Protocol):
    """The order in which evictable rows go (see the module docstring)."""

    # Callables rather than methods in the interface, so that an implementation
    # may bind C functions there (LruPolicy does); a plain method serves as well
    # (read-only to the index: a method is not a settable attribute).
    @property
    def admit(self) -> Callable[[Slot], object]: ...
    @property
    def withdraw(self) -> Callable[[Slot], object]: ...
    @property
    def refresh(self) -> Callable[[Slot], object]: ...

    def insert(self, slots: Iterable[Slot]) -> object:
        """Admits new READY rows, used together, in this order (module docstring)."""
        ...

    def admit_coldest(self, slot: Slot) -> object:
        """Admits `slot` as the next victim: a row popped off and passed over goes
        back (the index's eviction)."""
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

    def insert(self, slots: Iterable[Slot]) -> None:
        admit = self._order.setdefault
        for slot in slots:
            admit(slot)

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


class ArcPolicy:
    """Adaptive replacement (ARC) of the rows, with the index's calls as uses, kept
    prefix-safe: a row never goes before the rows that follow it in a prompt.

    - T1, rows used once: `insert` puts new rows here, at the young end; the first
      `refresh` after it (the touch of the request that stored the row) keeps it here.
    - T2, rows used again: `admit` (a pin's or read's hold ended: a load), a later
      `refresh` (a request reached it again), or `insert` of a row whose ghost is in
      B1 or B2 (evicted, and wanted again), and of the rows inserted with it after it
      (the chunks before it in its prompt: rows come tail first).
    - B1, B2: ghosts of the rows evicted that were used once, and used again, each at
      most the capacity in rows, as 64-bit hashes of (namespace, key) (a collision only
      nudges the target). A new row whose ghost is in B1 raises `target`, the rows T1
      may keep (it was evicted too soon for being used once); one in B2 lowers it.
    - `pop_victim` evicts from T1's old end only (after rows of `admit_coldest`:
      rows the index passed over). T2 rows beyond their share (capacity less `target`) are
      first moved to T1's young end, so they outlive the rows used once but are
      evicted, as everything, from one list.

    One list to evict from, in the order of the calls, keeps what `tail_first` gives
    LRU: a row's predecessors in its prompt are used whenever it is, after it, so they
    are always later in T2 and in T1, and a row moved from T2 lands after every row of
    T1. (Evicting from T2's old end while a successor sits in T1, as ARC does, would
    leave that successor where no lookup reaches it.) The capacity in rows is the
    pool's bytes over the mean row held, so namespaces of several row sizes share one
    count.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity_bytes = max(1, capacity_bytes)
        self._t1: OrderedDict[Slot, None] = OrderedDict()
        self._t2: OrderedDict[Slot, None] = OrderedDict()
        self._cold: OrderedDict[Slot, None] = OrderedDict()  # admit_coldest: go first
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._fresh: set[Slot] = set()  # in T1: inserted, not yet refreshed
        self._moved: set[Slot] = set()  # in T1: moved there from T2 (its ghost: B2)
        self._bytes = 0  # of the rows admitted (T1, T2, cold)
        self._rows = 1  # capacity_rows' last figure
        self.target = 0.0  # the rows T1 may keep while T2 is over its share

    def capacity_rows(self) -> int:
        """The pool's bytes over the mean row held (the last mean while none is)."""
        rows = len(self)
        if rows and self._bytes:
            self._rows = max(1, self._capacity_bytes * rows // self._bytes)
        return self._rows

    def insert(self, slots: Iterable[Slot]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        again = False  # a ghost was hit: it and the rows after it go to T2
        for slot in slots:
            self._bytes += slot.extent.size
            ghost = hash((slot.namespace, slot.key))
            if ghost in b1:
                del b1[ghost]
                rows = self.capacity_rows()
                self.target = min(self.target + max(1.0, len(b2) / (len(b1) + 1)), rows)
                again = True
            elif ghost in b2:
                del b2[ghost]
                self.target = max(self.target - max(1.0, len(b1) / (len(b2) + 1)), 0.0)
                again = True
            if again:
                t2[slot] = None
            else:
                t1[slot] = None
                self._fresh.add(slot)

    def admit(self, slot: Slot) -> None:
        self._t2[slot] = None  # a pin's or read's hold ended: used again
        self._bytes += slot.extent.size

    def admit_coldest(self, slot: Slot) -> None:
        self._cold[slot] = None
        self._cold.move_to_end(slot, last=False)
        self._bytes += slot.extent.size

    def withdraw(self, slot: Slot) -> None:
        if slot in self._t1:
            del self._t1[slot]
        elif slot in self._t2:
            del self._t2[slot]
        else:
            del self._cold[slot]  # KeyError for a row not admitted
        self._fresh.discard(slot)
        self._moved.discard(slot)
        self._bytes -= slot.extent.size

    def refresh(self, slot: Slot) -> None:
        t1 = self._t1
        if slot in t1:
            if slot in self._fresh:  # the touch of the request that stored it
                self._fresh.discard(slot)
                t1.move_to_end(slot)
                return
            del t1[slot]
            self._moved.discard(slot)
            self._t2[slot] = None
        elif slot in self._t2:
            self._t2.move_to_end(slot)
        else:
            del self._cold[slot]  # KeyError for a row not admitted, as the others
            self._t2[slot] = None

    def pop_victim(self) -> Slot | None:
        if self._cold:
            slot, ghosts = self._cold.popitem(last=False)[0], self._b1
        else:
            t1, t2 = self._t1, self._t2
            share = self.capacity_rows() - int(self.target)
            while t2 and (len(t2) > share or not t1):  # T2's oldest, after T1's youngest
                moved = t2.popitem(last=False)[0]
                t1[moved] = None
                self._moved.add(moved)
            if not t1:
                return None
            slot = t1.popitem(last=False)[0]
            self._fresh.discard(slot)
            if slot in self._moved:
                self._moved.discard(slot)
                ghosts = self._b2
            else:
                ghosts = self._b1
        self._bytes -= slot.extent.size
        ghosts[hash((slot.namespace, slot.key))] = None
        bound = self.capacity_rows()
        while len(ghosts) > bound:
            ghosts.popitem(last=False)
        return slot

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._cold)

    def __iter__(self) -> Iterator[Slot]:
        """The rows next victim first (if nothing else changed meanwhile)."""
        yield from self._cold
        yield from self._t1
        yield from self._t2

    def __contains__(self, slot: object) -> bool:
        return slot in self._t1 or slot in self._t2 or slot in self._cold


POLICIES = ("lru", "arc")


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """The policy `kvdepot serve --eviction-policy` names, for a pool of `capacity_bytes`."""
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy(capacity_bytes)
    raise ValueError(f"unknown eviction policy {name!r} (one of {', '.join(POLICIES)})")


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
