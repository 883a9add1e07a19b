"""The calls on a joined namespace's keys: a facet of `DepotState`.

`KeyCalls` answers Lookup, Pin and Unpin and opens and closes Watch subscriptions,
each for a session that has joined the namespace (`NamespaceAccess.member`), with
at most --max-batch-keys keys a call (`check_batch`, also the remote tier's
Prefetch) and at most --max-pinned-per-session bytes pinned (a Pin beyond it is
undone, all or nothing).

Owned by `DepotState`, which offers these calls as its own (a method per call);
everything runs on the event loop. Errors are DepotError or the index's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdepot.server import errors
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.kinds import SlotState
from kvdepot.server.state.events import EventBus, Watcher
from kvdepot.server.state.invariants import mutation
from kvdepot.server.state.namespaces import NamespaceAccess
from kvdepot.server.state.sessions import Sessions


class KeyCalls:
    """Lookup, Pin, Unpin and Watch over `index`, checked by `access`."""

    def __init__(
        self,
        index: BlockIndex,
        bus: EventBus,
        access: NamespaceAccess,
        sessions: Sessions,
        max_batch_keys: int,
        verify_invariants: Callable[[], object],
    ) -> None:
        self.index = index
        self.bus = bus
        self.access = access
        self._sessions = sessions
        self.max_batch_keys = max_batch_keys
        self.verify_invariants = verify_invariants
        # Told of every touch after the pool applied it (the disk tier: its order too).
        self.touch_listeners: list[Callable[[str, Sequence[bytes]], object]] = []
        # Tiers below the pool that hold chunk events of rows the pool has not (the disk).
        self.chunk_event_sources: list[Callable[[str, Sequence[bytes]], list[bytes]]] = []

    def check_batch(self, keys: Sequence[bytes]) -> None:
        limit = self.max_batch_keys
        if len(keys) > limit:
            raise errors.exhausted(
                f"{len(keys)} keys in one call; at most {limit} (--max-batch-keys): split it"
            )

    def lookup(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.access.member(session_id, namespace_id)
        self.check_batch(keys)
        return self.index.lookup(namespace_id, keys)

    @mutation
    def pin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        self.access.member(session_id, namespace_id)
        self.check_batch(keys)
        pinned = self.index.pin(namespace_id, keys, session_id)
        try:
            self.access.check_pinned(session_id)  # --max-pinned-per-session
        except errors.DepotError:
            # All or nothing: the call's own pins are dropped again.
            mine = [k for k, p in zip(keys, pinned, strict=True) if p]
            self.index.unpin(namespace_id, mine, session_id)
            raise
        return pinned

    @mutation
    def unpin(
        self,
        session_id: str,
        namespace_id: str,
        keys: Sequence[bytes],
        touch: Sequence[bytes] = (),
    ) -> int:
        """Drops the session's pins of `keys`, then makes the READY rows of `touch`
        (keys finished requests used again) the most recent (BlockIndex.touch).
        Returns how many of `keys` the session did not have pinned."""
        self.access.member(session_id, namespace_id)
        self.check_batch(keys)
        self.check_batch(touch)
        missing = self.index.unpin(namespace_id, keys, session_id)
        if touch:
            self.index.touch(namespace_id, touch)
            for listener in self.touch_listeners:
                listener(namespace_id, touch)
        return missing

    def add_watcher(self, session_id: str, namespace_id: str) -> Watcher:
        """Subscribes; the snapshot is then read a batch at a time (`ready_after`): a key
        that changes meanwhile has an event queued after the snapshot. The session must
        have joined the namespace and have a Watch stream to spare."""
        session = self.access.member(session_id, namespace_id)
        self.access.open_watch(session)  # --max-watches-per-session
        return self.bus.subscribe(namespace_id, session_id)

    def ready_after(
        self, namespace_id: str, after: bytes | None, limit: int
    ) -> tuple[list[bytes], bytes | None]:
        """The READY keys among the namespace's next `limit` keys after `after` (in key
        order; from the first when None), and the key the next batch starts after (None
        when no key is left). O(log n + limit), so a snapshot of any size is sent in
        batches with the event loop yielded between them; keys added or removed between
        batches reach a watcher subscribed before the first as events."""
        ns = self.index.namespaces.get(namespace_id)
        if ns is None:
            return [], None
        keys = ns.sorted_keys.after(after, limit)
        slots = ns.slots
        ready = [k for k in keys if (s := slots.get(k)) is not None and s.state is SlotState.READY]
        return ready, keys[-1] if len(keys) == limit else None

    def remove_watcher(self, w: Watcher) -> None:
        self.bus.unsubscribe(w)
        session = self._sessions.sessions.get(w.session_id)
        if session is not None:
            self.access.close_watch(session)

    def chunk_events(self, namespace_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Each key's chunk event (WatchEvent.key_events): its pool row's, else a tier's
        below (a disk record's), b"" where none is held."""
        events = self.index.chunk_events(namespace_id, keys)
        if self.chunk_event_sources and not all(events):
            for source in self.chunk_event_sources:
                below = source(namespace_id, keys)
                events = [e or b for e, b in zip(events, below, strict=True)]
        return events

    def ready_keys(self, namespace_id: str) -> list[bytes]:
        ns = self.index.namespaces.get(namespace_id)
        if ns is None:
            return []
        return [k for k, s in ns.slots.items() if s.state is SlotState.READY]
