"""Scheduler side: `KVDepotOffloadingManager`, vLLM's OffloadingManager backed by the daemon.

Contract with vLLM's scheduler (which calls every method from its own thread):
- `lookup` never touches the network: it answers from a local mirror of the
  namespace's ready keys, fed by the daemon's Watch stream on a background thread.
- `prepare_load` records the keys, and once `EARLY_PIN_KEYS` of them are waiting,
  sends them as a pin call on the pin lane without waiting (kvdepot.client.pin_lane):
  the daemon pins them while the scheduler prepares the step's other requests.
  `on_schedule_end` sends the rest and waits for every answer (keys the lane could
  not pin go in one Pin RPC), under `kvdepot_pin_timeout_ms`. That is the only
  network wait a scheduler step can have, and it happens only in steps with hits.
- `prepare_store` is decided locally (keys not ready and not already being
  stored, and with vLLM's `store_threshold`, offered often enough); the daemon
  allocates when the copy arrives and may drop it.
- `on_request_finished` queues one touch of the request's chunks (loaded, offered
  again, stored: request_uses.py) for the unpin thread, after the request's stores
  ended: the daemon makes them young again, head youngest, and evicts tails first.
- `complete_load` queues the unpins; a background thread sends them, batched,
  on the unpin lane (kvdepot.client.pin_lane, no answer awaited) or in one Unpin
  RPC per batch. `complete_store` is local.
- Daemon down: the mirror is empty (every lookup misses), stores are not offered,
  and no call raises.
- Remote tier (the daemon runs with `--remote`, SessionHello.remote_tier): a key
  missing from the mirror answers RETRY ("ask again next step") and is collected;
  `on_schedule_end` hands the step's keys to a background thread, which sends
  them in ONE Prefetch RPC. Keys the tier lacks become misses as soon as the
  answer arrives; fetched keys turn into hits when Watch announces them; a key
  still not here after `kvdepot_remote_wait_ms` counts as a miss (recomputed).
  The scheduler thread never waits on the network for any of it.

The manager composes one part per job and implements vLLM's methods by delegating;
each part's module says which thread calls what and what it owns:
- `ReadyMirror` (mirror.py): the ready keys, applied on the client's stream loop
  thread under the lock a reset switches generations under; vLLM's KV events.
- `StepPins` (pins.py): the step's pins on every shard, in early parts and at the
  step's end, held per request and shard (scheduler thread; a shard's forgotten on its
  stream loop thread at a disconnect).
- `UnpinSender` (unpins.py): the unpin thread.
- `RemotePrefetch` (prefetch.py): RETRY answers and the prefetch thread.
- `LoadFailureBackoff` (load_failures.py): keys that miss after a failed load.
- `StepStats` (stats.py): the figures `get_stats` hands vLLM.
- chunk_events.py: with vLLM's `self_describing_kv_events`, the stores' router
  metadata, taken from the Watch stream into vLLM's events tracker (`follow_tracker`).
What stays here is the namespace and its generation (reset_cache) and the store
decision (scheduler thread only).

Shards (kvdepot.common.shards): an engine that uses E > 1 of the daemon's shards gets one
client per shard, and with it one Watch stream, one pin lane and one `UnpinSender` per
shard, each in that shard's namespace. The mirror counts a key ready when every shard has
it; a step's pins go to every shard before any answer is read, so the step waits for the
slowest shard, not for their sum; a load's keys are unpinned on each shard that pinned
them. vLLM sees one manager and one namespace. Pipeline stages are parts too: an engine
of P > 1 stages has a namespace part per stage (per stage and shard, with shards), each
with a client of its own, even where two parts are on one shard; the code says "shard"
for a part.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot.client import DepotClient
from kvdepot.client.pin_lane import PinLane, UnpinLane
from kvdepot.client.vllm.chunk_events import TrackerFeed
from kvdepot.client.vllm.config import DepotSettings
from kvdepot.client.vllm.load_failures import LoadFailureBackoff
from kvdepot.client.vllm.mirror import ReadyMirror
from kvdepot.client.vllm.namespace import reset_namespace_id
from kvdepot.client.vllm.pins import StepPins
from kvdepot.client.vllm.prefetch import RemotePrefetch
from kvdepot.client.vllm.request_uses import OfferCounts, RequestUses
from kvdepot.client.vllm.stats import MetricName, PoolUsage, StepStats
from kvdepot.client.vllm.transfer_specs import KVDepotLoadSpec, KVDepotStoreSpec
from kvdepot.client.vllm.unpins import UnpinSender
from kvdepot.common.chunks import group_of_key
from kvdepot.common.shards import shard_namespace_id

log = logging.getLogger("kvdepot.vllm.manager")

_ALL_TIERS = TierFilter.ALL


@functools.lru_cache(maxsize=64)
def tiers_allowed(tiers: TierFilter) -> tuple[bool, bool]:
    """Whether a request's `kv_load_tiers` (vLLM's per-request filter) lets it load from
    the daemon's pool (host RAM on this node) and from the tiers below it (the disk:
    storage on this node; the fleet: another node's). A request that asks for RAM only
    never waits on a disk or fleet fetch."""
    pool = tiers.allows(Medium.CPU, Locality.LOCAL)
    below = tiers.allows(Medium.STORAGE, Locality.LOCAL) or tiers.allows(None, Locality.REMOTE)
    return pool, below


# Finished requests whose touch waits for their stores to end (a bound: each holds its keys).
MAX_TOUCHES_WAITING = 4096

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS

__all__ = ["KVDepotOffloadingManager", "MetricName"]


class KVDepotOffloadingManager(OffloadingManager):
    """An OffloadingManager whose blocks live in the kvdepot daemon.

    `lock` stays vLLM's default no-op: no vLLM-facing method is entered from
    another thread. The Watch thread only swaps or mutates the mirror set, one
    GIL-atomic operation at a time, and a HIT that is evicted before the pin is
    caught by the pin (the load then fails and vLLM recomputes).
    """

    def __init__(
        self,
        clients: DepotClient | Sequence[DepotClient],
        namespace_id: str,
        settings: DepotSettings,
        enable_events: bool = False,
        node_shards: int | None = None,
        part_suffixes: Sequence[str] | None = None,
        chunk_events: bool = False,
        part_lacks: Sequence[frozenset[int]] = (),
    ) -> None:
        """`clients`: the daemon's, or one per namespace part of the engine (a shard it
        uses, or a pipeline stage on one: kvdepot.common.shards.engine_parts), the first
        part's first; `part_suffixes`: what each part adds to the namespace id (default:
        one part per shard, `shard_namespace_id`); `node_shards`: the shards the engine
        was routed for (default `settings.shards`, or 1 when that is "auto").
        `chunk_events`: the Watch streams ask for the stores' chunk events (vLLM's
        self-describing KV events are on). `part_lacks`: per part, the ids of the
        groups it holds no key of (a pipeline stage with no layer of them,
        kvdepot.client.vllm.stages): such a key needs the other parts alone."""
        self._clients = [clients] if isinstance(clients, DepotClient) else list(clients)
        self._client = self._clients[0]
        self._settings = settings
        self._base_namespace_id = namespace_id
        self.namespace_id = namespace_id
        self._generation = 0  # resets so far: the namespace's generation
        self._stats = StepStats()
        self._failures = LoadFailureBackoff(settings.load_failure_backoff_s)
        self._chunk_events = chunk_events and enable_events
        # Lends vLLM's OffloadingEventsTracker chunk events, once the connector hands
        # it (follow_tracker).
        self._tracker_feed: TrackerFeed | None = None
        self._part_lacks = list(part_lacks) or [frozenset()] * len(self._clients)
        self._mirror = ReadyMirror(
            enable_events,
            on_forget=self._failures.clear,
            shards=len(self._clients),
            lacks=self._part_lacks,
        )
        # Keys offered for store whose job has not completed.
        self._storing: set[bytes] = set()
        # The chunks each live request used, touched in the daemon when it finishes;
        # a finished request's touch waits here while its stores are in flight.
        self._uses = RequestUses()
        self._touch_after_store: dict[str, list[bytes]] = {}
        self._offers = OfferCounts(settings.store_threshold, settings.max_tracker_size)
        # The generation each request was added in.
        self._request_generation: dict[str, int] = {}
        self._closed = False
        self._node_shards = node_shards or settings.shards or 1  # "auto" unasked: one
        n = len(self._clients)
        self._suffixes = (
            list(part_suffixes)
            if part_suffixes is not None
            else [shard_namespace_id("", s, n) for s in range(n)]
        )
        # The namespace as each shard names it (per request and shard in a step: built
        # once per namespace, not per call).
        self._on_shards = self._shard_namespaces(namespace_id)
        self._shards_said = False  # a shard count mismatch was logged
        self._policy_said = False  # an eviction policy mismatch was logged
        self._unpins = [UnpinSender(c) for c in self._clients]
        self._remote = RemotePrefetch(
            self._clients,
            self._stats,
            self._failures,
            float(getattr(settings, "remote_wait_s", 0.2)),
            self._shard_namespace,
        )
        self._pins = StepPins(
            self._clients, self._stats, settings.pin_timeout_s, lacks=self._part_lacks
        )
        for shard, client in enumerate(self._clients):
            # The ignores: mypy infers no lambda with a bound default.
            client.add_session_listener(lambda _boot, s=shard: self._on_session(s))  # type: ignore[misc]
            client.add_disconnect_listener(lambda s=shard: self._on_disconnect(s))  # type: ignore[misc]
        self._watches = self._watch_all()

    def _shard_namespace(self, namespace_id: str, shard: int) -> str:
        return namespace_id + self._suffixes[shard]

    def _shard_namespaces(self, namespace_id: str) -> list[str]:
        return [self._shard_namespace(namespace_id, s) for s in range(len(self._clients))]

    def _watch_all(self) -> list:
        """One Watch stream per shard, for the current namespace and generation."""
        return [
            client.watch(
                namespace_id,
                self._mirror.handler(self._generation, shard),
                key_events=self._chunk_events,
            )
            for shard, (client, namespace_id) in enumerate(
                zip(self._clients, self._on_shards, strict=True)
            )
        ]

    # -- the session (stream loop thread) --------------------------------------------------

    def _on_disconnect(self, shard: int) -> None:
        # Pins die with the session; never unpin them in the next one.
        self._pins.on_disconnect(shard)
        self._unpins[shard].on_disconnect()
        if shard == 0:
            self._remote.on_disconnect()

    def _on_session(self, shard: int) -> None:
        self._pins.on_session(shard)
        self._unpins[shard].on_session()
        if shard == 0:
            self._remote.on_session(self._client.hello)
            self._check_shards()
            self._check_policy()

    def _check_policy(self) -> None:
        """Says so (once) when this engine's `eviction_policy` is not the pool's: the
        pool is the node's, its policy the daemon's (an older daemon names none)."""
        hello, wanted = self._client.hello, self._settings.eviction_policy
        running = hello.eviction_policy if hello is not None else ""
        if not wanted or not running or wanted == running or self._policy_said:
            return
        self._policy_said = True
        log.warning(
            "kvdepot: eviction_policy is %r, but the pool at %s is the node's and evicts by "
            "%r (kvdepot serve --eviction-policy %s to change it for every engine)",
            wanted,
            self._settings.socket,
            running,
            wanted,
        )

    def _check_shards(self) -> None:
        """Says so (once) when the daemon runs another number of shards than the engine
        was routed for: routed for fewer, the engine works on shard 0 alone; for more,
        the workers refuse to register (kvdepot.client.vllm.registration)."""
        hello = self._client.hello
        running = (hello.shard_count or 1) if hello is not None else 1
        if running == self._node_shards or self._shards_said:
            return
        self._shards_said = True
        fix = (
            f"kvdepot_shards is {self._node_shards}; set it to {running}"
            if self._settings.shards is not None
            else f"this engine found {self._node_shards} when it started (kvdepot_shards "
            f"auto); restart the engine"
        )
        log.warning(
            "kvdepot: the daemon at %s runs %d shard(s) but %s%s",
            self._settings.socket,
            running,
            fix,
            " to spread this engine's ranks over them (until then every rank uses shard 0)"
            if running > self._node_shards
            else " (until then this engine's ranks offload nothing)",
        )

    # -- figures for tests, tools and benchmarks ------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether every shard the engine uses is connected."""
        return all(c.connected for c in self._clients)

    @property
    def mirror(self) -> ReadyMirror:
        """The ready keys the lookups answer from (tests and tools)."""
        return self._mirror

    @property
    def pin_lane(self) -> PinLane:
        """The lane the step's pins take when it is open (tests and benchmarks)."""
        return self._pins.lanes[0]

    @property
    def unpin_lane(self) -> UnpinLane:
        """The lane the unpin thread uses when it is open (tests and benchmarks)."""
        return self._unpins[0].lane

    @property
    def lanes_open(self) -> bool:
        """Whether every shard's pin and unpin lanes are open (tests and benchmarks: until
        then a shard's pins and unpins go over gRPC)."""
        return all(p.open for p in self._pins.lanes) and all(u.lane.open for u in self._unpins)

    @property
    def mirror_size(self) -> int:
        return len(self._mirror.ready)

    def is_ready(self, key: bytes) -> bool:
        """Whether the mirror holds `key` (for tests and tools)."""
        return key in self._mirror.ready

    @property
    def pin_rpcs(self) -> int:
        """Pin calls completed (one per step with loads)."""
        return self._pins.calls

    @property
    def pin_failures(self) -> int:
        return self._pins.failures

    @property
    def pin_latencies(self) -> list[float]:
        return self._pins.latencies

    @property
    def remote_asked(self) -> int:
        return self._remote.asked

    @property
    def remote_gave_up(self) -> int:
        return self._remote.gave_up

    @property
    def prefetch_rpcs(self) -> int:
        return self._remote.rpcs

    # -- lookups and loads ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # Hot path (called per key, many times per step): one set probe. No locals: a
        # store and a load cost more here than reading the attribute twice.
        tiers = req_context.load_tier_filter
        if tiers is not _ALL_TIERS and not tiers_allowed(tiers)[0]:
            return _MISS  # the request loads from no tier of ours (vLLM's kv_load_tiers)
        if key in self._mirror.ready:
            if self._failures.until and key in self._failures.until:
                return _MISS
            return _HIT
        if self._remote.on and (tiers is _ALL_TIERS or tiers_allowed(tiers)[1]):
            return self._remote.lookup(key, req_context.req_id)
        return _MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """`disk` for the first load of a key the daemon promoted from its disk for
        this engine, `external_unspecified` for one the fleet sent, else `host`."""
        return self._remote.load_source(key)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        self._pins.add(req_context.req_id, self._on_shards, keys)
        self._uses.note(req_context.req_id, keys)
        if self._remote.fetching:
            self._remote.arrived(keys)
        return KVDepotLoadSpec(self.namespace_id, keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        released = self._pins.release(req_context.req_id)
        for held, unpins, namespace_id in zip(released, self._unpins, self._on_shards, strict=True):
            if held:
                unpins.unpin(namespace_id, held)

    def note_load_failures(self, keys: Iterable[bytes]) -> None:
        """Keys whose load failed: miss on them for `load_failure_backoff_s`, so a
        request recomputes instead of being sent to the same failure again."""
        n = self._failures.note(keys)
        if n:
            self._stats.count(MetricName.LOAD_FAILURES, n)

    # -- stores ---------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if not self.connected:
            # Dropped, not refused: returning None would make vLLM log a warning
            # per request per step while the daemon is away.
            self._stats.count(MetricName.STORES_NOT_OFFERED, len(keys))
            return self._nothing_to_store()
        generation = self._request_generation.get(req_context.req_id, self._generation)
        if generation != self._generation:
            # Its KV was computed before a reset (old weights, say): never offered
            # to the namespace after it.
            return self._nothing_to_store()
        ready, storing = self._mirror.ready, self._storing
        keys_to_store = [k for k in keys if k not in ready and k not in storing]
        if self._offers.on:
            candidates = len(keys_to_store)
            keys_to_store = self._offers.offer(list(keys), keys_to_store)
            if skipped := candidates - len(keys_to_store):
                self._stats.count(MetricName.STORES_SKIPPED, skipped)
        storing.update(keys_to_store)
        # Stored already, stored now or by another request: used, either way.
        self._uses.note(req_context.req_id, keys)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=KVDepotStoreSpec(self.namespace_id, keys_to_store),
            evicted_keys=[],
        )

    def _nothing_to_store(self) -> PrepareStoreOutput:
        return PrepareStoreOutput(
            keys_to_store=[],
            store_spec=KVDepotStoreSpec(self.namespace_id, []),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        # Readiness comes from the Watch stream only (a store may have been
        # dropped by the daemon, or need another rank's section first).
        self._storing.difference_update(keys)
        if success and self._remote.on:
            self._remote.stored(keys)
        waiting = self._touch_after_store.get(req_context.req_id)
        if waiting is not None and self._storing.isdisjoint(waiting):
            del self._touch_after_store[req_context.req_id]
            self._touch(waiting)

    # -- step hooks ------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_generation[req_context.req_id] = self._generation
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Sends the request's chunks as one touch (RequestUses), once its stores are
        in (a chunk still being written would come out younger than the head)."""
        generation = self._request_generation.pop(req_context.req_id, self._generation)
        used = self._uses.finish(req_context.req_id)
        if not used or generation != self._generation:
            return
        if self._storing.isdisjoint(used):
            self._touch(used)
        else:
            waiting = self._touch_after_store
            if len(waiting) >= MAX_TOUCHES_WAITING:  # stores that never end: forget the oldest
                del waiting[next(iter(waiting))]
            waiting[req_context.req_id] = used

    def _touch(self, keys: list[bytes]) -> None:
        for unpins, namespace_id, lacked in zip(
            self._unpins, self._on_shards, self._part_lacks, strict=True
        ):
            # A part holds no key of the groups its stage has no layer of.
            held = [k for k in keys if group_of_key(k) not in lacked] if lacked else keys
            unpins.touch(namespace_id, held)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._pins.step_loads:
            missing = self._pins.pin_step(self._on_shards)
            if missing:
                # Gone since the mirror said ready (the REMOVED event is on its way).
                self._mirror.discard(missing)
        self._remote.end_step(self._generation, self.namespace_id, self._mirror.ready)
        self._failures.prune()

    def follow_tracker(self, tracker: OffloadingEventsTracker) -> None:
        """Lends `tracker` (vLLM's scheduler's, self-describing) the chunk events that
        came with the Watch streams' keys, for the step that translates their events."""
        self._tracker_feed = TrackerFeed(tracker)

    def take_events(self) -> Iterable[OffloadingEvent]:
        feed = self._tracker_feed
        if feed is None:
            return self._mirror.take_events()
        # The last step's events are translated by now (vLLM's connector drains this,
        # then translates, every step): its loans go back before this step's.
        feed.withdraw()
        return self._mirror.take_events(feed.lend)

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        """Moves this engine to a fresh, private namespace: later lookups miss and
        nothing from before the reset is ever loaded, while blocks other engines
        share in the old namespace stay untouched (a reset must not destroy them).

        In force when this returns, whatever the Watch stream, the worker's
        registration or the daemon are doing: the mirror starts the new generation
        under the lock the Watch handler applies events under, so no event of the
        old namespace reaches the new mirror; nothing here waits on the network.
        Requests that were running at the reset hold KV computed before it (vLLM
        re-offloads them from chunk 0): they store nothing from now on."""
        old_on_shards = self._on_shards
        self._generation += 1
        self._remote.reset(self._generation)
        self.namespace_id = reset_namespace_id(
            # 122 random bits: the private namespace cannot be guessed (and so
            # joined) even where the base id is public.
            self._base_namespace_id,
            self._generation,
            uuid.uuid4().hex,
        )
        self._on_shards = self._shard_namespaces(self.namespace_id)
        self._mirror.start_generation(self._generation)
        self._failures.clear()
        self._storing = set()
        self._uses.clear()
        self._touch_after_store.clear()
        for old_held, unpins, old_namespace in zip(
            self._pins.reset(), self._unpins, old_on_shards, strict=True
        ):
            if old_held:
                unpins.unpin_all(old_namespace, old_held)
        old_watches, self._watches = self._watches, self._watch_all()
        for old_watch in old_watches:
            # Stopping joins the old Watch thread: not on the scheduler thread.
            threading.Thread(target=old_watch.stop, name="kvdepot-watch-stop", daemon=True).start()
        log.info("kvdepot: cache reset; this engine now uses namespace %s", self.namespace_id)

    # -- metrics and shutdown -------------------------------------------------------------

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What happened since the last call, and the gauges when they changed (None on
        a quiet step); see StepStats.take."""
        return self._stats.take(
            self.connected, len(self._mirror.ready), PoolUsage.of(self._clients)
        )

    def config_info(self) -> Sequence[Mapping[str, object]]:
        # vLLM 0.33's ConfigInfoMapping is a plain mapping; 0.32 has neither the type
        # nor this call.
        return [
            {
                "kvdepot_socket": self._settings.socket,
                "kvdepot_namespace": self._base_namespace_id,
            }
        ]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for unpins in self._unpins:
            unpins.close()
        self._remote.close()
        try:
            for watch in self._watches:
                watch.stop()
        finally:
            # Ending the session releases our pins in the daemon.
            for lane, unpins, client in zip(
                self._pins.lanes, self._unpins, self._clients, strict=True
            ):
                lane.drop()
                unpins.lane.drop()
                client.close()
