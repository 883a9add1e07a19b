"""The block index's pins: which owner (session) holds which READY rows.

`Pins` is a part of `kvdepot.server.core.index.BlockIndex`, which makes one and
calls it on the daemon's event loop. It owns the pins by owner, each owner's
pinned bytes (the --max-pinned-per-session quota) and the pool's pinned bytes; a
row's own pin counts live on its `Slot`. A row's first pin (with no read in
flight) withdraws it from the index's `EvictionPolicy`; its last pin's end
admits it again, as its most recent use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvdepot.server.core.eviction import tail_first
from kvdepot.server.core.index_part import IndexPart, IndexShared
from kvdepot.server.core.index_types import Namespace, Owner, Slot
from kvdepot.server.core.kinds import SlotState


class Pins(IndexPart):
    """Pin counts by owner, and the pinned bytes of the pool and of each owner."""

    def __init__(self, shared: IndexShared) -> None:
        super().__init__(shared)
        self.by_owner: dict[Owner, Counter[Slot]] = {}
        self.owner_bytes: dict[Owner, int] = {}  # bytes of the distinct slots it pins
        self.pinned_bytes = 0  # bytes of the slots with at least one pin

    def pin(self, ns: Namespace, keys: Iterable[bytes], owner: Owner) -> list[bool]:
        """BlockIndex.pin, for the namespace `ns`."""
        # The per-key work inlined: a step's Pin names up to thousands of keys, and
        # the scheduler waits for it.
        get, ready, withdraw = ns.slots.get, SlotState.READY, self._policy.withdraw
        owned = self.by_owner.get(owner)
        if owned is None:
            owned = Counter()
        out = []
        first_pins = first_bytes = owner_bytes = 0
        for key in keys:
            slot = get(key)
            if slot is None or slot.state is not ready:
                out.append(False)
                continue
            pins = slot.pins
            if pins is None:  # its first pin
                if not slot.readers:  # not held: the policy has it
                    withdraw(slot)
                first_pins += 1
                first_bytes += slot.extent.size
                slot.pins = {owner: 1}
            else:
                pins[owner] = pins.get(owner, 0) + 1
            held = owned.get(slot, 0)  # not owned[slot]: Counter.__missing__ is Python
            owned[slot] = held + 1
            if not held:
                owner_bytes += slot.extent.size
            out.append(True)
        if owned:
            self.by_owner[owner] = owned
        if owner_bytes:
            self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + owner_bytes
        self.pinned_bytes += first_bytes
        ns.pinned_blocks += first_pins
        ns.pinned_bytes += first_bytes
        pinned = len(out) - out.count(False)
        self._stats.pin_calls += 1
        self._stats.pin_keys += len(out)
        self._stats.pinned_keys += pinned
        return out

    def unpin(self, ns: Namespace, keys: Iterable[bytes], owner: Owner) -> int:
        """BlockIndex.unpin, for the namespace `ns`."""
        # The per-key work inlined, as in `pin`: a step's unpins name as many keys as
        # its pins did, and at N shards each shard's daemon unpins them all.
        owned = self.by_owner.get(owner)
        if owned is None:
            return sum(1 for _ in keys)
        get, held_get = ns.slots.get, owned.get
        ready = SlotState.READY
        unheld: list[Slot] = []  # admitted below, tail first: eviction.tail_first
        missing = unowned_bytes = last_pins = last_bytes = 0
        for key in keys:
            slot = get(key)
            held = 0 if slot is None else held_get(slot, 0)
            if slot is None or not held:
                missing += 1
                continue
            size = slot.extent.size
            if held == 1:
                del owned[slot]
                unowned_bytes += size
            else:
                owned[slot] = held - 1
            pins = slot.pins
            assert pins is not None  # `owned` holds it: pinned by `owner`
            count = pins[owner]
            if count == 1:
                del pins[owner]
                if not pins:  # its last pin: unheld again unless being read
                    slot.pins = None
                    last_pins += 1
                    last_bytes += size
                    if not slot.readers and slot.state is ready and not slot.doomed:
                        unheld.append(slot)  # used just now
            else:
                pins[owner] = count - 1
        if unheld:
            admit = self._policy.admit
            for slot in tail_first(unheld):
                admit(slot)
        if owned:
            self.owner_bytes[owner] -= unowned_bytes
        else:
            del self.by_owner[owner]
            del self.owner_bytes[owner]
        self.pinned_bytes -= last_bytes
        ns.pinned_blocks -= last_pins
        ns.pinned_bytes -= last_bytes
        return missing

    def release(self, owner: Owner) -> int:
        """Drops every pin of `owner`; returns how many."""
        owned = self.by_owner.get(owner)
        if owned is None:
            return 0
        # A pinned row is READY and in its namespace (nothing detaches a held row), so
        # its pins go as unpins of its key, once per pin, namespace by namespace.
        keys: dict[str, list[bytes]] = {}
        for slot, count in owned.items():
            keys.setdefault(slot.namespace, []).extend([slot.key] * count)
        pins = 0
        for namespace_id, named in keys.items():
            missing = self.unpin(self._namespaces[namespace_id], named, owner)
            assert not missing, f"{missing} of {owner}'s pins not found in {namespace_id}"
            pins += len(named)
        return pins
