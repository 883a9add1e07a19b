"""The block index's adoption of rows no store job wrote: warm restart, crash recovery.

`Recovery` is a part of `kvdepot.server.core.index.BlockIndex`, which makes one and
calls it on the daemon's event loop (start-up: kvdepot.server.state.startup,
kvdepot.server.core.snapshot, kvdepot.server.memory.journal_file). It owns the
extents claimed for rows a crash journal lists while their bytes are verified;
an adopted row joins its namespace READY and is admitted to the index's
`EvictionPolicy` as its most recent use.
"""

from __future__ import annotations

from kvdepot.server.core.allocator import Extent
from kvdepot.server.core.index_part import IndexPart, IndexShared
from kvdepot.server.core.index_types import IndexEvent, Namespace, Slot
from kvdepot.server.core.kinds import EventKind, SlotState
from kvdepot.server.core.layout import LayoutError


class Recovery(IndexPart):
    """Rows adopted READY over extents the caller claimed (see the module docstring)."""

    def __init__(self, shared: IndexShared) -> None:
        super().__init__(shared)
        # Extents claimed for rows a journal lists, invisible until their bytes are
        # verified (adopt_recovered) or dropped (drop_recovering).
        self.recovering: dict[int, Extent] = {}

    def claim_recovering(self, offset: int, size: int) -> Extent:
        """Claims `[offset, offset+size)` for a row that a crash journal lists, so
        no store lands there while its bytes are verified. Raises OutOfSpace or
        ValueError when the range is not free (the journal is inconsistent)."""
        extent = self._allocator.allocate_at(offset, size)
        self.recovering[extent.offset] = extent
        return extent

    def drop_recovering(self, extent: Extent) -> None:
        """Frees a claimed extent whose row failed verification (or was stored
        again meanwhile)."""
        del self.recovering[extent.offset]
        self._allocator.free(extent)

    def adopt_recovered(
        self, ns: Namespace | None, key: bytes, extent: Extent, chunk_event: bytes = b""
    ) -> Slot | None:
        """Makes a verified row READY, keeping `chunk_event` beside it, and announces
        it (STORED), as a store would. Returns None, freeing the extent, when the key
        is present already (an engine stored it during the verification), its
        namespace `ns` is gone (None) or the key does not fit the layout."""
        del self.recovering[extent.offset]
        try:
            if ns is None or key in ns.slots:
                raise LayoutError("present already")
            slot = self.adopt_ready(ns, key, extent)
        except LayoutError:
            self._allocator.free(extent)
            return None
        ns.set_chunk_event(slot, chunk_event)  # before the event: its listeners read it
        self._emit(IndexEvent(ns.layout.id, EventKind.STORED, (key,)))
        return slot

    def adopt_ready(self, ns: Namespace, key: bytes, extent: Extent) -> Slot:
        """Inserts a READY slot over `extent`, which the caller has just claimed from
        the index's allocator (`allocate_at`): a warm restart re-creating its slots.

        The slot is admitted to the eviction policy as the latest use and emits
        no event. Raises LayoutError (the caller frees nothing: it discards the
        whole index) when the key does not fit the namespace, is present already,
        or the extent is not the namespace's slot size for the key's group.
        """
        namespace_id = ns.layout.id
        group = ns.layout.key_group(key)
        if key in ns.slots:
            raise LayoutError(f"key {key.hex()[:16]}… appears twice in namespace {namespace_id}")
        want = self._allocator.round_up(ns.layout.slot_bytes(group))
        if extent.size != want:
            raise LayoutError(
                f"slot of {extent.size} bytes for a group-{group} row of {want} bytes"
            )
        slot = Slot(
            namespace_id,
            key,
            group,
            extent,
            self._clock(),
            state=SlotState.READY,
            written_mask=ns.full_mask,
        )
        ns.attach(slot)
        self._policy.insert((slot,))
        return slot
