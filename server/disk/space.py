"""The disk tier's space: where each record lives, what to evict, what to drop.

`DiskSpace` is the tier's sans-I/O core: a preallocated file of `capacity` bytes,
records placed by the pool's own extent allocator
(kvdepot.server.core.allocator, 4096-byte granularity, so every record is
O_DIRECT-aligned), an index (namespace, key) -> `Entry` in LRU order, and the
bound on bytes being written.

- `begin_write` answers a `WriteVerdict`: a block already on disk or being
  written is never written twice; past `max_inflight_bytes` of writes in flight
  the block is dropped (never queued; one record always goes, however large);
  when the allocator has no room, the least
  recently used records are evicted (in memory: their bytes stay on disk until
  overwritten, and a record read meanwhile is skipped) until the record fits.
  The allocator places a record at the start of a free extent, so the first
  record to reuse any page of a freed record's extent starts at or before that
  record's header page and its own write overwrites it: an evicted header never
  survives in front of a newer record (only while that write is in flight, or
  torn by a crash), and no second write is needed to wipe it
  (tests/disk/test_disk_space.py checks this). What is left of an evicted
  record's payload is a client's bytes: the record key keeps them from ever
  passing for a header (kvdepot.server.disk.record).
- `begin_read` touches the entry (LRU) and holds it against eviction until
  `finish_read`; a read that did not verify drops the entry.
- `adopt` re-creates an entry found by the recovery scan; `clear` forgets all
  (the file was replaced). Entries of before a `clear` are told apart by their
  generation, so their late completions change nothing.
- once `watch`ed, every record that became readable and every readable record
  dropped (evicted, not verified, forgotten) is collected in `changes`, in order,
  and `flush` hands them on (the daemon's Watch streams, kvdepot.server.disk.link).

Not thread-safe: DiskTier calls it under its own lock. No files, threads or clocks.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.server.core.allocator import Extent, ExtentAllocator, OutOfSpace
from kvdepot.server.core.kinds import DiskRemoval
from kvdepot.server.disk.record import PAGE, record_size


class WriteVerdict(enum.Enum):
    ACCEPTED = "accepted"  # the caller writes it now and calls finish_write
    ON_DISK = "on_disk"  # already there, or being written
    BACKLOG_FULL = "backlog_full"  # past the bound on bytes in flight: dropped
    NO_SPACE = "no_space"  # larger than the tier, or nothing evictable: dropped
    # The tier's own answers (DiskTier.write), before the space is asked:
    TIER_DOWN = "tier_down"  # the disk failed and is not back yet: dropped
    RECOVERING = "recovering"  # the index is being rebuilt: dropped


@dataclass(slots=True, eq=False)
class Entry:
    namespace: str
    key: bytes
    offset: int
    size: int  # the record's extent (header page + padded payload)
    length: int  # payload bytes
    digest: bytes | None  # None while being written
    generation: int
    admitted_by: bytes = b""  # the fleet key id that admitted the row (b"": local)
    chunk_event: bytes = b""  # the row's, as its header holds it (b"": none)
    readers: int = 0
    dropped: bool = False  # to be freed when its last reader finishes


# (namespace, key, why): why is None for a record that became readable.
Change = tuple[str, bytes, DiskRemoval | None]
OnChanges = Callable[[list[Change]], None]


@dataclass(slots=True)
class SpaceCounters:
    evicted: int = 0
    on_disk: int = 0  # writes skipped: the block was there already
    backlog_full: int = 0
    no_space: int = 0
    dropped_entries: int = 0  # reads that did not verify


class DiskSpace:
    def __init__(self, capacity: int, max_inflight_bytes: int) -> None:
        self.capacity = capacity
        self.max_inflight_bytes = max_inflight_bytes
        self.counters = SpaceCounters()
        self.generation = 0
        self.changes: list[Change] | None = None  # None: nobody follows them
        self._on_changes: OnChanges | None = None
        self._reset()

    def _reset(self) -> None:
        self.allocator = ExtentAllocator(self.capacity, PAGE)
        self._ready: OrderedDict[tuple[str, bytes], Entry] = OrderedDict()  # LRU first
        self._writing: dict[tuple[str, bytes], Entry] = {}
        self.inflight_bytes = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def records(self) -> int:
        return len(self._ready)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def contains(self, namespace: str, key: bytes) -> bool:
        """On disk (readable) now."""
        return (namespace, key) in self._ready

    def length_of(self, namespace: str, key: bytes) -> int | None:
        entry = self._ready.get((namespace, key))
        return None if entry is None else entry.length

    def touch(self, namespace: str, keys: Sequence[bytes]) -> int:
        """A request used `keys` again (its chunks in a job's order): each readable
        record becomes the most recently used, the first key the youngest, as in the
        pool (kvdepot.server.core.eviction.tail_first). Returns how many it moved."""
        ready, moved = self._ready, 0
        for key in reversed(keys):
            if (namespace, key) in ready:
                ready.move_to_end((namespace, key))
                moved += 1
        return moved

    def record_of(self, namespace: str, key: bytes) -> tuple[int, bytes] | None:
        """(payload length, admitting fleet key id) of a readable record."""
        entry = self._ready.get((namespace, key))
        return None if entry is None else (entry.length, entry.admitted_by)

    def ready_items(self) -> list[tuple[str, bytes, int, int, bytes, bytes, bytes]]:
        """(namespace, key, offset, length, digest, admitted_by, chunk_event) of the
        readable records, least recently used first (a checkpoint's items)."""
        return [
            (e.namespace, e.key, e.offset, e.length, e.digest or b"", e.admitted_by, e.chunk_event)
            for e in self._ready.values()
        ]

    def chunk_event_of(self, namespace: str, key: bytes) -> bytes:
        """A readable record's chunk event (b"": none, or no such record)."""
        entry = self._ready.get((namespace, key))
        return b"" if entry is None else entry.chunk_event

    # -- writes --------------------------------------------------------------------------

    def begin_write(
        self,
        namespace: str,
        key: bytes,
        length: int,
        admitted_by: bytes = b"",
        chunk_event: bytes = b"",
    ) -> tuple[WriteVerdict, Entry | None]:
        ident = (namespace, key)
        if ident in self._ready or ident in self._writing:
            self.counters.on_disk += 1
            return WriteVerdict.ON_DISK, None
        size = record_size(length)
        # One record always goes, however large: a bound below one row never stalls.
        if self.inflight_bytes and self.inflight_bytes + size > self.max_inflight_bytes:
            self.counters.backlog_full += 1
            return WriteVerdict.BACKLOG_FULL, None
        extent = self._allocate(size)
        if extent is None:
            self.counters.no_space += 1
            return WriteVerdict.NO_SPACE, None
        entry = Entry(
            namespace,
            key,
            extent.offset,
            extent.size,
            length,
            None,
            self.generation,
            admitted_by,
            chunk_event,
        )
        self._writing[ident] = entry
        self.inflight_bytes += extent.size
        return WriteVerdict.ACCEPTED, entry

    def finish_write(self, entry: Entry, digest: bytes | None) -> None:
        """The write of `entry` ended: with its digest it is readable, with None
        (failed) its extent is free again."""
        if entry.generation != self.generation:
            return  # written to a file that is gone
        del self._writing[(entry.namespace, entry.key)]
        self.inflight_bytes -= entry.size
        if digest is None:
            self.allocator.free(Extent(entry.offset, entry.size))
            return
        entry.digest = digest
        self._ready[(entry.namespace, entry.key)] = entry
        self._changed(entry, None)

    def _allocate(self, size: int) -> Extent | None:
        if size > self.allocator.capacity:
            return None
        skipped: list[Entry] = []
        try:
            while True:
                try:
                    return self.allocator.allocate(size)
                except OutOfSpace:
                    if not self._ready:
                        return None
                    _, victim = self._ready.popitem(last=False)
                    if victim.readers:
                        skipped.append(victim)  # being read: stays, most recent now
                        continue
                    self.allocator.free(Extent(victim.offset, victim.size))
                    self.counters.evicted += 1
                    self._changed(victim, DiskRemoval.LRU)
        finally:
            for entry in skipped:
                self._ready[(entry.namespace, entry.key)] = entry

    # -- reads ---------------------------------------------------------------------------

    def begin_read(self, namespace: str, key: bytes) -> Entry | None:
        """The readable entry, touched and held against eviction; None: not on disk."""
        entry = self._ready.get((namespace, key))
        if entry is None:
            return None
        self._ready.move_to_end((namespace, key))
        entry.readers += 1
        return entry

    def finish_read(self, entry: Entry, verified: bool) -> None:
        if entry.generation != self.generation:
            return
        entry.readers -= 1
        if not verified and not entry.dropped:
            entry.dropped = True
            self.counters.dropped_entries += 1
            if self._ready.get((entry.namespace, entry.key)) is entry:
                del self._ready[(entry.namespace, entry.key)]
                self._changed(entry, DiskRemoval.REJECTED)
        if entry.dropped and entry.readers == 0:
            self.allocator.free(Extent(entry.offset, entry.size))

    # -- recovery ------------------------------------------------------------------------

    def adopt(
        self,
        namespace: str,
        key: bytes,
        offset: int,
        length: int,
        digest: bytes,
        admitted_by: bytes = b"",
        chunk_event: bytes = b"",
    ) -> bool:
        """Re-creates a record the scan found: `claim` then `publish`."""
        return self.claim(offset, length) and self.publish(
            namespace, key, offset, length, digest, admitted_by, chunk_event
        )

    def claim(self, offset: int, length: int) -> bool:
        """Claims a found record's extent, invisible until `publish`; False when it is
        taken (a write since start, an overlap): the caller drops the record. Claims
        in offset order keep the allocator's free list short."""
        try:
            self.allocator.allocate_at(offset, record_size(length))
        except (OutOfSpace, ValueError):
            return False
        return True

    def publish(
        self,
        namespace: str,
        key: bytes,
        offset: int,
        length: int,
        digest: bytes,
        admitted_by: bytes = b"",
        chunk_event: bytes = b"",
    ) -> bool:
        """Makes a claimed record readable, as the most recently used (a change, as a
        write's is: recovered records are announced); False (and its extent freed)
        when its key is known already."""
        size = record_size(length)
        if (namespace, key) in self._ready or (namespace, key) in self._writing:
            self.allocator.free(Extent(offset, size))
            return False
        entry = Entry(
            namespace, key, offset, size, length, digest, self.generation, admitted_by, chunk_event
        )
        self._ready[(namespace, key)] = entry
        self._changed(entry, None)
        return True

    def keys_of(self, namespace: str, limit: int) -> list[bytes]:
        """The keys of a namespace's readable records, most recently used first, at
        most `limit` (what a new watcher is told is on disk), among the 4 x `limit`
        most recently used records of all namespaces: the caller holds the event
        loop, so a namespace with few records among many others' is told only of
        its recent ones (the others still read as disk hits)."""
        out: list[bytes] = []
        for ns, key in itertools.islice(reversed(self._ready), 4 * limit):
            if ns == namespace:
                out.append(key)
                if len(out) >= limit:
                    break
        return out

    def clear(self) -> None:
        """Forgets every record (the file was removed or replaced)."""
        if self.changes is not None:
            self.changes.extend((ns, key, DiskRemoval.LOST) for ns, key in self._ready)
        self.generation += 1
        self._reset()

    def watch(self, on_changes: OnChanges) -> None:
        """Collects the changes from now on; `flush` calls `on_changes` with them."""
        self._on_changes = on_changes
        self.changes = []

    def flush(self) -> None:
        """Hands the changes collected so far on (the caller holds the tier's lock, so
        the order is the records' own; `on_changes` must only pass them on)."""
        changes = self.changes
        if changes and self._on_changes is not None:
            self.changes = []
            self._on_changes(changes)

    def _changed(self, entry: Entry, why: DiskRemoval | None) -> None:
        if self.changes is not None:
            self.changes.append((entry.namespace, entry.key, why))
