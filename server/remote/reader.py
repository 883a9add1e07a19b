"""Fetch on a local miss: rows the tier has are read, verified and made READY in
the pool, so that Watch announces them like any stored row.

`locate(namespace, keys)` and `fetch(namespace, keys)` run on the event loop for the
Depot/Prefetch RPC (a tier below the pool: kvdepot.server.core.prefix_fetch). They
never wait on a row's bytes: `locate` asks the tier the size of each key's value
(one STRLEN batch under a short deadline) and says which are a framed size the
namespace's layout gives (a row without a chunk event up to one with the largest; a
value of another size is rejected there, never downloaded); `fetch` queues the
leading run of those the state picked. Fetch workers read the rows (GETRANGE
batches bounded by that size, so a value replaced meanwhile by a huge one is not
pulled in whole), check each value on a thread (kvdepot.server.remote.codec:
format, namespace, key, length, MAC) and insert it with the chunk event it carries
(what routers index it by): every rank's section is claimed at once with
`begin_store`, the row is copied into the slot on a thread, and `finish_store`
makes it READY. A value that does not verify is discarded and counted
(`verify_failures`, by reason), never copied into the pool, and its key is not
asked again for `REJECTED_MEMORY_S`. A key that an engine is storing meanwhile is
left to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex, Namespace, UnknownNamespace
from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.core.kinds import StoreOutcome
from kvdepot.server.core.layout import LayoutError
from kvdepot.server.memory.arena import Arena
from kvdepot.server.remote import codec
from kvdepot.server.remote.batches import BatchWorkers
from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.stats import RemoteStats
from kvdepot.server.remote.tier import RemoteTier, TierUnavailable
from kvdepot.server.remote.writer import WriteBehind
from kvdepot.server.tier_health import TierHealth

log = logging.getLogger("kvdepot.remote")

OWNER = "remote-tier"  # the index's writer id for rows inserted from the tier
FETCH_BATCH_BYTES = 32 << 20
WORKERS = 4
ABSENT_MEMORY_S = 1.0  # a key the tier lacked is not asked again for this long
REJECTED_MEMORY_S = 30.0  # nor one whose value was rejected (no re-download, no log flood)
LOG_EVERY_S = 10.0  # rejected values are logged at most this often (each is counted)


class _Fetch(NamedTuple):
    namespace: str
    key: bytes
    size: int  # row bytes
    asked_at: float  # monotonic time of the prefetch that queued it
    frame: int  # bytes of the largest framed value (its chunk event's longest): no more read


class Fetcher:
    def __init__(
        self,
        tier: RemoteTier,
        index: BlockIndex,
        arena: Arena,
        copy_queue: CopyQueue,
        health: TierHealth,
        stats: RemoteStats,
        writer: WriteBehind | None,
        codec: Codec,
        *,
        max_inflight_bytes: int = 256 << 20,
        exists_timeout_s: float = 0.25,
        call_timeout_s: float = 5.0,
    ) -> None:
        self._tier = tier
        self._index = index
        self._arena = arena
        self._copy_queue = copy_queue  # pool bytes are written on copy threads only
        self._health = health
        self._stats = stats
        self._writer = writer
        self._codec = codec
        self._next_reject_log = 0.0
        self.max_inflight_bytes = max_inflight_bytes
        self.exists_timeout_s = exists_timeout_s
        self.call_timeout_s = call_timeout_s
        self._fetches = BatchWorkers(
            self._fetch,
            size_of=lambda f: f.size,
            batch_bytes=FETCH_BATCH_BYTES,
            workers=WORKERS,
            what="remote fetch",
            on_error=self._fetch_failed,
            on_done=self._fetch_done,
        )
        self._fetching: set[tuple[str, bytes]] = set()  # queued or being fetched
        self._absent: dict[tuple[str, bytes], float] = {}  # -> until
        self._absent_check = 0.0

    @property
    def pending_bytes(self) -> int:
        """Row bytes queued or being fetched (bounded by `max_inflight_bytes`)."""
        return self._fetches.pending_bytes

    def start(self) -> None:
        self._fetches.start()

    async def close(self) -> None:
        await self._fetches.close()

    # -- the RPC: a tier below the pool (kvdepot.server.core.prefix_fetch.TierBelow) ---------

    async def locate(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key (checked, missing in the pool): whether the tier holds it as a row of
        the namespace's layout (or it is being fetched already). One STRLEN batch,
        waiting at most `exists_timeout_s`; fetches nothing."""
        ns = self._index.namespace(namespace_id)  # UnknownNamespace -> NOT_FOUND
        now = time.monotonic()
        if self._absent and now >= self._absent_check:  # forget old answers, once a second
            self._absent = {k: t for k, t in self._absent.items() if t > now}
            self._absent_check = now + 1.0
        unique = list(dict.fromkeys(keys))
        found = await self._locate_unique(namespace_id, ns, unique, now)
        by_key = dict(zip(unique, found, strict=True))
        return [by_key[k] for k in keys]

    async def _locate_unique(
        self, namespace_id: str, ns: Namespace, keys: list[bytes], now: float
    ) -> list[bool]:
        out: list[bool] = []
        ask: list[int] = []
        for i, key in enumerate(keys):
            ns.layout.key_group(key)  # LayoutError -> INVALID_ARGUMENT
            if (namespace_id, key) in self._fetching:
                out.append(True)
            elif self._absent.get((namespace_id, key), 0.0) > now or not self._health.usable():
                out.append(False)
            else:
                out.append(False)
                ask.append(i)
        if not ask:
            return out
        names = [self._codec.remote_key(namespace_id, keys[i]) for i in ask]
        try:
            sizes = await self._tier.sizes_many(names, now + self.exists_timeout_s)
        except TierUnavailable as exc:
            self._stats.errors += 1
            self._health.failed(str(exc))
            return out
        self._health.succeeded()
        asked_at = time.monotonic()
        for i, stored in zip(ask, sizes, strict=True):
            key = keys[i]
            if not stored:
                self._stats.misses += 1
                self._absent[(namespace_id, key)] = asked_at + ABSENT_MEMORY_S
                continue
            least = self._frame(namespace_id, ns, key)
            if not least <= stored <= least + MAX_CHUNK_EVENT_BYTES:  # never downloaded
                self._reject(
                    namespace_id,
                    key,
                    codec.VerifyError(
                        "wrong_size",
                        f"{stored} bytes stored, a row of this layout is {least} "
                        f"(and at most {MAX_CHUNK_EVENT_BYTES} more with its chunk event)",
                    ),
                )
                continue
            out[i] = True
        return out

    def _frame(self, namespace_id: str, ns: Namespace, key: bytes) -> int:
        """Bytes of `key`'s framed value without a chunk event (MAX_CHUNK_EVENT_BYTES
        more at most with one)."""
        return self._codec.frame_bytes(
            namespace_id, key, ns.layout.slot_bytes(ns.layout.key_group(key))
        )

    def fetch(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Queues `keys` (a leading run of a request, in its order, that `locate` found)
        for the fetch workers, tail first, so that a batch inserts the head last (the
        youngest; batches that several workers fetch at once may end in another
        order). Per key: True when under way (or in the pool already), False when
        the bound on bytes in flight dropped it."""
        ns = self._index.namespace(namespace_id)
        asked_at = time.monotonic()
        out: list[bool] = []
        for key in reversed(keys):
            if key in ns.slots or (namespace_id, key) in self._fetching:
                out.append(True)
                continue
            size = ns.layout.slot_bytes(ns.layout.key_group(key))
            if self.pending_bytes + size > self.max_inflight_bytes:
                self._stats.fetch_drops["backlog_full"] += 1
                out.append(False)
                continue
            self._fetching.add((namespace_id, key))
            self._fetches.put(
                _Fetch(
                    namespace_id,
                    key,
                    size,
                    asked_at,
                    self._frame(namespace_id, ns, key) + MAX_CHUNK_EVENT_BYTES,
                )
            )
            out.append(True)
        return out[::-1]

    def _reject(self, namespace_id: str, key: bytes, exc: codec.VerifyError) -> None:
        """A value that must not be loaded: counted, its key not asked again for a
        while, and logged (at most every LOG_EVERY_S: a store full of planted values
        must not flood the log)."""
        self._stats.verify_failures[exc.reason] += 1
        now = time.monotonic()
        self._absent[(namespace_id, key)] = now + REJECTED_MEMORY_S
        if now >= self._next_reject_log:
            self._next_reject_log = now + LOG_EVERY_S
            log.warning(
                "remote value for key %s… in namespace %s discarded: %s "
                "(%d discarded so far; see remote_verify_failures)",
                key.hex()[:16],
                namespace_id,
                exc,
                sum(self._stats.verify_failures.values()),
            )

    # -- workers ------------------------------------------------------------------------------

    def _fetch_failed(self, batch: list[_Fetch]) -> None:
        self._stats.fetch_drops["error"] += len(batch)

    def _fetch_done(self, batch: list[_Fetch]) -> None:
        for f in batch:
            self._fetching.discard((f.namespace, f.key))

    async def _fetch(self, batch: list[_Fetch]) -> None:
        names = [self._codec.remote_key(f.namespace, f.key) for f in batch]
        # One byte more than a row's frame: enough to tell a value grown since STRLEN.
        limits = [f.frame + 1 for f in batch]
        t0 = time.perf_counter()
        try:
            values = await self._tier.get_many(
                names, time.monotonic() + self.call_timeout_s, limits
            )
        except TierUnavailable as exc:
            self._stats.errors += 1
            self._stats.fetch_drops["tier_error"] += len(batch)
            self._health.failed(str(exc))
            return
        self._health.succeeded()
        self._stats.read_seconds.observe(time.perf_counter() - t0)
        self._stats.reads += len(batch)
        loop = asyncio.get_running_loop()
        for (ns, key, size, asked_at, frame), value in zip(batch, values, strict=True):
            if value is None:  # expired or evicted from the tier since STRLEN
                self._stats.misses += 1
                continue
            if len(value) > frame:
                self._reject(
                    ns, key, codec.VerifyError("too_large", f"more than the {frame} bytes of a row")
                )
                continue
            try:
                row = await loop.run_in_executor(None, self._codec.admit, value, ns, key, size)
            except codec.VerifyError as exc:
                self._reject(ns, key, exc)
                continue
            self._stats.read_bytes += size
            if await self._insert(ns, key, row):
                self._stats.hits += 1
                self._stats.miss_to_ready_seconds.observe(time.monotonic() - asked_at)

    async def _insert(self, namespace_id: str, key: bytes, row: codec.Admitted) -> bool:
        """Makes a verified row READY in the pool, remembering the key id that
        admitted it and keeping its chunk event; False if it was not needed or did
        not fit."""
        try:
            ns = self._index.namespace(namespace_id)
        except UnknownNamespace:
            self._stats.fetch_drops["namespace_gone"] += 1
            return False
        if key in ns.slots:  # an engine stored it meanwhile
            self._stats.fetch_drops["stored_locally"] += 1
            return False
        if self._copy_queue.check_stall():
            # Every CPU copy thread holds a copy that may never end: the row would
            # wait behind it, claimed, so it is not loaded (as a job is refused).
            self._stats.fetch_drops["copies_stalled"] += 1
            return False
        try:
            first = self._index.begin_store(namespace_id, key, 0, OWNER)
        except LayoutError:
            self._stats.fetch_drops["bad_key"] += 1
            return False
        if first.outcome is not StoreOutcome.WRITE or first.slot is None:
            self._stats.fetch_drops["pool_full"] += 1
            return False
        slot = first.slot
        # Before READY: the listeners (Watch's STORED event among them) read both.
        slot.admitted_by = row.key_id
        if row.chunk_event:
            self._index.keep_chunk_events(namespace_id, (slot,), {key: row.chunk_event})
        # A fresh slot: every other rank's section is free to claim as well.
        for rank in range(1, ns.layout.world_size):
            self._index.begin_store(namespace_id, key, rank, OWNER)
        if self._writer is not None:
            self._writer.from_tier.add((namespace_id, key))
        ok = False
        payload, arena, offset = row.payload, self._arena, slot.extent.offset
        try:
            # On a copy thread: the daemon waits for those before unmapping the pool.
            await self._copy_queue.run(
                lambda: arena.view(offset, len(payload)).__setitem__(slice(None), payload)
            )
            ok = True
        finally:
            ready = False
            for rank in range(ns.layout.world_size):
                ready = self._index.finish_store(slot, rank, ok) or ready
            if not ready and self._writer is not None:
                self._writer.from_tier.discard((namespace_id, key))
        return ready
