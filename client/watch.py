"""`Watch`: a background subscription to one namespace's ready keys.

Made by `DepotClient.watch`; the Watch stream runs as a task on the process's
stream loop (kvdepot.client.stream_loop), on the client's stream channel
(kvdepot.client.session), and follows the client's sessions: in each new session
it joins its namespace first, then subscribes again and gets a fresh snapshot.

Threads: `start` and `stop` from any thread. `on_event` runs on the loop thread,
which every client of the process shares: it must be short and must never wait
for the loop (a blocking call on the sync channel is fine). Once `stop` returns
it is not called again.

Ownership: the client owns the task, on its keeper (its `close` ends every Watch);
the caller owns `on_event` and whatever it updates. The client makes the calls
(`WatchOwner`); the keeper runs the task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import grpc

from kvdepot.client.session import DepotUnavailable, SessionKeeper
from kvdepot.v1 import depot_pb2, depot_pb2_grpc

log = logging.getLogger("kvdepot.client")


class WatchOwner(Protocol):
    """What a Watch asks of its client (DepotClient); the calls run on the loop."""

    @property
    def session_id(self) -> str: ...

    async def join_async(
        self, stub: depot_pb2_grpc.DepotStub, session_id: str, namespace_id: str
    ) -> None: ...

    def open_watch_call(
        self,
        stub: depot_pb2_grpc.DepotStub,
        session_id: str,
        namespace_id: str,
        key_events: bool = False,
    ) -> grpc.aio.UnaryStreamCall: ...


class Watch:
    """A background subscription to a namespace's ready keys.

    `on_event` gets the daemon's WatchEvents (a SNAPSHOT with reset=True, more
    SNAPSHOT parts, SNAPSHOT_END, then STORED/REMOVED deltas). When the daemon
    goes away it gets a synthetic SNAPSHOT with reset=True and no keys (forget
    everything), and after a reconnect a fresh snapshot.
    """

    def __init__(
        self,
        client: WatchOwner,
        keeper: SessionKeeper,
        namespace_id: str,
        on_event: Callable[[depot_pb2.WatchEvent], None],
        key_events: bool = False,
    ) -> None:
        self.client = client
        self._keeper = keeper
        self.namespace_id = namespace_id
        self.on_event = on_event
        self.key_events = key_events  # ask for the stores' chunk events
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Watch:
        self._task = self._keeper.start_stream(self._run())
        return self

    async def _run(self) -> None:
        client = self.client
        ready, stub = self._keeper.ready, self._keeper.stub
        assert ready is not None and stub is not None
        while True:
            await ready.wait()
            call = None
            try:
                session_id = client.session_id
                await client.join_async(stub, session_id, self.namespace_id)
                call = client.open_watch_call(stub, session_id, self.namespace_id, self.key_events)
                async for event in call:
                    self.on_event(event)
            except (grpc.RpcError, DepotUnavailable):
                pass
            except Exception:
                log.exception("kvdepot watch handler failed; resubscribing")
            finally:
                if call is not None:
                    call.cancel()
                call = None  # as in SessionKeeper._run: let go of the connection
            self.on_event(depot_pb2.WatchEvent(kind=depot_pb2.WatchEvent.SNAPSHOT, reset=True))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        """Ends the subscription; `on_event` is not called once this returns."""
        task, self._task = self._task, None
        if task is not None:
            self._keeper.stop_stream(task)
