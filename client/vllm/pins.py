"""Pin scheduling: every key a scheduler step loads is pinned in the daemon, on every
shard the engine uses, before the step ends, and held for its request until that
request's load completes.

vLLM calls `prepare_load` once per loading request while it builds a step. `StepPins`
records the keys once for all shards, and once `EARLY_PIN_KEYS` of them are waiting
sends them as one pin call on each shard's pin lane (kvdepot.client.pin_lane) without
waiting: the daemons pin them while the scheduler prepares the step's other requests.
Every shard pins the same keys (each holds its ranks' sections of the rows), so a part's
keys are listed and encoded once and only the call's header differs by shard. `pin_step`,
at the step's end, sends the rest to every shard before it reads any answer, then reads
each shard's answers under one `kvdepot_pin_timeout_ms` deadline for the whole step; the
keys a lane did not answer (no lane, a part it refused) go in one Pin RPC to that shard,
so none is pinned twice. That is the only network wait a scheduler step can have, only
steps with hits have it, and it lasts as long as the slowest shard, not their sum.

Pins are held per request and shard, not per key (no per-key bookkeeping in the step,
and a key two requests load is pinned twice): vLLM runs at most one load per request at
a time and completes it with the keys it prepared, so `release` hands back exactly what
each shard pinned.

Threads and ownership (`StepPins` owns the step's loads, the held pins and a PinLane per
shard):
- `add`, `send_waiting`, `pin_step`, `release` and `reset` run on vLLM's scheduler thread;
- `on_session` and `on_disconnect` run on a shard's client stream loop thread (session
  listeners): pins die with their session, so `on_disconnect` forgets that shard's held
  pins by replacing its dict (one GIL-atomic store), never unpinning them in the next
  session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from itertools import compress

import grpc

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.pin_lane import PinLane, PinTimeout, encode_pin_keys
from kvdepot.client.vllm.stats import MetricName, StepStats
from kvdepot.common.chunks import key_suffixes

log = logging.getLogger("kvdepot.vllm.manager")

# A step's loads go to the pin lanes in parts of about this many keys as vLLM
# prepares them (a 1024-key pin takes the daemon about 0.6 ms; parts let it work
# while the scheduler goes on), so that the step's end waits for the last part only.
# Read at each call (tests lower it).
EARLY_PIN_KEYS = 256


def _parts(
    loads: list[tuple[str, list[bytes]]], starts: Iterable[int]
) -> dict[int, tuple[list[bytes], bytes]]:
    """For each of `starts` short of the end, the keys of the step's loads from that
    load on and their encoding (encode_pin_keys): listed and encoded once, however many
    shards send from there (normally all of them, from the same load)."""
    parts: dict[int, tuple[list[bytes], bytes]] = {}
    for start in starts:
        if start < len(loads) and start not in parts:
            keys = [k for _, request_keys in loads[start:] for k in request_keys]
            parts[start] = (keys, encode_pin_keys(keys))
    return parts


class StepPins:
    """The pins of each scheduler step's loads on every shard, held per request and
    shard until its load completes."""

    def __init__(
        self,
        clients: Sequence[DepotClient],
        stats: StepStats,
        timeout_s: float,
        lacks: Sequence[frozenset[int]] = (),
    ) -> None:
        """`clients`: one per shard the engine uses, shard 0 first; `lacks`: per shard,
        the ids of the groups it holds no key of (a pipeline stage with no layer of
        them): their keys are not pinned there, and such a shard's keys go at the
        step's end only."""
        self._clients = list(clients)
        self._lacked = [key_suffixes(lacked) for lacked in lacks] or [frozenset()] * len(clients)
        self._stats = stats
        self._timeout_s = timeout_s
        self.lanes = [PinLane(c) for c in self._clients]
        # This step's loads, (request id, keys) per prepare_load, and how many keys
        # wait to go; per shard, how many of the loads went early on its lane.
        self.step_loads: list[tuple[str, list[bytes]]] = []
        self._keys_waiting = 0
        self._loads_sent = [0] * len(self._clients)
        # Per shard: request id -> the keys pinned there for its load.
        self._held: list[dict[str, list[bytes]]] = [{} for _ in self._clients]
        # Figures for benchmarks and tests (monotonic counters): one per step with loads.
        self.latencies: list[float] = []
        self.calls = 0
        self.failures = 0

    def add(self, req_id: str, namespace_ids: Sequence[str], keys: list[bytes]) -> None:
        """Records one request's loads for this step's pins (sending a part to every
        shard if enough wait). `namespace_ids`: the namespace as each shard names it."""
        self.step_loads.append((req_id, keys))
        self._keys_waiting += len(keys)
        if self._keys_waiting >= EARLY_PIN_KEYS:
            self.send_waiting(namespace_ids)

    def send_waiting(self, namespace_ids: Sequence[str]) -> None:
        """Sends the step's keys not sent yet as one pin call on each shard's lane,
        answered at the step's end (`pin_step`). Keys that cannot go now are pinned there."""
        loads = self.step_loads
        self._keys_waiting = 0
        parts = _parts(loads, self._loads_sent)
        for shard, namespace_id in enumerate(namespace_ids):
            if self._lacked[shard]:  # its share of the keys goes at the step's end
                continue
            part = parts.get(self._loads_sent[shard])
            if part is None or self._send(shard, namespace_id, *part):
                self._loads_sent[shard] = len(loads)

    def _send(self, shard: int, namespace_id: str, keys: list[bytes], payload: bytes) -> bool:
        client = self._clients[shard]
        try:
            return self.lanes[shard].send(client.session_id, namespace_id, keys, payload=payload)
        except DepotUnavailable:
            return False

    def pin_step(self, namespace_ids: Sequence[str]) -> list[bytes]:
        """Pins every key this step loads on every shard, under the pin deadline;
        returns the keys found gone on some shard (the mirror still lists them: their
        REMOVED event is on its way)."""
        loads, self.step_loads = self.step_loads, []
        loads_sent, self._loads_sent = self._loads_sent, [0] * len(self._clients)
        self._keys_waiting = 0
        keys = [k for _, request_keys in loads for k in request_keys]
        if not keys:
            return []
        start = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        # What did not go early goes now, to every shard before any answer is read.
        rest = _parts(loads, loads_sent)
        # A shard that lacks groups pins the keys of the others alone, all sent now.
        shares = [self._share(loads, lacked) for lacked in self._lacked]
        for shard, (n, namespace_id) in enumerate(zip(loads_sent, namespace_ids, strict=True)):
            share = shares[shard]
            if share is not None:
                if share[1]:
                    self._send(shard, namespace_id, *_parts(share[0], [0])[0])
            elif n in rest:
                self._send(shard, namespace_id, *rest[n])
        missing: list[bytes] = []
        for shard, namespace_id in enumerate(namespace_ids):
            share = shares[shard]
            if share is None:
                missing += self._settle(shard, namespace_id, loads, keys, deadline)
            elif share[1]:
                missing += self._settle(shard, namespace_id, *share, deadline)
        elapsed = time.perf_counter() - start
        self.calls += 1
        self.latencies.append(elapsed)
        if len(self.latencies) > 100_000:
            del self.latencies[:50_000]
        self._stats.count_pin(elapsed, len(set(missing)))
        return missing

    @staticmethod
    def _share(
        loads: list[tuple[str, list[bytes]]], lacked: frozenset[bytes]
    ) -> tuple[list[tuple[str, list[bytes]]], list[bytes]] | None:
        """The step's loads and keys less those of the `lacked` groups (by key suffix);
        None when a shard lacks none (it pins them all)."""
        if not lacked:
            return None
        share = [(req_id, [k for k in keys if k[-4:] not in lacked]) for req_id, keys in loads]
        return share, [k for _, keys in share for k in keys]

    def _settle(
        self,
        shard: int,
        namespace_id: str,
        loads: list[tuple[str, list[bytes]]],
        keys: list[bytes],
        deadline: float,
    ) -> list[bytes]:
        """Reads one shard's answers (gRPC for what its lane did not answer), holds
        what it pinned per request, and returns the keys it found gone."""
        try:
            pinned = self._answers(shard, namespace_id, keys, deadline)
        except (DepotUnavailable, grpc.RpcError, PinTimeout) as exc:
            # The loads go ahead unpinned there: a key evicted meanwhile fails its
            # load, which vLLM recomputes. Never worse than a miss.
            self.failures += 1
            self._stats.count(MetricName.PIN_FAILURES)
            if isinstance(exc, grpc.RpcError):
                code = exc.code()
            else:
                code = "DEADLINE_EXCEEDED" if isinstance(exc, PinTimeout) else "UNAVAILABLE"
            log.warning(
                "kvdepot pin of %d keys failed on shard %d (%s); loading them unpinned",
                len(keys),
                shard,
                code,
            )
            return []
        every = len(pinned) == len(keys) and all(pinned)  # the common case
        missing = [] if every else [k for k, ok in zip(keys, pinned, strict=False) if not ok]
        held, answers = self._held[shard], iter(pinned)
        for req_id, request_keys in loads:
            ok = request_keys if every else list(compress(request_keys, answers))
            if ok:
                prev = held.get(req_id)  # never set in vLLM 0.33: one load per request
                held[req_id] = ok if prev is None else prev + ok
        return missing

    def _answers(
        self, shard: int, namespace_id: str, keys: list[bytes], deadline: float
    ) -> list[bool]:
        """Per key, whether `shard` pinned it: its lane's answers to everything sent
        this step, then gRPC for the keys the lane did not answer."""
        lane, client = self.lanes[shard], self._clients[shard]
        # Always read what was sent, so that no answer is left for the next step.
        pinned = lane.answers(max(deadline - time.monotonic(), 1e-3))
        if len(pinned) < len(keys):
            pinned += client.pin(
                namespace_id,
                keys[len(pinned) :],
                timeout=max(deadline - time.monotonic(), 1e-3),
            )
        return pinned

    def release(self, req_id: str) -> list[list[bytes] | None]:
        """Per shard, the keys pinned for the request's load, no longer held (to unpin)."""
        return [held.pop(req_id, None) for held in self._held]

    def reset(self) -> list[list[list[bytes]]]:
        """Forgets the step's loads and every held pin; returns, per shard, the held
        keys (to unpin)."""
        held, self._held = self._held, [{} for _ in self._clients]
        self.step_loads = []
        self._loads_sent = [0] * len(self._clients)
        self._keys_waiting = 0
        return [list(h.values()) for h in held]

    def on_session(self, shard: int) -> None:
        self.lanes[shard].open_soon()

    def on_disconnect(self, shard: int) -> None:
        self._held[shard] = {}
        self.lanes[shard].drop()
