"""Pin scheduling: every key a scheduler step loads is pinned in the daemon before the
step ends, and held for its request until that request's load completes.

vLLM calls `prepare_load` once per loading request while it builds a step. `StepPins`
records the keys, and once `EARLY_PIN_KEYS` of them are waiting sends them as one pin
call on the pin lane (kvdepot.client.pin_lane) without waiting: the daemon pins them
while the scheduler prepares the step's other requests. `pin_step`, at the step's end,
sends the rest and reads every answer under `kvdepot_pin_timeout_ms`; the keys the lane
did not answer (no lane, a part it refused) go in one Pin RPC, so none is pinned twice.
That is the only network wait a scheduler step can have, and only steps with hits have it.

Pins are held per request, not per key (no per-key bookkeeping in the step, and a key two
requests load is pinned twice): vLLM runs at most one load per request at a time and
completes it with the keys it prepared, so `release` hands back exactly what it pinned.

Threads and ownership (`StepPins` owns the step's loads, the held pins and the PinLane):
- `add`, `pin_step`, `release` and `reset` run on vLLM's scheduler thread;
- `on_session` and `on_disconnect` run on the client's stream loop thread (session
  listeners): pins die with their session, so `on_disconnect` forgets the held ones by
  replacing the dict (one GIL-atomic store), never unpinning them in the next session.
"""

from __future__ import annotations

import contextlib
import logging
import time
from itertools import compress

import grpc

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.pin_lane import PinLane, PinTimeout
from kvdepot.client.vllm.stats import MetricName, StepStats

log = logging.getLogger("kvdepot.vllm.manager")

# A step's loads go to the pin lane in parts of about this many keys as vLLM
# prepares them (a 1024-key pin takes the daemon about 0.6 ms; parts let it work
# while the scheduler goes on), so that the step's end waits for the last part only.
# Read at each call (tests lower it).
EARLY_PIN_KEYS = 256


class StepPins:
    """The pins of each scheduler step's loads, held per request until its load completes."""

    def __init__(self, client: DepotClient, stats: StepStats, timeout_s: float) -> None:
        self._client = client
        self._stats = stats
        self._timeout_s = timeout_s
        self.lane = PinLane(client)
        # This step's loads, (request id, keys) per prepare_load; how many of them
        # went early on the pin lane, and how many keys wait to go.
        self.step_loads: list[tuple[str, list[bytes]]] = []
        self._loads_sent = 0
        self._keys_waiting = 0
        # Request id -> the keys pinned for its load.
        self._held: dict[str, list[bytes]] = {}
        # Figures for benchmarks and tests (monotonic counters).
        self.latencies: list[float] = []
        self.calls = 0
        self.failures = 0

    def add(self, req_id: str, namespace_id: str, keys: list[bytes]) -> None:
        """Records one request's loads for this step's pin (sending a part if enough wait)."""
        self.step_loads.append((req_id, keys))
        self._keys_waiting += len(keys)
        if self._keys_waiting >= EARLY_PIN_KEYS:
            self.send_waiting(namespace_id)

    def send_waiting(self, namespace_id: str) -> None:
        """Sends the step's keys not sent yet as one pin call on the lane, answered at
        the step's end (`pin_step`). Keys that cannot go now are pinned there."""
        loads = self.step_loads
        keys = [k for _, request_keys in loads[self._loads_sent :] for k in request_keys]
        self._keys_waiting = 0
        try:
            sent = self.lane.send(self._client.session_id, namespace_id, keys)
        except DepotUnavailable:
            sent = False
        if sent:
            self._loads_sent = len(loads)

    def pin_step(self, namespace_id: str) -> list[bytes]:
        """Pins every key this step loads, under the pin deadline; returns the keys
        found gone (the mirror still lists them: their REMOVED event is on its way)."""
        loads, self.step_loads = self.step_loads, []
        sent = sum(len(request_keys) for _, request_keys in loads[: self._loads_sent])
        self._loads_sent = self._keys_waiting = 0
        keys = [k for _, request_keys in loads for k in request_keys]
        if not keys:
            return []
        start = time.perf_counter()
        try:
            pinned = self._pin(namespace_id, keys, sent)
        except (DepotUnavailable, grpc.RpcError, PinTimeout) as exc:
            # The loads go ahead unpinned: a key evicted meanwhile fails its load,
            # which vLLM recomputes. Never worse than a miss.
            self.failures += 1
            self._stats.count(MetricName.PIN_FAILURES)
            if isinstance(exc, grpc.RpcError):
                code = exc.code()
            else:
                code = "DEADLINE_EXCEEDED" if isinstance(exc, PinTimeout) else "UNAVAILABLE"
            log.warning(
                "kvdepot pin of %d keys failed (%s); loading them unpinned", len(keys), code
            )
            return []
        elapsed = time.perf_counter() - start
        self.calls += 1
        self.latencies.append(elapsed)
        if len(self.latencies) > 100_000:
            del self.latencies[:50_000]
        every = len(pinned) == len(keys) and all(pinned)  # the common case
        missing = [] if every else [k for k, ok in zip(keys, pinned, strict=False) if not ok]
        held, answers = self._held, iter(pinned)
        for req_id, request_keys in loads:
            ok = request_keys if every else list(compress(request_keys, answers))
            if ok:
                prev = held.get(req_id)  # never set in vLLM 0.33: one load per request
                held[req_id] = ok if prev is None else prev + ok
        self._stats.count_pin(elapsed, len(missing))
        return missing

    def _pin(self, namespace_id: str, keys: list[bytes], sent: int) -> list[bool]:
        """Pins `keys`, of which the first `sent` went early on the pin lane: the rest
        go on the lane too, and whatever the lane does not answer goes over gRPC."""
        timeout = self._timeout_s
        lane = self.lane
        if sent < len(keys):
            with contextlib.suppress(DepotUnavailable):  # then gRPC's pin says so
                lane.send(self._client.session_id, namespace_id, keys[sent:])
        # Always read what was sent, so that no answer is left for the next step.
        pinned = lane.answers(timeout)
        if len(pinned) < len(keys):
            pinned += self._client.pin(namespace_id, keys[len(pinned) :], timeout=timeout)
        return pinned

    def release(self, req_id: str) -> list[bytes] | None:
        """The keys pinned for the request's load, no longer held (to unpin)."""
        return self._held.pop(req_id, None)

    def reset(self) -> list[list[bytes]]:
        """Forgets the step's loads and every held pin; returns the held keys (to unpin)."""
        held, self._held = self._held, {}
        self.step_loads = []
        self._loads_sent = self._keys_waiting = 0
        return list(held.values())

    def on_session(self) -> None:
        self.lane.open_soon()

    def on_disconnect(self) -> None:
        self._held = {}
        self.lane.drop()
