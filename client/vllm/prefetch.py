"""The tiers below the pool, as the scheduler sees them: keys missing locally are asked
for, not missed.

When the daemon has a tier below its pool, `--disk` or `--remote` (SessionHello.remote_tier),
and `kvdepot_remote_wait_ms` is above 0, a key missing from the mirror answers RETRY ("ask
again next step") and is collected with its request's; at the step's end the step's keys
go to the prefetch thread, which sends one Prefetch RPC per request (the daemon fetches
the leading run of a request's keys that some tier holds, never a key behind one none
holds: one request's keys per call, in its lookups' order). Keys the tier lacks become misses
as soon as the answer arrives; fetched keys turn into hits when Watch announces them
(the mirror's job) and, once loaded, are no longer being fetched (evicted again, they are
asked for again); a key still not here after `kvdepot_remote_wait_ms` counts as a miss
and is recomputed. A key the tier lacked, or gave up on, is not asked for again for
`NO_REMOTE_S`, unless it is stored in the meantime (by this engine, or seen in the pool):
it then goes below the pool when RAM evicts it. The scheduler thread never waits on the
network for any of it.

Where a fetched key came from (vLLM's cache-hit sources, `vllm:prompt_tokens_cached_by_source`):
the daemon says which keys it promotes from its disk (PrefetchResponse.from_disk); the
first load of such a key reports `disk`, of a key the fleet sent `external_unspecified`
(vLLM has no source for a shared store), of any other `host` (the pool).

Threads and ownership (`RemotePrefetch` owns the keys being fetched, the keys not to
ask for, the step's keys, the queue to the prefetch thread and that thread):
- `lookup`, `arrived`, `stored`, `load_source`, `end_step` and `reset` run on vLLM's
  scheduler thread;
- `_run` is the "kvdepot-prefetch" thread: it sends the Prefetch RPCs of the current
  generation (the namespace's: `reset` starts a new one) and marks the keys the tier
  lacks, one GIL-atomic dict operation at a time. It waits without a timeout
  (`close` wakes it to end);
- `on_session` and `on_disconnect` run on the client's stream loop thread: `on` says
  whether this session's daemon has a tier to ask.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import grpc
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.vllm.load_failures import LoadFailureBackoff
from kvdepot.client.vllm.stats import MetricName, StepStats
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.vllm.manager")

_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_ABSENT = depot_pb2.PrefetchResponse.ABSENT
_FETCHING = depot_pb2.PrefetchResponse.FETCHING
_DISK, _FLEET = CacheHitSource.DISK, CacheHitSource.EXTERNAL_UNSPECIFIED
# Seconds a fetched key's source waits for its load (a key never loaded is forgotten).
SOURCE_KEEP_S = 30.0
# A key the remote tier lacked (or gave up on) is not asked for again this long:
# it is recomputed here and stored in this node's pool meanwhile.
NO_REMOTE_S = 10.0


class RemotePrefetch:
    """Asks the daemon's remote tier for the keys a step misses locally."""

    def __init__(
        self,
        clients: Sequence[DepotClient],
        stats: StepStats,
        failures: LoadFailureBackoff,
        wait_s: float,
        shard_namespace: Callable[[str, int], str],
    ) -> None:
        """`clients`: one per daemon shard the engine uses (each fetches its sections);
        `shard_namespace(namespace, shard)` names the namespace on a shard.
        `failures`: keys in back-off are not asked for (read only)."""
        self._clients = list(clients)
        self._shard_namespace = shard_namespace
        self._stats = stats
        self._failures = failures
        self._wait_s = wait_s
        self.on = False
        self._generation = 0
        # Keys asked of the tier -> monotonic deadline; keys it lacked (or that took
        # too long) -> until when they count as misses; this step's keys to ask for.
        self._fetching: dict[bytes, float] = {}
        self._no_remote: dict[bytes, float] = {}
        self._next_prune = 0.0
        # Keys the tier is sending -> (where from, monotonic time of the answer): the
        # first load of each reports it (`load_source`); pruned after SOURCE_KEEP_S.
        self._sources: dict[bytes, tuple[CacheHitSource, float]] = {}
        self._step_keys: dict[str, list[bytes]] = {}  # request id -> its keys, in order
        # (generation, namespace, one request's keys) for the prefetch thread.
        self._queue: list[tuple[int, str, list[bytes]]] = []
        # Figures for benchmarks and tests (monotonic counters).
        self.asked = 0
        self.gave_up = 0
        self.rpcs = 0
        self._closed = False
        self._wakeup = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdepot-prefetch", daemon=True)
        self._thread.start()

    def lookup(self, key: bytes, req_id: str) -> LookupResult:
        """A key of request `req_id` missing locally while `on`: RETRY while it may still
        arrive, MISS once the tier lacked it or the wait is over."""
        now = time.monotonic()
        until = self._fetching.get(key)
        if until is not None:
            if now < until:
                return _RETRY
            self._fetching.pop(key, None)
            self._no_remote[key] = now + NO_REMOTE_S
            self.gave_up += 1
            self._stats.count(MetricName.REMOTE_GAVE_UP)
            return _MISS
        backed_off = self._failures.until
        if self._no_remote.get(key, 0.0) > now or (backed_off and key in backed_off):
            return _MISS
        self._fetching[key] = now + self._wait_s
        step = self._step_keys.get(req_id)
        if step is None:
            self._step_keys[req_id] = [key]
        else:
            step.append(key)
        return _RETRY

    def end_step(self, generation: int, namespace_id: str, ready: set[bytes]) -> None:
        """Hands the step's keys to the prefetch thread; forgets settled keys (keys now
        `ready` in the mirror, or whose wait is long over), once a second at most."""
        if self._step_keys:
            step, self._step_keys = self._step_keys, {}
            asked = sum(map(len, step.values()))
            self.asked += asked
            self._stats.count(MetricName.REMOTE_PREFETCH_KEYS, asked)
            self._queue.extend((generation, namespace_id, keys) for keys in step.values())
            self._wakeup.set()
        if self._fetching or self._no_remote or self._sources:
            now = time.monotonic()
            if now >= self._next_prune:
                self._fetching = {
                    k: t for k, t in self._fetching.items() if k not in ready and t > now - 1.0
                }
                # A key now in the pool (another engine stored it) is no longer absent.
                self._no_remote = {
                    k: t for k, t in self._no_remote.items() if t > now and k not in ready
                }
                if self._sources:
                    old = now - SOURCE_KEEP_S
                    self._sources = {k: v for k, v in self._sources.items() if v[1] > old}
                self._next_prune = now + 1.0

    @property
    def fetching(self) -> bool:
        """Keys asked of the tier and not arrived (nor given up) yet."""
        return bool(self._fetching)

    def arrived(self, keys: Iterable[bytes]) -> None:
        """Keys being loaded (so they came): no longer being fetched. A key left
        "fetching" once here would, when RAM evicted it again before the once-a-second
        prune saw it ready, answer RETRY without being asked for until its wait ran out,
        and then count as a miss not asked for again for NO_REMOTE_S."""
        fetching = self._fetching
        for key in keys:
            fetching.pop(key, None)

    def load_source(self, key: bytes) -> CacheHitSource:
        """Where a key being loaded came from: the tier below that sent it, the first
        time it is asked; the pool (`host`) otherwise."""
        found = self._sources.pop(key, None) if self._sources else None
        return found[0] if found is not None else CacheHitSource.HOST

    def stored(self, keys: Iterable[bytes]) -> None:
        """Keys this engine stored: the tier's "absent" for them is stale (they go
        below the pool when RAM evicts them), so a later miss asks again."""
        no_remote = self._no_remote
        for key in keys:
            no_remote.pop(key, None)

    def reset(self, generation: int) -> None:
        """A new namespace: what was asked for the old one no longer counts."""
        self._generation = generation
        self._fetching, self._no_remote, self._step_keys = {}, {}, {}
        self._sources = {}

    def _run(self) -> None:
        while not self._closed:
            self._wakeup.wait()
            self._wakeup.clear()
            batch, self._queue = self._queue, []
            for generation, namespace_id, keys in batch:
                if generation == self._generation:
                    self._prefetch(namespace_id, keys)

    def _prefetch(self, namespace_id: str, keys: list[bytes]) -> None:
        """Asks every shard for its sections of `keys`; a key any shard lacks is a miss."""
        absent = [False] * len(keys)
        fetched: list[int] = []  # shard 0's answer: where each key comes from
        from_disk: Sequence[bool] = ()
        for shard, client in enumerate(self._clients):
            states, disk = self._prefetch_shard(client, namespace_id, shard, keys)
            if shard == 0:
                fetched, from_disk = states, disk
            for i, state in enumerate(states):
                if state == _ABSENT:
                    absent[i] = True
        until = time.monotonic() + NO_REMOTE_S
        fetching, no_remote, sources = self._fetching, self._no_remote, self._sources
        now = time.monotonic()
        for i, (key, lacked) in enumerate(zip(keys, absent, strict=True)):
            if lacked:  # recompute it: a miss from the next lookup on
                no_remote[key] = until
                fetching.pop(key, None)
            elif fetched[i] == _FETCHING:
                via_disk = i < len(from_disk) and from_disk[i]
                sources[key] = (_DISK if via_disk else _FLEET, now)

    def _prefetch_shard(
        self, client: DepotClient, namespace_id: str, shard: int, keys: list[bytes]
    ) -> tuple[list[int], Sequence[bool]]:
        """One shard's Prefetch answer: a state per key (all ABSENT when it failed), and
        which come from its disk (empty: none)."""
        try:
            resp = client.prefetch(
                self._shard_namespace(namespace_id, shard), keys, timeout=max(self._wait_s, 0.5)
            )
        except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code == grpc.StatusCode.UNIMPLEMENTED:  # a daemon without the call
                self.on = False
            log.debug("kvdepot prefetch of %d keys failed: %s", len(keys), exc)
            return [_ABSENT] * len(keys), ()
        self.rpcs += 1
        if not resp.remote_tier:
            self.on = False
        return list(resp.states), list(resp.from_disk)

    def on_session(self, hello: depot_pb2.SessionHello | None) -> None:
        # kvdepot_remote_wait_ms = 0: this engine never waits for the tier, nor asks it.
        self.on = bool(hello is not None and hello.remote_tier) and self._wait_s > 0

    def on_disconnect(self) -> None:
        self.on = False

    def close(self) -> None:
        """Ends the thread (it exits at its next wake-up, which this causes)."""
        self._closed = True
        self._wakeup.set()
