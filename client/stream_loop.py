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
import os
import threading
from collections.abc import Collection, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

import grpc

T = TypeVar("T")


class StreamLoop:
    """An asyncio loop on a daemon thread."""

    _shared: ClassVar[StreamLoop | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls) -> StreamLoop:
        with cls._shared_lock:
            loop = cls._shared
            if loop is None or loop._pid != os.getpid():
                loop = cls._shared = cls()
            return loop

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
