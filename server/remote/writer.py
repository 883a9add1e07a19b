"""Write-behind: block rows of the pool copied to the remote tier in the background.

`on_event` is the event bus listener (kvdepot.server.state.events): it runs on the
event loop, synchronously, as the index announces a change.

- mode "ready": each row that becomes READY is queued. A worker later checks
  which keys the tier has (one EXISTS batch: the fleet writes each key once),
  reads the rows still ready out of the pool (kept in place against eviction:
  BlockIndex.begin_keep), frames them (kvdepot.server.remote.codec: with the fleet key's MAC)
  on a thread and writes
  them with set-if-absent and the TTL.
- mode "evict": a row is written when LRU eviction removes it. Its bytes are
  copied out right inside the REMOVED event, while the freed extent still holds
  them (the index hands the extent to its next owner only after the event, and
  that owner's copy starts later still); its offset was noted when it became READY.

Each row goes with its chunk event (Slot.chunk_event; in evict mode, the REMOVED
event's), framed and authenticated with it, so the node that fetches it tells its
engines what the storing engine told this one.

Back-pressure: queued plus in-flight bytes never exceed `max_inflight_bytes`;
a row that would go past it is dropped and counted ("backlog_full"), as is every
row while the tier is down ("tier_down"). The local path never waits on the tier.
Rows that came from the tier (the reader's) are not written back, nor is any row a
fleet key admitted (`Slot.admitted_by`: one promoted from a disk record of a fleet
row too): a node writes to the fleet, under its current key, only what its own
engines stored, so a row admitted under a key being rotated out is never rewritten
under the new one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex, IndexEvent, Slot
from kvdepot.server.core.kinds import EventKind, EvictionReason
from kvdepot.server.memory.arena import Arena
from kvdepot.server.remote.batches import BatchWorkers
from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.stats import RemoteStats
from kvdepot.server.remote.tier import RemoteTier, TierUnavailable
from kvdepot.server.tier_health import TierHealth

log = logging.getLogger("kvdepot.remote")

BATCH_BYTES = 32 << 20  # one write call carries up to this much
WORKERS = 4  # write calls in flight at once


@dataclass
class _Item:
    namespace: str
    key: bytes
    size: int  # row bytes (the payload)
    payload: bytes | None = None  # evict mode: copied out at eviction
    chunk_event: bytes = b""  # evict mode: the REMOVED event's (ready mode: the slot's)


class WriteBehind:
    def __init__(
        self,
        tier: RemoteTier,
        index: BlockIndex,
        arena: Arena,
        copy_queue: CopyQueue,
        health: TierHealth,
        stats: RemoteStats,
        codec: Codec,
        *,
        mode: str = "ready",
        ttl_s: int | None = None,
        max_inflight_bytes: int = 256 << 20,
        call_timeout_s: float = 5.0,
    ) -> None:
        if mode not in ("ready", "evict"):
            raise ValueError(f"write mode {mode!r}: use ready or evict")
        self._tier = tier
        self._index = index
        self._arena = arena
        self._copy_queue = copy_queue  # pool bytes are read on copy threads only
        self._health = health
        self._stats = stats
        self._codec = codec
        self.mode = mode
        self.ttl_s = ttl_s
        self.max_inflight_bytes = max_inflight_bytes
        self.call_timeout_s = call_timeout_s
        self._writes = BatchWorkers(
            self._write,
            size_of=lambda i: i.size,
            batch_bytes=BATCH_BYTES,
            workers=WORKERS,
            what="remote write",
            on_error=lambda batch: self._drop("error", len(batch)),
        )
        self._next_drop_log = 0.0
        # Rows the reader loaded from the tier: their STORED event is not written back.
        self.from_tier: set[tuple[str, bytes]] = set()
        # Evict mode: (namespace, key) -> (offset, row bytes) of READY rows.
        self._extents: dict[tuple[str, bytes], tuple[int, int]] = {}
        if mode == "evict":
            for slot in index.ready_slots():  # warm-restarted rows announce nothing
                self._note_extent(slot.namespace, slot.key)

    @property
    def pending_bytes(self) -> int:
        """Row bytes queued or being written (bounded by `max_inflight_bytes`)."""
        return self._writes.pending_bytes

    def start(self) -> None:
        self._writes.start()

    async def close(self) -> None:
        await self._writes.close()

    # -- intake (event loop, synchronous) --------------------------------------------------

    def _row_bytes(self, namespace_id: str, key: bytes) -> int:
        layout = self._index.namespace(namespace_id).layout
        return layout.slot_bytes(layout.key_group(key))

    def _note_extent(self, namespace_id: str, key: bytes) -> None:
        slot = self._index.namespaces[namespace_id].slots.get(key)
        if slot is not None:
            self._extents[(namespace_id, key)] = (
                slot.extent.offset,
                self._row_bytes(namespace_id, key),
            )

    def on_event(self, event: IndexEvent) -> None:
        ns = event.namespace
        if event.kind is EventKind.STORED:
            space = self._index.namespaces.get(ns)
            slots = space.slots if space is not None else {}
            for key in event.keys:
                if (ns, key) in self.from_tier:
                    self.from_tier.discard((ns, key))
                    continue
                slot = slots.get(key)
                if slot is not None and slot.admitted_by:  # the fleet's: never rewritten
                    continue
                if self.mode == "ready":
                    self._offer(_Item(ns, key, self._row_bytes(ns, key)))
                else:
                    self._note_extent(ns, key)
        elif event.kind is EventKind.REMOVED:
            chunk_events = event.chunk_events
            for i, key in enumerate(event.keys):
                self.from_tier.discard((ns, key))
                where = self._extents.pop((ns, key), None)
                if where is None or event.reason is not EvictionReason.LRU:
                    continue
                offset, size = where
                if self._admit(size):
                    # The freed extent still holds the row until this event returns.
                    payload = bytes(self._arena.view(offset, size))
                    chunk_event = chunk_events[i] if chunk_events else b""
                    self._writes.put(_Item(ns, key, size, payload, chunk_event))

    def _drop(self, reason: str, rows: int = 1) -> None:
        self._stats.write_drops[reason] += rows
        now = time.monotonic()
        if now >= self._next_drop_log:  # in words, at most every 10 s
            self._next_drop_log = now + 10.0
            log.warning(
                "remote tier: %d row(s) not written (%s); %d dropped so far",
                rows,
                reason.replace("_", " "),
                sum(self._stats.write_drops.values()),
            )

    def _admit(self, size: int) -> bool:
        if not self._health.usable():
            self._drop("tier_down")
            return False
        if self.pending_bytes + size > self.max_inflight_bytes:
            self._drop("backlog_full")
            return False
        return True

    def _offer(self, item: _Item) -> None:
        if self._admit(item.size):
            self._writes.put(item)

    # -- workers ------------------------------------------------------------------------------

    async def _write(self, batch: list[_Item]) -> None:
        if not self._health.usable():
            self._drop("tier_down", len(batch))
            return
        names = [self._codec.remote_key(i.namespace, i.key) for i in batch]
        deadline = time.monotonic() + self.call_timeout_s
        t0 = time.perf_counter()
        try:
            present = await self._tier.exists_many(names, deadline)
        except TierUnavailable as exc:
            self._failed(str(exc), len(batch))
            return
        todo = [(n, i) for n, i, p in zip(names, batch, present, strict=True) if not p]
        self._stats.write_present += len(batch) - len(todo)
        if not todo:
            self._health.succeeded()
            return
        values = await self._frames([i for _, i in todo])
        items = [(n, v) for (n, _), v in zip(todo, values, strict=True) if v is not None]
        if not items:
            return
        try:
            written = await self._tier.put_many(items, self.ttl_s, deadline)
        except TierUnavailable as exc:
            self._failed(str(exc), len(items))
            return
        self._health.succeeded()
        self._stats.write_seconds.observe(time.perf_counter() - t0)
        for (_, value), ok in zip(items, written, strict=True):
            if ok:
                self._stats.writes += 1
                self._stats.write_bytes += len(value)
            else:  # another node wrote it since our EXISTS
                self._stats.write_present += 1

    def _failed(self, why: str, rows: int) -> None:
        self._stats.errors += 1
        self._drop("tier_error", rows)
        self._health.failed(why)

    async def _frames(self, items: list[_Item]) -> list[bytes | None]:
        """Framed values; None for a row evicted before it could be read, and for every
        row while the CPU copy threads are stalled (dropped). The rows still ready are
        kept in place (begin_keep: no use) and framed in one go on a copy thread: the
        daemon waits for those before it unmaps the pool."""
        if self._copy_queue.check_stall():
            # Every CPU copy thread holds a copy that may never end: framing would
            # queue behind it, so the rows are dropped now, as a job is refused.
            self._drop("copies_stalled", len(items))
            return [None] * len(items)
        held: list[Slot] = []
        # (item, pool offset or None: its payload, chunk event)
        sources: list[tuple[_Item, int | None, bytes]] = []
        for item in items:
            if item.payload is not None:
                sources.append((item, None, item.chunk_event))
                continue
            try:
                slot = self._index.begin_keep(item.namespace, item.key)
            except LookupError:  # the namespace is gone
                slot = None
            if slot is None:
                self._drop("evicted")
                continue
            held.append(slot)
            sources.append((item, slot.extent.offset, slot.chunk_event))
        arena, encode = self._arena, self._codec.encode

        def frame_all() -> list[bytes]:
            return [
                # No pool offset: the item carries its payload.
                encode(i.namespace, i.key, i.payload if o is None else arena.view(o, i.size), e)  # type: ignore[arg-type]
                for i, o, e in sources
            ]

        try:
            framed = await self._copy_queue.run(frame_all) if sources else []
        finally:
            for slot in held:
                self._index.end_keep(slot)  # no use: it kept its place
        by_item = {id(i): v for (i, _, _), v in zip(sources, framed, strict=True)}
        return [by_item.get(id(i)) for i in items]
