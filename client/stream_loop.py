"""`StreamLoop`: one asyncio loop thread per process for the clients' long-lived streams.

Why not a thread per stream with the synchronous API: a sync stream's reader wakes
every 0.1 s even when nothing arrives (grpc polls its condition so that signals get
in), and the channel's spin thread every 0.2 s. Each wake takes the GIL from
whatever the process is doing, and in a vLLM engine that is the scheduler: about 25
wakes a second made its decode steps 1-2 % slower (benchmarks/README.md). A
`grpc.aio` stream waits in epoll instead, and the loop wakes only when a message
arrives or a timer a client set is due.

Contract:
- `StreamLoop.shared()` is the process's loop (made on first use, and again in a
  forked child); it runs until the process exits and is never closed, so a late
  event from grpc's poller always finds it open.
- Fork: grpc.aio keeps one process-wide poller while any of its channels lives. A
  child forked while its parent had stream channels open inherits that poller
  without its thread: an aio call there waits for ever, or crashes the process. So
  there the loop is not `usable`: clients make no streams and never open a
  session (the daemon counts as down, which nothing waits on), and `shared()`
  logs why, once. A child forked before any client, or started with 'spawn', is
  not affected.
- `open_channel` makes a `grpc.aio` channel on the loop (aio objects must stay on
  the loop that made them); `close_channel` cancels the tasks given and closes it.
- `start(coro)` runs a coroutine as a task from any thread; `stop(task)` cancels it
  and, off the loop thread, waits until it has unwound.
- Callbacks a task makes run on the loop thread, shared by every client of the
  process: they must be short and must never wait for the loop (a blocking call on
  a sync channel is fine; so are `open_channel` and `start`, which do not wait
  there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Collection, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

import grpc

T = TypeVar("T")

log = logging.getLogger("kvdepot.client")


class StreamLoop:
    """An asyncio loop on a daemon thread."""

    _shared: ClassVar[StreamLoop | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()
    # Stream channels open in this process, and in the parent when it forked this one
    # (then grpc.aio cannot work here, nor in this process's own children).
    _channels_open: ClassVar[int] = 0
    _channels_at_fork: ClassVar[int] = 0
    _aio_inherited: ClassVar[bool] = False

    @classmethod
    def shared(cls) -> StreamLoop:
        with cls._shared_lock:
            loop = cls._shared
            if loop is None or loop._pid != os.getpid():
                if cls._channels_at_fork:
                    log.error(
                        "kvdepot: this process was forked while its parent had %d kvdepot "
                        "stream channel(s) open; gRPC's asyncio support does not survive "
                        "fork(), so kvdepot clients made here cannot open a session (the "
                        "daemon counts as down: lookups miss, nothing is stored). Start this "
                        "process with the 'spawn' method, or before any kvdepot client.",
                        cls._channels_at_fork,
                    )
                    cls._channels_at_fork = 0
                loop = cls._shared = cls()
            return loop

    @classmethod
    def _after_fork_in_child(cls) -> None:
        # A lock another thread held at fork would stay held here for ever.
        cls._shared_lock = threading.Lock()
        cls._channels_at_fork, cls._channels_open = cls._channels_open, 0
        cls._aio_inherited = cls._aio_inherited or cls._channels_at_fork > 0

    @property
    def usable(self) -> bool:
        """False in a process forked while stream channels were open (see above)."""
        return not StreamLoop._aio_inherited

    @classmethod
    def _count_channels(cls, change: int) -> None:
        with cls._shared_lock:
            cls._channels_open += change

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvdepot-streams", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Runs `coro` on the loop; its result (or exception) comes in the future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def open_channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        self._count_channels(1)
        if self.on_loop_thread:  # a callback starting a client: waiting would deadlock
            return grpc.aio.insecure_channel(target, options=list(options))

        async def make() -> grpc.aio.Channel:
            return grpc.aio.insecure_channel(target, options=list(options))

        return self.submit(make()).result()

    def close_channel(
        self, channel: grpc.aio.Channel, tasks: Collection[asyncio.Task[Any]], timeout: float = 5.0
    ) -> None:
        """Cancels `tasks` (the streams on `channel`), then closes the channel."""

        async def close() -> None:
            await asyncio.gather(*(_cancel(t) for t in tasks))
            await channel.close()
            self._count_channels(-1)

        if self.on_loop_thread:
            self._loop.create_task(close())
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self.submit(close()).result(timeout)

    def start(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Starts `coro` as a task on the loop, for `stop` to end later."""
        if self.on_loop_thread:
            return self._loop.create_task(coro)
        made: concurrent.futures.Future[asyncio.Task[Any]] = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(lambda: made.set_result(self._loop.create_task(coro)))
        return made.result()

    def stop(self, task: asyncio.Task[Any], timeout: float = 5.0) -> None:
        """Cancels a task `start` made and, off the loop thread, waits until it has
        unwound (so that its callbacks have stopped)."""
        if self.on_loop_thread:
            task.cancel()
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self.submit(_cancel(task)).result(timeout)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.wait({task})  # its outcome is the task's business, not the caller's


os.register_at_fork(after_in_child=StreamLoop._after_fork_in_child)
