"""Unpins: the pins of completed loads are dropped off the scheduler thread, batched,
and with them the touches of finished requests (their chunks made young again).

Even a fire-and-forget unary gRPC call costs about a millisecond of the calling thread in
Python, so `complete_load` only queues its request's keys here; the unpin thread sends
what has queued up on the unpin lane (kvdepot.client.pin_lane: datagrams, no answer
awaited), one call per namespace, and whatever the lane cannot take in one Unpin RPC.
A failed unpin is only logged: the daemon drops a session's pins when the session ends.

Threads and ownership (`UnpinSender` owns the queue, its wake-up event, the thread and
the UnpinLane):
- `unpin`, `unpin_all` and `touch` run on vLLM's scheduler thread (complete_load,
  reset_cache, the touches of finished requests);
- `_run` is the "kvdepot-unpin" thread. It waits without a timeout: a thread that wakes
  to find nothing still takes the GIL from the scheduler (`close` wakes it to end).
  Woken, it lets `GATHER_S` pass before it takes the queue: vLLM completes a step's
  loads one request after another, and a thread woken per request (per shard, with
  shards) wrestled the scheduler for the GIL and the wake-up's lock at every one;
- `on_session` and `on_disconnect` run on the client's stream loop thread (the lane).
The queue is swapped, never shared mid-change: appends and the swap are GIL-atomic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import grpc

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.client.pin_lane import UnpinLane, tail_first_parts

log = logging.getLogger("kvdepot.vllm.manager")

# How long the woken unpin thread lets a step's completions queue up before it takes
# them: one wake-up and one call per step, for pins whose release can wait a moment.
GATHER_S = 0.001


class UnpinSender:
    """Drops pins in the daemon from its own thread, batched per namespace."""

    def __init__(self, client: DepotClient) -> None:
        self._client = client
        self.lane = UnpinLane(client)
        # (namespace, keys, touch): pins to drop, one per key; or, with touch, keys a
        # finished request used again (DepotClient.unpin's `touch`).
        self._queue: list[tuple[str, list[bytes], bool]] = []
        self._wakeup = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvdepot-unpin", daemon=True)
        self._thread.start()

    def unpin(self, namespace_id: str, keys: list[bytes]) -> None:
        self._queue.append((namespace_id, keys, False))
        self._wake()

    def unpin_all(self, namespace_id: str, key_lists: Iterable[list[bytes]]) -> None:
        self._queue.extend((namespace_id, keys, False) for keys in key_lists)
        self._wake()

    def touch(self, namespace_id: str, keys: list[bytes]) -> None:
        """Queues a finished request's keys (its jobs' order) to be made young again."""
        self._queue.append((namespace_id, keys, True))
        self._wake()

    def _wake(self) -> None:
        # Set means the thread has yet to clear it, and so to take the queue (after the
        # append above): no need to take the event's lock again.
        if not self._wakeup.is_set():
            self._wakeup.set()

    def _run(self) -> None:
        while not self._closed:
            self._wakeup.wait()
            time.sleep(GATHER_S)  # the rest of the step's completions, in this batch
            self._wakeup.clear()
            if not self._queue:
                continue
            batch, self._queue = self._queue, []
            unpins: dict[str, list[bytes]] = {}
            touches: dict[str, list[bytes]] = {}
            for ns, keys, touch in batch:
                (touches if touch else unpins).setdefault(ns, []).extend(keys)
            for ns, keys in unpins.items():
                self._send(ns, keys, touch=False)
            for ns, keys in touches.items():  # after the unpins: a touch skips held rows
                self._send(ns, keys, touch=True)

    def _send(self, ns: str, keys: list[bytes], touch: bool) -> None:
        try:
            session_id = self._client.session_id
            if not touch:
                left = self.lane.unpin(session_id, ns, keys)
                if left:  # no lane (yet), or it could not take them all
                    self._client.unpin(ns, left, wait=True, timeout=5.0)
                return
            left = self.lane.touch(session_id, ns, keys)
            # Parts well under --max-batch-keys a call (its default: 16384).
            for start, end in tail_first_parts(len(left), 1024):
                self._client.unpin(ns, (), wait=True, timeout=5.0, touch=left[start:end])
        except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
            what = "touch" if touch else "unpin"
            log.debug("kvdepot %s of %d keys skipped: %s", what, len(keys), exc)

    def on_session(self) -> None:
        self.lane.open_soon()

    def on_disconnect(self) -> None:
        self.lane.drop()

    def close(self) -> None:
        """Ends the thread (it exits at its next wake-up, which this causes)."""
        self._closed = True
        self._wakeup.set()
