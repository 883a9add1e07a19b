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
  stored); the daemon allocates when the copy arrives and may drop it.
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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import compress

import grpc
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.pin_lane import PinLane, PinTimeout, UnpinLane
from kvdepot.client.vllm.config import DepotSettings
from kvdepot.client.vllm.namespace import reset_namespace_id
from kvdepot.client.vllm.transfer_specs import KVDepotLoadSpec, KVDepotStoreSpec
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.manager")

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_ABSENT = depot_pb2.PrefetchResponse.ABSENT
# A key the remote tier lacked (or gave up on) is not asked for again this long:
# it is recomputed here and stored in this node's pool meanwhile.
NO_REMOTE_S = 10.0
# A step's loads go to the pin lane in parts of about this many keys as vLLM
# prepares them (a 1024-key pin takes the daemon about 0.6 ms; parts let it work
# while the scheduler goes on), so that the step's end waits for the last part only.
EARLY_PIN_KEYS = 256
_SNAPSHOT = depot_pb2.WatchEvent.SNAPSHOT
_SNAPSHOT_END = depot_pb2.WatchEvent.SNAPSHOT_END
_STORED = depot_pb2.WatchEvent.STORED
_REMOVED = depot_pb2.WatchEvent.REMOVED


class MetricName:
    """Metrics this manager reports through vLLM's offloading stats."""

    CONNECTED = "kvdepot_connected"
    MIRROR_KEYS = "kvdepot_mirror_keys"
    PINS = "kvdepot_pin_rpcs"
    PIN_FAILURES = "kvdepot_pin_failures"
    PIN_SECONDS = "kvdepot_pin_seconds"
    PIN_MISSES = "kvdepot_pin_misses"
    STORES_NOT_OFFERED = "kvdepot_stores_not_offered"
    LOAD_FAILURES = "kvdepot_load_failures"
    REMOTE_PREFETCH_KEYS = "kvdepot_remote_prefetch_keys"
    REMOTE_GAVE_UP = "kvdepot_remote_gave_up"


