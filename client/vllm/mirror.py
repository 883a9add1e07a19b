"""The scheduler's local copy of a namespace's ready keys, fed by the daemon's Watch stream.

`OffloadingManager.lookup` answers from this set alone, so a lookup never touches the
network. The daemon's Watch stream (kvdepot.client.DepotClient.watch) sends a snapshot
and then every STORED and REMOVED change; a snapshot with `reset` (the daemon
restarted, or the client lost it) replaces the set. Events of tier DISK (the
daemon's disk tier wrote or dropped a block) never change the set: a block on disk
only is fetched by Prefetch, never a hit; they become vLLM KV events of medium
STORAGE (the pool's are CPU), checked against the generation like the rest.

Chunk events: a Watch stream asked for them (`key_events`) carries, with STORED,
SNAPSHOT and REMOVED keys, what the storing engine said of each chunk
(kvdepot.v1.ChunkEvent); the mirror collects them with the OffloadingEvents, and
`take_events` hands over at once the events and the chunk events of the keys they
name, so vLLM's tracker learns a chunk before it translates the chunk's event
(kvdepot.client.vllm.chunk_events). Nothing is kept past that step: a chunk event of
a key no event names (a shard's store, before every shard holds the key) is dropped.

Generations: each namespace the engine follows is a generation (0 at start, +1 per
`reset_cache`). A Watch handler serves one generation: its events are checked and
applied under `ReadyMirror`'s lock, and `start_generation` switches generation and set
under the same lock, so an event of a namespace the engine left never reaches the new
set, even one that passed its check while the switch was waiting (the reset race,
tests/vllm/test_reset_race.py).

Shards (kvdepot.common.shards): an engine that uses E > 1 of the daemon's shards has one
Watch stream per shard, each handler naming its shard. The mirror keeps what each shard
holds and lists a key as ready only when every shard has its sections: a key one shard
lost (evicted first there, or that shard restarted) is a miss, never a hit. The disk
tier's events are taken from shard 0 alone (one event per block, not one per shard).

Threads and ownership (`ReadyMirror` owns the set, the generation, the events and
both locks):
- the handlers returned by `handler` run on the client's stream loop thread
  (kvdepot.client.stream_loop), one event at a time;
- `start_generation`, `discard`, `take_events` and reads of `ready` run on vLLM's
  scheduler thread. `ready` is read without the lock (lookup's hot path): the set only
  changes one GIL-atomic operation at a time and is replaced, never cleared, so a
  lookup never sees a half-emptied mirror.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent

from kvdepot.common.chunks import key_suffixes
from kvdepot.v1 import depot_pb2

_SNAPSHOT = depot_pb2.WatchEvent.SNAPSHOT
_STORED = depot_pb2.WatchEvent.STORED
_REMOVED = depot_pb2.WatchEvent.REMOVED
_TIER_DISK = depot_pb2.WatchEvent.TIER_DISK

WatchHandler = Callable[[depot_pb2.WatchEvent], None]


class ReadyMirror:
    """The ready keys of the namespace the engine is in, and vLLM's KV events for them."""

    def __init__(
        self,
        enable_events: bool,
        on_forget: Callable[[], None],
        shards: int = 1,
        lacks: Sequence[frozenset[int]] = (),
    ) -> None:
        """`enable_events`: collect OffloadingEvents for `take_events` (vLLM's KV events
        are on). `on_forget` runs (on the stream loop thread) when a reset snapshot
        makes the mirror forget everything (with shards: what one shard held).
        `shards`: the daemon shards the engine uses, one Watch stream each; `lacks`:
        per shard, the ids of the groups it holds no key of (a pipeline stage with no
        layer of them, kvdepot.client.vllm.stages): a key of such a group needs the
        other shards alone."""
        self.ready: set[bytes] = set()
        # What each shard holds, when there are several (`ready` is their intersection).
        self._held: list[set[bytes]] = [set() for _ in range(shards)] if shards > 1 else []
        # Per shard, the 4-byte key suffixes (group ids) of the groups it lacks.
        self._lacked = [key_suffixes(lacked) for lacked in lacks] or [frozenset()] * shards
        self._on_forget = on_forget
        # Held while a Watch event is checked and applied, and while the generation
        # switches (never on lookup's path).
        self._lock = threading.Lock()
        self._generation = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # Chunk events since the last take_events: key -> (ChunkEvent, in the pool).
        self._chunk_events: dict[bytes, tuple[bytes, bool]] = {}
        self._events_lock = threading.Lock()
        self.watch_events = 0  # events applied (a monotonic count for tools)

    def handler(self, generation: int, shard: int = 0) -> WatchHandler:
        """The Watch callback for `generation`'s namespace on `shard`; stale once a
        later generation starts."""

        def on_event(event: depot_pb2.WatchEvent) -> None:
            with self._lock:
                if generation != self._generation:
                    return
                if self._held:
                    self.apply_shard(event, shard)
                else:
                    self.apply(event)

        return on_event

    def start_generation(self, generation: int) -> None:
        """Empties the mirror for a new namespace; events of earlier generations,
        including one being applied now, never reach it."""
        with self._lock:
            self._generation = generation
            self.ready = set()
            self._held = [set() for _ in self._held]

    def apply(self, event: depot_pb2.WatchEvent) -> None:
        """Applies one Watch event (the caller holds the lock and checked the generation)."""
        self.watch_events += 1
        kind = event.kind
        if event.tier == _TIER_DISK:  # where a block lives, for routers: not a hit
            if kind in (_STORED, _REMOVED):
                self._note_chunk_events(event, on_pool=False)
                self._emit(list(event.keys), kind == _REMOVED, Medium.STORAGE, Locality.LOCAL)
        elif kind == _STORED:
            keys = list(event.keys)
            self.ready.update(keys)
            self._note_chunk_events(event, on_pool=True)
            self._emit(keys, removed=False)
        elif kind == _REMOVED:
            keys = list(event.keys)
            self.ready.difference_update(keys)
            self._note_chunk_events(event, on_pool=False)
            self._emit(keys, removed=True)
        elif kind == _SNAPSHOT:
            if event.reset:
                # Forget everything: the daemon restarted, or we lost it. A new set
                # (not clear()): see the module docstring.
                old, self.ready = self.ready, set()
                self._on_forget()
                if old:
                    self._emit(list(old), removed=True)
            keys = list(event.keys)
            if keys:
                self.ready.update(keys)
                self._note_chunk_events(event, on_pool=True)
                self._emit(keys, removed=False)
        # SNAPSHOT_END: nothing to do, the snapshot keys are in already.

    def apply_shard(self, event: depot_pb2.WatchEvent, shard: int) -> None:
        """Applies one event of one shard's Watch stream (the caller holds the lock and
        checked the generation): a key is ready once every shard holds it."""
        self.watch_events += 1
        kind = event.kind
        if event.tier == _TIER_DISK:
            if shard == 0 and kind in (_STORED, _REMOVED):
                self._note_chunk_events(event, on_pool=False)
                self._emit(list(event.keys), kind == _REMOVED, Medium.STORAGE, Locality.LOCAL)
            return
        held = self._held[shard]
        if kind == _REMOVED:
            keys = list(event.keys)
            held.difference_update(keys)
            self._note_chunk_events(event, on_pool=False)
            gone = [k for k in keys if k in self.ready]
            self.ready.difference_update(gone)
            self._emit(gone, removed=True)
            return
        if kind == _SNAPSHOT and event.reset:
            # This shard forgot everything (it restarted, or we lost it): so do its
            # keys here. A new set, not removals in place: see the module docstring.
            old, self._held[shard] = held, set()
            held = self._held[shard]
            lost = [k for k in old if k in self.ready]
            if lost:
                self.ready = self.ready.difference(lost)
                self._emit(lost, removed=True)
            self._on_forget()
        if kind in (_STORED, _SNAPSHOT):
            keys = list(event.keys)
            held.update(keys)
            self._note_chunk_events(event, on_pool=True)
            # Ready now: held here, and by every other shard. Set operations in C, over
            # the event's keys (intersection walks the smaller set): per key, not per
            # key and shard, in Python.
            fresh = set(keys)
            fresh.difference_update(self.ready)
            for other, lacked in zip(self._held, self._lacked, strict=True):
                if not fresh:
                    return
                if other is held:
                    continue
                if lacked:  # its stage holds no layer of these keys' groups
                    exempt = {k for k in fresh if k[-4:] in lacked}
                    fresh.intersection_update(other)
                    fresh.update(exempt)
                else:
                    fresh.intersection_update(other)
            if fresh:
                self.ready.update(fresh)
                if self._events is not None:
                    self._emit([k for k in keys if k in fresh], removed=False)

    def discard(self, keys: Iterable[bytes]) -> None:
        """Keys found gone (a pin missed them) before their REMOVED event arrives."""
        self.ready.difference_update(keys)

    def _note_chunk_events(self, event: depot_pb2.WatchEvent, on_pool: bool) -> None:
        """Keeps the event's chunk events for take_events."""
        chunk_events = event.key_events
        if self._events is None or not chunk_events:
            return
        with self._events_lock:
            for key, data in zip(event.keys, chunk_events, strict=False):
                if data:
                    self._chunk_events[key] = (data, on_pool)

    def _emit(
        self,
        keys: list[bytes],
        removed: bool,
        medium: Medium = Medium.CPU,
        locality: Locality | None = None,
    ) -> None:
        if self._events is None or not keys:
            return
        # A disk block's removal always follows (the tier announces it): vLLM's tracker
        # then keeps the chunk's metadata until it, past the pool's removal.
        event = OffloadingEvent(
            keys=keys,
            medium=medium,
            removed=removed,
            locality=locality,
            removal_expected=medium is Medium.STORAGE and not removed,
        )
        with self._events_lock:
            self._events.append(event)

    def take_events(
        self, feed: Callable[[dict[bytes, tuple[bytes, bool]]], object] | None = None
    ) -> Iterable[OffloadingEvent]:
        """The KV events since the last call (a plain function: vLLM drains it every
        step). `feed` gets the chunk events of the keys they name (key -> (ChunkEvent,
        in the pool)), taken in the same swap, before they are returned; the others
        are dropped."""
        if not self._events:  # events off (None), or none since the last step
            if self._chunk_events:  # a shard's, for keys not ready yet: not kept
                with self._events_lock:
                    self._chunk_events = {}
            return ()
        with self._events_lock:
            events, self._events = self._events, []
            chunk_events, self._chunk_events = self._chunk_events, {}
        if chunk_events and feed is not None:
            named = {
                key: chunk_event
                for event in events
                for key in event.keys
                if (chunk_event := chunk_events.get(key)) is not None
            }
            if named:
                feed(named)
        return events
