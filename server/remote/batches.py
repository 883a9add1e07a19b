"""A queue drained in batches by a few asyncio workers: the shape the remote tier's
reader (fetches) and writer (write-behind) share. Rows are queued on the event loop
and go to the tier in batches, several calls in flight at once.

Contract:
- `put(item)` runs on the event loop and never waits. The item is queued (first in,
  first out) and its size counts in `pending_bytes` from then on, so a caller can
  bound its backlog before it puts (`pending_bytes + size > limit`: drop instead).
- A worker takes a batch: the oldest item, then the next ones while the batch's total
  size stays within `batch_bytes` (an item larger than that goes alone).
- `handle(batch)` is awaited. If it raises, the exception is logged ("<what> of N
  row(s) failed") and `on_error(batch)` is called to count the rows as lost; the worker
  carries on, so a bug cannot end it.
- However a batch ended (done, raised, or cancelled by `close`), its bytes leave
  `pending_bytes` and then `on_done(batch)` runs, if given.
- `close()` stops the workers, cancelling the batches in flight. Items still queued
  are abandoned: they were never started, and nothing is owed for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger("kvdepot.remote")

T = TypeVar("T")


class BatchWorkers(Generic[T]):
    def __init__(
        self,
        handle: Callable[[list[T]], Awaitable[None]],
        *,
        size_of: Callable[[T], int],
        batch_bytes: int,
        workers: int,
        what: str,
        on_error: Callable[[list[T]], None],
        on_done: Callable[[list[T]], None] | None = None,
    ) -> None:
        self._handle = handle
        self._size_of = size_of
        self.batch_bytes = batch_bytes
        self.workers = workers
        self._what = what
        self._on_error = on_error
        self._on_done = on_done
        self._queue: deque[T] = deque()
        self.pending_bytes = 0  # queued + being handled
        self._wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]

    async def close(self) -> None:
        self._closing = True
        self._wakeup.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def put(self, item: T) -> None:
        self.pending_bytes += self._size_of(item)
        self._queue.append(item)
        self._wakeup.set()

    def __len__(self) -> int:
        """Items queued, not yet taken by a worker."""
        return len(self._queue)

    def _take_batch(self) -> list[T]:
        batch: list[T] = []
        total = 0
        while self._queue and (
            not batch or total + self._size_of(self._queue[0]) <= self.batch_bytes
        ):
            item = self._queue.popleft()
            batch.append(item)
            total += self._size_of(item)
        return batch

    async def _worker(self) -> None:
        while not self._closing:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            try:
                await self._handle(batch)
            except Exception:  # a bug must not end the worker: log, count, go on
                log.exception("%s of %d row(s) failed", self._what, len(batch))
                self._on_error(batch)
            finally:
                self.pending_bytes -= sum(self._size_of(i) for i in batch)
                if self._on_done is not None:
                    self._on_done(batch)
