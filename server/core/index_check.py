"""BlockIndex.check_invariants: the index and its allocator agree.

The whole walk (O(blocks)), for tests and for the daemon under
KVDEPOT_CHECK_INVARIANTS=1; it reads the state of the index's parts (the eviction
policy, the doomed and writing rows, the pins by owner), which is why it sits
beside the index rather than with the daemon's own invariants
(kvdepot.server.state.invariants).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvdepot.server.core.kinds import SlotState

if TYPE_CHECKING:
    from kvdepot.server.core.eviction import EvictionPolicy
    from kvdepot.server.core.index import BlockIndex
    from kvdepot.server.core.index_pins import Pins
    from kvdepot.server.core.index_types import Owner, Slot
    from kvdepot.server.core.index_writes import Writes


def check_index(ix: BlockIndex, policy: EvictionPolicy, writes: Writes, pins: Pins) -> None:
    """Raises AssertionError when index and allocator disagree: every extent is
    a live, doomed or recovering slot's, once; the namespaces' counters match
    their slots; the eviction policy holds exactly the unheld READY slots; the
    pins by owner match the slots' pins."""
    doomed = writes.doomed
    ix.allocator.check_invariants()
    live = [s for ns in ix.namespaces.values() for s in ns.slots.values()]
    extents = {s.extent.offset: s.extent.size for s in live}
    extents.update({s.extent.offset: s.extent.size for s in doomed})
    extents.update({e.offset: e.size for e in ix.recovering.values()})
    assert len(extents) == len(live) + len(doomed) + len(ix.recovering), (
        "a slot offset is used twice"
    )
    assert extents == ix.allocator.allocated_extents(), "allocator and index disagree"
    for ns in ix.namespaces.values():
        assert ns.used_bytes == sum(s.extent.size for s in ns.slots.values()) + sum(
            s.extent.size for s in doomed if s.namespace == ns.layout.id
        )
        ready = [s for s in ns.slots.values() if s.state is SlotState.READY]
        writing = [s for s in ns.slots.values() if s.state is not SlotState.READY]
        pinned = [s for s in ready if s.pins]
        assert (ns.ready_blocks, ns.ready_bytes) == (
            len(ready),
            sum(s.extent.size for s in ready),
        ), f"namespace {ns.layout.id}: ready counters drifted"
        assert (ns.writing_blocks, ns.writing_bytes) == (
            len(writing),
            sum(s.extent.size for s in writing),
        ), f"namespace {ns.layout.id}: writing counters drifted"
        assert (ns.pinned_blocks, ns.pinned_bytes) == (
            len(pinned),
            sum(s.extent.size for s in pinned),
        ), f"namespace {ns.layout.id}: pinned counters drifted"
        assert +ns.group_blocks == Counter(s.group for s in ns.slots.values())
        assert list(ns.sorted_keys) == sorted(ns.slots), "sorted keys drifted"
        assert all(0 < m.mask < ns.full_mask for m in ns.given_up.values()), (
            f"namespace {ns.layout.id}: a given-up mark names no rank or every rank"
        )
    for slot in live:
        evictable = slot.state is SlotState.READY and not slot.held
        assert (slot in policy) == evictable, f"eviction policy wrong for {slot.key.hex()}"
        assert (slot in writes.writing) == (slot.state is SlotState.WRITING)
    evictable_count = sum(s.state is SlotState.READY and not s.held for s in live)
    assert len(policy) == evictable_count, "the eviction policy holds rows that are gone"
    assert not any(s.doomed for s in live)
    owner_pins: Counter[Slot] = Counter()
    for owned in pins.by_owner.values():
        owner_pins.update(owned)
    for slot in live:
        assert owner_pins[slot] == slot.pin_count, "pin counts unbalanced"
    assert pins.pinned_bytes == sum(s.extent.size for s in live if s.pins)
    # The per-owner figures the session quotas read (--max-pinned-per-session,
    # --max-writing-per-session).
    assert pins.owner_bytes == {
        owner: sum(slot.extent.size for slot in owned) for owner, owned in pins.by_owner.items()
    }, "pinned bytes per owner drifted"
    writing_by_owner: Counter[Owner] = Counter()
    for slot in writes.writing:
        if slot.reserver is not None:
            writing_by_owner[slot.reserver] += slot.extent.size
    assert writes.owner_writing == dict(writing_by_owner), "writing bytes per owner drifted"
    assert writes.writing_total == sum(writing_by_owner.values()), "writing bytes drifted"
    assert all(s.reserver is None for s in live if s.state is SlotState.READY)