class KVDepotOffloadingManager(OffloadingManager):
    """An OffloadingManager whose blocks live in the kvdepot daemon.

    `lock` stays vLLM's default no-op: no vLLM-facing method is entered from
    another thread. The Watch thread only swaps or mutates the mirror set, one
    GIL-atomic operation at a time, and a HIT that is evicted before the pin is
    caught by the pin (the load then fails and vLLM recomputes).
    """

    def __init__(
        self,
        client: DepotClient,
        namespace_id: str,
        settings: DepotSettings,
        enable_events: bool = False,
    ) -> None:
        self._client = client
        self._settings = settings
        self._base_namespace_id = namespace_id
        self.namespace_id = namespace_id
        self._generation = 0
        # The mirror: keys the daemon reported ready in the current namespace.
        self._ready: set[bytes] = set()
        # Keys whose load failed recently -> monotonic time when they may hit again.
        self._quarantine: dict[bytes, float] = {}
        self._quarantine_check = 0.0
        # Keys offered for store whose job has not completed.
        self._storing: set[bytes] = set()
        # This step's loads, (request id, keys) per prepare_load, pinned by
        # on_schedule_end; how many of them went early on the pin lane, and how many
        # keys wait to go.
        self._step_loads: list[tuple[str, list[bytes]]] = []
        self._loads_sent = 0
        self._keys_waiting = 0
        # The keys pinned for each request's load, unpinned by its complete_load
        # (vLLM runs at most one load per request at a time, and completes it with
        # the keys it prepared). Per request, not per key: no per-key bookkeeping in
        # the scheduler's step, and a key two requests load is pinned twice.
        self._held: dict[str, list[bytes]] = {}
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._events_lock = threading.Lock()
        # Held while a Watch event is applied and while reset_cache switches the
        # namespace and the mirror (never on lookup's path).
        self._watch_lock = threading.Lock()
        self._watch_generation = 0
        # The generation (resets so far) each request was added in.
        self._request_generation: dict[str, int] = {}
        self._stats = OffloadingConnectorStats()
        self._stats_lock = threading.Lock()
        self._gauges_sent: tuple[float, float] | None = None  # (connected, mirror keys)
        # Figures for benchmarks and tests (monotonic counters).
        self.pin_latencies: list[float] = []
        self.pin_rpcs = 0
        self.pin_failures = 0
        self.watch_events = 0
        self._closed = False
        # (namespace, keys) pins to drop, one per key, sent by the unpin thread.
        self._unpins: list[tuple[str, list[bytes]]] = []
        self._unpin_wakeup = threading.Event()
        self._unpin_thread = threading.Thread(
            target=self._unpin_loop, name="kvdepot-unpin", daemon=True
        )
        self._unpin_thread.start()
        # The remote tier: keys asked of it -> monotonic deadline; keys it lacked
        # (or that took too long) -> until when they count as misses; this step's
        # keys to ask for; (generation, namespace, keys) for the prefetch thread.
        self._remote_on = False
        self._remote_wait_s = float(getattr(settings, "remote_wait_s", 0.2))
        self._fetching: dict[bytes, float] = {}
        self._no_remote: dict[bytes, float] = {}
        self._remote_check = 0.0
        self._step_prefetch: list[bytes] = []
        self._prefetches: list[tuple[int, str, list[bytes]]] = []
        self.remote_asked = 0
        self.remote_gave_up = 0
        self.prefetch_rpcs = 0
        self._prefetch_wakeup = threading.Event()
        self._prefetch_thread = threading.Thread(
            target=self._prefetch_loop, name="kvdepot-prefetch", daemon=True
        )
        self._prefetch_thread.start()
        # The step's pins, and the unpin thread's unpins, go on lanes when the daemon
        # has them (kvdepot.client.pin_lane).
        self._pin_lane = PinLane(client)
        self._unpin_lane = UnpinLane(client)
        client.add_session_listener(self._on_session)
        client.add_disconnect_listener(self._on_disconnect)
        self._watch = client.watch(namespace_id, self._watch_handler(0))

    # -- the mirror (Watch thread) ------------------------------------------------------

    def _watch_handler(self, generation: int):
        def on_event(event: depot_pb2.WatchEvent) -> None:
            # Events of a namespace we left (reset_cache) must not touch the mirror.
            # Checked and applied under the lock reset_cache switches namespaces
            # under: an event that passed the check must not land in the new mirror.
            with self._watch_lock:
                if generation != self._watch_generation:
                    return
                self._on_watch_event(event)

        return on_event

    def _on_watch_event(self, event: depot_pb2.WatchEvent) -> None:
        self.watch_events += 1
        kind = event.kind
        if kind == _STORED:
            keys = list(event.keys)
            self._ready.update(keys)
            self._emit(keys, removed=False)
        elif kind == _REMOVED:
            keys = list(event.keys)
            self._ready.difference_update(keys)
            self._emit(keys, removed=True)
        elif kind == _SNAPSHOT:
            if event.reset:
                # Forget everything: the daemon restarted, or we lost it. A new
                # set (not clear()) so that a concurrent lookup never sees a
                # half-cleared mirror it could mistake for anything else.
                old, self._ready = self._ready, set()
                self._quarantine = {}
                if old:
                    self._emit(list(old), removed=True)
            keys = list(event.keys)
            if keys:
                self._ready.update(keys)
                self._emit(keys, removed=False)
        # SNAPSHOT_END: nothing to do, the snapshot keys are in already.

    def _emit(self, keys: list[bytes], removed: bool) -> None:
        if self._events is None or not keys:
            return
        event = OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed)  # type: ignore[arg-type]
        with self._events_lock:
            self._events.append(event)

    def _on_disconnect(self) -> None:
        # Pins die with the session; never unpin them in the next one.
        self._held = {}
        self._pin_lane.drop()
        self._unpin_lane.drop()
        self._remote_on = False

    def _on_session(self, boot_id: str) -> None:
        self._pin_lane.open_soon()
        self._unpin_lane.open_soon()
        hello = self._client.hello
        # kvdepot_remote_wait_ms = 0: this engine never waits for the tier, nor asks it.
        self._remote_on = bool(hello is not None and hello.remote_tier) and (
            self._remote_wait_s > 0
        )

    @property
    def connected(self) -> bool:
        return self._client.connected

    @property
    def pin_lane(self) -> PinLane:
        """The lane the step's pins take when it is open (tests and benchmarks)."""
        return self._pin_lane

    @property
    def unpin_lane(self) -> UnpinLane:
        """The lane the unpin thread uses when it is open (tests and benchmarks)."""
        return self._unpin_lane

    @property
    def mirror_size(self) -> int:
        return len(self._ready)

    def is_ready(self, key: bytes) -> bool:
        """Whether the mirror holds `key` (for tests and tools)."""
        return key in self._ready

    # -- lookups and loads ------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # Hot path (called per key, many times per step): one set probe.
        if key in self._ready:
            if self._quarantine and key in self._quarantine:
                return _MISS
            return _HIT
        if self._remote_on:
            return self._remote_lookup(key)
        return _MISS

    def _remote_lookup(self, key: bytes) -> LookupResult:
        """A key missing locally while the daemon has a remote tier: RETRY while it
        may still arrive, MISS once the tier lacked it or the wait is over."""
        now = time.monotonic()
        until = self._fetching.get(key)
        if until is not None:
            if now < until:
                return _RETRY
            self._fetching.pop(key, None)
            self._no_remote[key] = now + NO_REMOTE_S
            self.remote_gave_up += 1
            with self._stats_lock:
                self._stats.increase_counter(MetricName.REMOTE_GAVE_UP, 1)
            return _MISS
        if self._no_remote.get(key, 0.0) > now or (self._quarantine and key in self._quarantine):
            return _MISS
        self._fetching[key] = now + self._remote_wait_s
        self._step_prefetch.append(key)
        return _RETRY

    def _prefetch_loop(self) -> None:
        """Sends each step's keys in one Prefetch RPC (off the scheduler thread)."""
        while not self._closed:
            self._prefetch_wakeup.wait()  # no timeout, as in _unpin_loop
            self._prefetch_wakeup.clear()
            batch, self._prefetches = self._prefetches, []
            for generation, namespace_id, keys in batch:
                if generation == self._generation:
                    self._prefetch(namespace_id, keys)

    def _prefetch(self, namespace_id: str, keys: list[bytes]) -> None:
        try:
            resp = self._client.prefetch(namespace_id, keys, timeout=max(self._remote_wait_s, 0.5))
        except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:  # a daemon without the call
                self._remote_on = False
            log.debug("kvdepot prefetch of %d keys failed: %s", len(keys), exc)
            states = [_ABSENT] * len(keys)
        else:
            self.prefetch_rpcs += 1
            if not resp.remote_tier:
                self._remote_on = False
            states = list(resp.states)
        until = time.monotonic() + NO_REMOTE_S
        fetching, no_remote = self._fetching, self._no_remote
        for key, state in zip(keys, states, strict=False):
            if state == _ABSENT:  # recompute it: a miss from the next lookup on
                no_remote[key] = until
                fetching.pop(key, None)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        self._step_loads.append((req_context.req_id, keys))
        self._keys_waiting += len(keys)
        if self._keys_waiting >= EARLY_PIN_KEYS:
            self._send_early_pins()
        return KVDepotLoadSpec(self.namespace_id, keys)

    def _send_early_pins(self) -> None:
        """Sends the step's keys not sent yet as one pin call on the lane, answered at
        the step's end. Keys that cannot go now are pinned there."""
        loads = self._step_loads
        keys = [k for _, request_keys in loads[self._loads_sent :] for k in request_keys]
        self._keys_waiting = 0
        try:
            sent = self._pin_lane.send(self._client.session_id, self.namespace_id, keys)
        except DepotUnavailable:
            sent = False
        if sent:
            self._loads_sent = len(loads)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        held = self._held.pop(req_context.req_id, None)
        if held:
            # Even a fire-and-forget unary call costs ~1 ms of this thread in
            # Python gRPC; the unpin thread batches them instead.
            self._unpins.append((self.namespace_id, held))
            self._unpin_wakeup.set()

    def _unpin_loop(self) -> None:
        while not self._closed:
            # No timeout: a thread that wakes to find nothing still takes the GIL
            # from the scheduler (shutdown sets the event).
            self._unpin_wakeup.wait()
            self._unpin_wakeup.clear()
            if not self._unpins:
                continue
            batch, self._unpins = self._unpins, []
            by_namespace: dict[str, list[bytes]] = {}
            for ns, keys in batch:
                by_namespace.setdefault(ns, []).extend(keys)
            for ns, keys in by_namespace.items():
                try:
                    left = self._unpin_lane.unpin(self._client.session_id, ns, keys)
                    if left:  # no lane (yet), or it could not take them all
                        self._client.unpin(ns, left, wait=True, timeout=5.0)
                except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
                    # The daemon drops a session's pins when the session ends.
                    log.debug("kvdepot unpin of %d keys skipped: %s", len(keys), exc)

    def note_load_failures(self, keys: Iterable[bytes]) -> None:
        """Keys whose load failed: miss on them for `load_failure_backoff_s`, so a
        request recomputes instead of being sent to the same failure again."""
        until = time.monotonic() + self._settings.load_failure_backoff_s
        quarantine = dict(self._quarantine)
        n = 0
        for key in keys:
            quarantine[key] = until
            n += 1
        self._quarantine = quarantine
        if n:
            with self._stats_lock:
                self._stats.increase_counter(MetricName.LOAD_FAILURES, n)

    def _pin(self, keys: list[bytes], sent: int) -> list[bool]:
        """Pins `keys`, of which the first `sent` went early on the pin lane: the rest
        go on the lane too, and whatever the lane does not answer goes over gRPC."""
        timeout = self._settings.pin_timeout_s
        lane = self._pin_lane
        if sent < len(keys):
            with contextlib.suppress(DepotUnavailable):  # then gRPC's pin says so
                lane.send(self._client.session_id, self.namespace_id, keys[sent:])
        # Always read what was sent, so that no answer is left for the next step.
        pinned = lane.answers(timeout)
        if len(pinned) < len(keys):
            pinned += self._client.pin(self.namespace_id, keys[len(pinned) :], timeout=timeout)
        return pinned

    def _pin_step_loads(self) -> None:
        """Pins every key this step loads, under the pin deadline."""
        loads, self._step_loads = self._step_loads, []
        sent = sum(len(request_keys) for _, request_keys in loads[: self._loads_sent])
        self._loads_sent = self._keys_waiting = 0
        keys = [k for _, request_keys in loads for k in request_keys]
        if not keys:
            return
        start = time.perf_counter()
        try:
            pinned = self._pin(keys, sent)
        except (DepotUnavailable, grpc.RpcError, PinTimeout) as exc:
            # The loads go ahead unpinned: a key evicted meanwhile fails its load,
            # which vLLM recomputes. Never worse than a miss.
            self.pin_failures += 1
            with self._stats_lock:
                self._stats.increase_counter(MetricName.PIN_FAILURES, 1)
            if isinstance(exc, grpc.RpcError):
                code = exc.code()
            else:
                code = "DEADLINE_EXCEEDED" if isinstance(exc, PinTimeout) else "UNAVAILABLE"
            log.warning(
                "kvdepot pin of %d keys failed (%s); loading them unpinned", len(keys), code
            )
            return
        elapsed = time.perf_counter() - start
        self.pin_rpcs += 1
        self.pin_latencies.append(elapsed)
        if len(self.pin_latencies) > 100_000:
            del self.pin_latencies[:50_000]
        every = len(pinned) == len(keys) and all(pinned)  # the common case
        missing = [] if every else [k for k, ok in zip(keys, pinned, strict=False) if not ok]
        held, answers = self._held, iter(pinned)
        for req_id, request_keys in loads:
            ok = request_keys if every else list(compress(request_keys, answers))
            if ok:
                prev = held.get(req_id)  # never set in vLLM 0.33: one load per request
                held[req_id] = ok if prev is None else prev + ok
        if missing:
            # Gone since the mirror said ready (the REMOVED event is on its way).
            self._ready.difference_update(missing)
        with self._stats_lock:
            self._stats.increase_counter(MetricName.PINS, 1)
            self._stats.observe_histogram(MetricName.PIN_SECONDS, elapsed)
            if missing:
                self._stats.increase_counter(MetricName.PIN_MISSES, len(missing))

    # -- stores ---------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if not self._client.connected:
            # Dropped, not refused: returning None would make vLLM log a warning
            # per request per step while the daemon is away.
            with self._stats_lock:
                self._stats.increase_counter(MetricName.STORES_NOT_OFFERED, len(keys))
            return PrepareStoreOutput(
                keys_to_store=[],
                store_spec=KVDepotStoreSpec(self.namespace_id, []),
                evicted_keys=[],
            )
        generation = self._request_generation.get(req_context.req_id, self._generation)
        if generation != self._generation:
            # Its KV was computed before a reset (old weights, say): never offered
            # to the namespace after it.
            return PrepareStoreOutput(
                keys_to_store=[],
                store_spec=KVDepotStoreSpec(self.namespace_id, []),
                evicted_keys=[],
            )
        ready, storing = self._ready, self._storing
        keys_to_store = [k for k in keys if k not in ready and k not in storing]
        storing.update(keys_to_store)
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,  # type: ignore[arg-type]
            store_spec=KVDepotStoreSpec(self.namespace_id, keys_to_store),
            evicted_keys=[],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        # Readiness comes from the Watch stream only (a store may have been
        # dropped by the daemon, or need another rank's section first).
        self._storing.difference_update(keys)

    # -- step hooks ------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_generation[req_context.req_id] = self._generation
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._request_generation.pop(req_context.req_id, None)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._step_loads:
            self._pin_step_loads()
        if self._step_prefetch:
            keys, self._step_prefetch = self._step_prefetch, []
            self.remote_asked += len(keys)
            with self._stats_lock:
                self._stats.increase_counter(MetricName.REMOTE_PREFETCH_KEYS, len(keys))
            self._prefetches.append((self._generation, self.namespace_id, keys))
            self._prefetch_wakeup.set()
        if self._fetching or self._no_remote:
            now = time.monotonic()
            if now >= self._remote_check:  # forget settled keys, once a second
                ready = self._ready
                self._fetching = {
                    k: t for k, t in self._fetching.items() if k not in ready and t > now - 1.0
                }
                self._no_remote = {k: t for k, t in self._no_remote.items() if t > now}
                self._remote_check = now + 1.0
        if self._quarantine:
            now = time.monotonic()
            if now >= self._quarantine_check:
                self._quarantine = {k: t for k, t in self._quarantine.items() if t > now}
                self._quarantine_check = now + 1.0

    def take_events(self) -> Iterable[OffloadingEvent]:
        # A plain function, not a generator: vLLM drains it every step.
        if not self._events:  # events off (None), or none since the last step
            return ()
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        """Moves this engine to a fresh, private namespace: later lookups miss and
        nothing from before the reset is ever loaded, while blocks other engines
        share in the old namespace stay untouched (a reset must not destroy them).

        In force when this returns, whatever the Watch stream, the worker's
        registration or the daemon are doing: the namespace and the mirror switch
        under the lock the Watch handler applies events under, so no event of the
        old namespace reaches the new mirror; nothing here waits on the network.
        Requests that were running at the reset hold KV computed before it (vLLM
        re-offloads them from chunk 0): they store nothing from now on."""
        old_namespace = self.namespace_id
        with self._watch_lock:
            self._generation += 1
            self._watch_generation = self._generation
            self.namespace_id = reset_namespace_id(
                # 122 random bits: the private namespace cannot be guessed (and so
                # joined) even where the base id is public.
                self._base_namespace_id,
                self._generation,
                uuid.uuid4().hex,
            )
            self._ready = set()
        old_held, self._held = self._held, {}
        self._quarantine = {}
        self._storing = set()
        self._step_loads = []
        self._loads_sent = self._keys_waiting = 0
        self._fetching, self._no_remote, self._step_prefetch = {}, {}, []
        if old_held:
            self._unpins.extend((old_namespace, keys) for keys in old_held.values())
            self._unpin_wakeup.set()
        old_watch = self._watch
        self._watch = self._client.watch(self.namespace_id, self._watch_handler(self._generation))
        # Stopping joins the old Watch thread: not on the scheduler thread.
        threading.Thread(target=old_watch.stop, name="kvdepot-watch-stop", daemon=True).start()
        log.info("kvdepot: cache reset; this engine now uses namespace %s", self.namespace_id)

    # -- metrics and shutdown -------------------------------------------------------------

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What happened since the last call, and the gauges when they changed.

        vLLM calls this every step and ships a non-empty answer to its front end;
        Prometheus keeps a gauge's last value, so an unchanged gauge need not travel,
        and a quiet decode step reports nothing (None).
        """
        gauges = (1.0 if self._client.connected else 0.0, float(len(self._ready)))
        with self._stats_lock:
            if gauges == self._gauges_sent and self._stats.is_empty():
                return None
            stats, self._stats = self._stats, OffloadingConnectorStats()
        self._gauges_sent = gauges
        stats.set_gauge(MetricName.CONNECTED, gauges[0])
        stats.set_gauge(MetricName.MIRROR_KEYS, gauges[1])
        return stats

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
        self._unpin_wakeup.set()
        self._prefetch_wakeup.set()
        try:
            self._watch.stop()
        finally:
            # Ending the session releases our pins in the daemon.
            self._pin_lane.drop()
            self._unpin_lane.drop()
            self._client.close()
