"""The event bus: every index event reaches the watchers of its namespace.

The block index hands each event to `EventBus.publish` as it happens (its
`on_event`), so no index change can go unannounced; Watch streams read their
`Watcher`'s queue. A watcher that falls WATCH_QUEUE_LIMIT keys behind is
marked lagged and resynced with a fresh snapshot instead: a stream nobody reads
holds at most that many keys, however many stores it misses.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kvdepot.server.core.index import IndexEvent

log = logging.getLogger("kvdepot.state")

WATCH_QUEUE_LIMIT = 65536  # keys a watcher may lag behind before it is resynced


class Watcher:
    """One Watch stream's queue. Overflow turns into a resync (fresh snapshot)."""

    def __init__(self, namespace_id: str, session_id: str = "") -> None:
        self.namespace_id = namespace_id
        self.session_id = session_id  # the session whose membership it rides on
        self.ended = False  # its session ended: the Watch stream ends too
        self.queue: deque[IndexEvent] = deque()
        self.queued_keys = 0  # keys in `queue` (events carry one key or many)
        self.lagged = False
        self.wakeup = asyncio.Event()

    def push(self, event: IndexEvent) -> None:
        if self.lagged:
            return
        if self.queued_keys + len(event.keys) > WATCH_QUEUE_LIMIT:
            self.lagged = True
            self.queue.clear()
            self.queued_keys = 0
        else:
            self.queue.append(event)
            self.queued_keys += len(event.keys)
        self.wakeup.set()

    def take_run(self, max_keys: int) -> IndexEvent | None:
        """The oldest queued keys, merged with the events right behind them of
        the same kind, reason and tier, at most `max_keys` of them (one Watch message);
        None when nothing is queued. An event of more keys (a whole store job's)
        is split: the rest stays first in the queue."""
        q = self.queue
        if not q:
            return None
        first = q.popleft()
        keys = list(first.keys)
        # Chunk events ride with their keys (REMOVED events'), b"" for a key without.
        chunk_events = _padded(first)
        run = (first.kind, first.reason, first.tier)
        while q and len(keys) < max_keys and (q[0].kind, q[0].reason, q[0].tier) == run:
            event = q.popleft()
            keys.extend(event.keys)
            chunk_events.extend(_padded(event))
        if len(keys) > max_keys:
            rest = tuple(chunk_events[max_keys:]) if any(chunk_events[max_keys:]) else ()
            q.appendleft(replace(first, keys=tuple(keys[max_keys:]), chunk_events=rest))
            del keys[max_keys:]
            del chunk_events[max_keys:]
        self.queued_keys -= len(keys)
        return replace(
            first,
            keys=tuple(keys),
            chunk_events=tuple(chunk_events) if any(chunk_events) else (),
        )


def _padded(event: IndexEvent) -> list[bytes]:
    """The event's chunk events, one per key (b"" where it carries none)."""
    return list(event.chunk_events) if event.chunk_events else [b""] * len(event.keys)


class EventBus:
    """Watchers by namespace. Runs on the event loop, like the index."""

    def __init__(self) -> None:
        self.watchers: dict[str, set[Watcher]] = {}
        self._listeners: list[Callable[[IndexEvent], None]] = []
        self._greetings: list[Callable[[str], list[IndexEvent]]] = []

    def add_listener(self, listener: Callable[[IndexEvent], None]) -> None:
        """Calls `listener(event)` for every event of every namespace, on the event
        loop, while the index is being changed: it must only note the event (queue
        work for later), never call back into the index. An exception it raises
        is logged and swallowed."""
        self._listeners.append(listener)

    def publish(self, event: IndexEvent) -> None:
        for w in self.watchers.get(event.namespace, ()):
            w.push(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not break the index's change
                log.exception("an index event listener failed")

    def publish_to_watchers(self, event: IndexEvent) -> None:
        """A tier's event (the disk's, kvdepot.server.disk.link) for the Watch streams
        only: the listeners follow the pool's rows, not the tiers below it."""
        for w in self.watchers.get(event.namespace, ()):
            w.push(event)

    def add_greeting(self, greeting: Callable[[str], list[IndexEvent]]) -> None:
        """A tier's word to every new watcher: `greeting(namespace_id)`'s events are
        its first queued events, after the pool's snapshot (the disk's records:
        kvdepot.server.disk.link)."""
        self._greetings.append(greeting)

    def subscribe(self, namespace_id: str, session_id: str = "") -> Watcher:
        w = Watcher(namespace_id, session_id)
        self.watchers.setdefault(namespace_id, set()).add(w)
        for greeting in self._greetings:
            for event in greeting(namespace_id):
                w.push(event)
        return w

    def unsubscribe(self, w: Watcher) -> None:
        ws = self.watchers.get(w.namespace_id)
        if ws is not None:
            ws.discard(w)
            if not ws:
                del self.watchers[w.namespace_id]

    def end_session(self, session_id: str) -> None:
        """Ends the Watch streams of a session that ended (its membership is gone)."""
        for ws in self.watchers.values():
            for w in ws:
                if w.session_id == session_id:
                    w.ended = True
                    w.wakeup.set()

    def wake_all(self) -> None:
        """Wakes every Watch stream (shutdown: they see it and end)."""
        for ws in self.watchers.values():
            for w in ws:
                w.wakeup.set()
