"""Copy worker threads fed by a priority queue (expedited jobs first).

Copies never run on the event loop: a job's copy is queued here and its
coroutine awaits an asyncio future that the worker thread resolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any


class CopyQueue:
    def __init__(self, threads: int) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"kvdepot-copy-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> int:
        """How many copies can run at once."""
        return len(self._threads)

    async def run(self, fn: Callable[[], Any], expedited: bool = False) -> Any:
        """Runs `fn` on a copy thread; expedited work jumps the queue.

        Cancellation-safe for the caller's cleanup: when the awaiting task is
        cancelled, a copy that has not started is skipped (never runs), and one
        that is running is waited for before CancelledError propagates. Callers
        release the slot a copy writes in their `finally`; releasing it while the
        thread still writes would let a late copy land in another key's slot.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        ticket = _Ticket()
        self._queue.put((0 if expedited else 1, next(self._seq), (loop, fut, fn, ticket)))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with ticket.lock:
                if not ticket.started:
                    ticket.skipped = True
                    raise
            while not fut.done():  # already copying: hold the caller until it ends
                with contextlib.suppress(BaseException):
                    await asyncio.shield(fut)
            raise  # the copy ended; the caller was cancelled all the same

    def close(self, timeout: float = 10.0) -> bool:
        """Stops the threads after the queued copies; False if one is still
        copying after `timeout` (its memory must then stay mapped)."""
        for _ in self._threads:
            self._queue.put((2, next(self._seq), None))
        for t in self._threads:
            t.join(timeout=timeout)
        return not any(t.is_alive() for t in self._threads)

    def _work(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is None:
                return
            loop, fut, fn, ticket = item
            with ticket.lock:
                if ticket.skipped:  # its caller was cancelled before it started
                    continue
                ticket.started = True
            try:
                result = fn()
            except BaseException as exc:  # reported to the awaiting job
                done, value = _set_exception, exc
            else:
                done, value = _set_result, result
            # RuntimeError: the loop closed during shutdown, nobody waits.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done, fut, value)


class _Ticket:
    """Whether a queued copy started, or was skipped because its caller went away."""

    __slots__ = ("lock", "skipped", "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.skipped = False


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
