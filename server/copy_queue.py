"""Copy worker threads fed by a priority queue (expedited jobs first).

Copies never run on the event loop: a job's copy is queued here and its
coroutine awaits an asyncio future that the worker thread resolves.

The queue is a heap under a plain lock plus a `queue.SimpleQueue` of wake-up
tokens, one per item: a put is a heap push and one C-level wake-up, where
`queue.PriorityQueue`'s Condition cost about twice the CPU per hand-off (every
job pays it). A thread that takes a token pops the most urgent item at that
moment, so expedited work still jumps the queue.

Copies that end report back to the loop in batches: a thread that ends a copy adds
it to its loop's list of ended copies, and wakes the loop (`call_soon_threadsafe`:
a byte on its self-pipe) only when that list was empty; the loop's one `_drain`
then settles every copy that ended meanwhile. Under load, one wake-up of the loop
serves many copies instead of one each.

Each queue counts, under its lock, the copies its threads started, the seconds they
waited in the queue first and the seconds the threads spent on them (`CopyTimes`): what
an operator reads to tell copy threads that are the bottleneck (long waits, busy time
near threads x wall time) from a control plane that is (GetStats, Prometheus). Busy time
includes the copies still running, and `longest_running_seconds` is the age of the
oldest of them: a copy that never ends (a hung DMA) shows as threads busy and a copy
growing old, not only in the waits of the copies queued behind it. While every thread
holds a copy that old (`stalled`), the job path refuses new copies for those threads
(`refuse_if_stalled`), and the copies already queued behind them fail, instead of
waiting for copies that may never end.

With `cpus` (one CPU set or None per thread: the NUMA placement's, server/memory/numa.py)
each thread pins itself to its set before its first copy; `thread_cpus` is what each
thread then runs on, as it read its own affinity back (None: not pinned).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvdepot.server import errors

log = logging.getLogger("kvdepot.copy")

# A copy takes milliseconds; one running this long is stalled (a GPU's DMA that never
# ends holds its thread). While every thread of a set holds such a copy, the queue
# fails that set's queued and new jobs; `kvdepot status` reports it (status/copies.py).
STALLED_COPY_SECONDS = 5.0


@dataclasses.dataclass
class CopyTimes:
    """A queue's copies so far: how many started, the seconds from queued to started
    (behind other copies while no thread was idle, plus the hand-off to a thread) and
    the seconds its threads spent on them (busy time: over threads x wall time, how
    loaded the threads are)."""

    copies: int = 0
    wait_seconds: float = 0.0
    busy_seconds: float = 0.0  # the copies still running included, up to now
    longest_running_seconds: float = 0.0  # the oldest copy running now (0: none)


class CopyQueue:
    stall_seconds = STALLED_COPY_SECONDS

    def __init__(
        self,
        threads: int,
        cpus: Sequence[frozenset[int] | None] = (),
        name: str = "kvdepot-copy",
        label: str = "CPU",
    ) -> None:
        self.label = label  # whose copies, in errors and logs ("CPU", "GPU <UUID>")
        # (priority, sequence, item) under `_lock`; one token in `_tokens` per item.
        self._heap: list[tuple[int, int, Any]] = []
        self._lock = threading.Lock()
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._seq = itertools.count()
        # Ended copies not yet settled on their loop, by loop, under `_ended_lock`;
        # a loop has an entry exactly while its `_drain` is scheduled.
        self._ended: dict[asyncio.AbstractEventLoop, list[_Ended]] = {}
        self._ended_lock = threading.Lock()
        self._copying = 0  # threads inside a copy, under `_lock`
        self._times = CopyTimes()  # under `_lock`, the copies that ended
        self._since: list[float | None] = [None] * threads  # each thread's copy's start
        self._stall_said = False  # on the loop (`refuse_if_stalled`)
        self.thread_cpus: list[frozenset[int] | None] = [None] * threads
        pinned = [threading.Event() for _ in range(threads)]
        self._threads = [
            threading.Thread(
                target=self._start,
                args=(i, cpus[i] if i < len(cpus) else None, pinned[i]),
                name=f"{name}-{i}",
                daemon=True,
            )
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        for e in pinned:  # `thread_cpus` is whole once the constructor returns
            e.wait()

    @property
    def threads(self) -> int:
        """How many copies can run at once."""
        return len(self._threads)

    def times(self) -> CopyTimes:
        """The copies started so far, their wait and busy seconds (the running ones'
        time so far included) and the age of the oldest copy running now."""
        with self._lock:
            now = time.monotonic()
            running = [now - t for t in self._since if t is not None]
            return dataclasses.replace(
                self._times,
                busy_seconds=self._times.busy_seconds + sum(running),
                longest_running_seconds=max(running, default=0.0),
            )

    def stalled(self) -> float:
        """While every thread holds a copy running `stall_seconds` or more (a hung DMA),
        the youngest of those copies' age: a copy queued now would wait behind them,
        maybe for good. Else 0. Read without the lock (a copy may end meanwhile)."""
        starts = list(self._since)  # one consistent copy (under the GIL)
        if not starts or None in starts:  # a thread is free (or about to be)
            return 0.0
        age = time.monotonic() - max(cast("list[float]", starts))  # no None: checked above
        return age if age >= self.stall_seconds else 0.0

    def refuse_if_stalled(self) -> None:
        """On the loop, before a job queues a copy here: raises UNAVAILABLE while the
        queue is `stalled` rather than queue the copy behind copies that may never end;
        `check_stall` first (so a job may be the one that finds the stall begin)."""
        age = self.check_stall()
        if age:
            raise self._stalled_error(age)

    def check_stall(self) -> float:
        """On the loop, per job (`refuse_if_stalled`) and once a second (the daemon's
        housekeeping, so that a GPU no new job comes to fails its queued ones too): when
        a stall begins, the copies already queued fail with UNAVAILABLE (skipped: they
        never run). Logs when a stall begins and when it ends. Returns `stalled()`."""
        age = self.stalled()
        if bool(age) != self._stall_said:
            self._stall_said = bool(age)
            if age:
                failed = self._fail_queued(age)
                log.warning(
                    "%s: every copy thread has held one copy for %.0f s or more (a hung "
                    "DMA?); refusing new jobs for these threads until a copy ends "
                    "(%d queued behind failed)",
                    self.label,
                    age,
                    failed,
                )
            else:
                log.warning("%s: a stalled copy ended; taking jobs again", self.label)
        return age

    def _stalled_error(self, age: float) -> errors.DepotError:
        return errors.unavailable(
            f"{self.label}: every copy thread has held one copy for {age:.0f} s (a hung "
            f"DMA?); the job is refused rather than queued behind them"
        )

    def _fail_queued(self, age: float) -> int:
        """Fails every copy queued and not started (skipped: it never runs), on its
        loop, with the stall's error. Returns how many."""
        with self._lock:
            queued = [
                item
                for _, _, item in self._heap
                if item is not None and not item[3].skipped and not item[3].started
            ]
            for *_, ticket in queued:
                ticket.skipped = True
        for loop, fut, _, ticket in queued:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                loop.call_soon_threadsafe(
                    _finish, ticket, fut, _set_exception, self._stalled_error(age)
                )
        return len(queued)

    @property
    def idle(self) -> int:
        """Threads that would start a copy queued now at once: neither copying nor
        spoken for by a copy queued before it. A hint for the loop (read without the
        lock: a thread may take or end a copy meanwhile)."""
        return max(0, len(self._threads) - self._copying - len(self._heap))

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
        ticket = _Ticket(time.monotonic())
        self._put(0 if expedited else 1, (loop, fut, fn, ticket))
        try:
            # Awaited bare (no shield: every job pays for one): a cancellation
            # cancels `fut`, and the thread's end is then told by `ticket`.
            return await fut
        except asyncio.CancelledError:
            with self._lock:  # the lock under which a thread takes the copy
                if not ticket.started:
                    ticket.skipped = True
                    raise
            if not ticket.ended:  # already copying: hold the caller until it ends
                ticket.waiter = waiter = loop.create_future()
                while not waiter.done():
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(waiter)
            raise  # the copy ended; the caller was cancelled all the same

    def close(self, timeout: float = 10.0) -> bool:
        """Stops the threads after the queued copies; False if one is still
        copying after `timeout` (its memory must then stay mapped)."""
        for _ in self._threads:
            self._put(2, None)
        for t in self._threads:
            t.join(timeout=timeout)
        return not any(t.is_alive() for t in self._threads)

    def _start(self, i: int, cpus: frozenset[int] | None, pinned: threading.Event) -> None:
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # 0: this thread, not the process
                self.thread_cpus[i] = frozenset(os.sched_getaffinity(0))
            except OSError as exc:  # a cpuset changed since the placement: run anywhere
                log.warning("copy thread %d not pinned to CPUs %s: %s", i, sorted(cpus), exc)
        pinned.set()
        self._work(i)

    def _put(self, priority: int, item: Any) -> None:
        with self._lock:
            heapq.heappush(self._heap, (priority, next(self._seq), item))
        self._tokens.put(None)

    def _work(self, i: int) -> None:
        tokens, heap, lock, times, since = (
            self._tokens,
            self._heap,
            self._lock,
            self._times,
            self._since,
        )
        while True:
            tokens.get()  # one per item pushed: the heap holds at least one
            with lock:
                _, _, item = heapq.heappop(heap)
                if item is None:
                    return
                loop, fut, fn, ticket = item
                if ticket.skipped:  # its caller was cancelled before it started
                    continue
                ticket.started = True
                self._copying += 1
                since[i] = started = time.monotonic()
                times.copies += 1
                times.wait_seconds += started - ticket.queued
            ended: _Ended
            try:
                result = fn()
            except BaseException as exc:  # reported to the awaiting job
                ended = (ticket, fut, _set_exception, exc)
            else:
                ended = (ticket, fut, _set_result, result)
            with lock:
                self._copying -= 1
                since[i] = None
                times.busy_seconds += time.monotonic() - started
            self._report(loop, ended)

    def _report(self, loop: asyncio.AbstractEventLoop, ended: _Ended) -> None:
        """On a copy thread: `ended` is settled by the loop's next `_drain`, which is
        scheduled here if none is yet (one wake-up of the loop per batch)."""
        with self._ended_lock:
            batch = self._ended.get(loop)
            if batch is not None:
                batch.append(ended)
                return
            self._ended[loop] = [ended]
        try:
            loop.call_soon_threadsafe(self._drain, loop)
        except RuntimeError:  # the loop closed during shutdown: nobody waits
            with self._ended_lock:
                self._ended.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: settles every copy that ended since the last drain."""
        with self._ended_lock:
            batch = self._ended.pop(loop, ())
        for ticket, fut, done, value in batch:
            _finish(ticket, fut, done, value)


class _Ticket:
    """Whether a queued copy started (or was skipped because its caller went away:
    both under CopyQueue's lock) and ended (on the loop), who waits for its end, and
    when it was queued (time.monotonic)."""

    __slots__ = ("ended", "queued", "skipped", "started", "waiter")

    def __init__(self, queued: float) -> None:
        self.queued = queued
        self.started = False
        self.skipped = False
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None


# (pci_bus_id, count) -> (node, CPUs) or None for each of a device's `count` threads.
DevicePlacement = Callable[[str, int], Sequence[tuple[int, frozenset[int]] | None]]


def _unpinned(pci_bus_id: str, count: int) -> list[None]:
    return [None] * count


_Ended = tuple["_Ticket", "asyncio.Future[Any]", Callable[["asyncio.Future[Any]", Any], None], Any]


def _finish(
    ticket: _Ticket,
    fut: asyncio.Future[Any],
    done: Callable[[asyncio.Future[Any], Any], None],
    value: Any,
) -> None:
    """On the loop: the copy ended; its result goes to `fut` unless the caller was
    cancelled meanwhile, in which case the caller waits on `ticket.waiter`."""
    ticket.ended = True
    if not fut.done():
        done(fut, value)
    if ticket.waiter is not None and not ticket.waiter.done():
        ticket.waiter.set_result(None)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    fut.set_exception(exc)


class CopyQueues:
    """The daemon's copy threads: one shared queue for the copies the CPUs make, and a
    queue of its own for each device that makes its copies itself.

    A CPU copy (shared memory, process memory, the pool's inline and tier copies) keeps
    its thread busy for as long as it moves bytes, so those threads are sized to the
    cores (`--copy-threads`) and shared. A CUDA copy's thread only queues the DMA and
    waits for it: sharing those threads would make one GPU's rank jobs wait behind
    another GPU's (a TP=8 engine's eight ranks on two threads keep two of eight links
    busy). So each device gets `device_threads` threads of its own (`--gpu-copy-threads`),
    started at its first registration, and a device's jobs wait only for that device's.
    `device_placement(pci_bus_id, count)` says where they run: (node, CPUs) for each
    thread, or None for one not pinned (the NUMA placement's `device_threads`: the
    device's own node).

    Used on the event loop: `for_device` may start a device's threads (each pins itself
    to its CPU set, as the shared ones do); `check_stalls` once a second; `close` at
    shutdown.
    """

    def __init__(
        self,
        threads: int,
        cpus: Sequence[frozenset[int] | None] = (),
        *,
        device_threads: int = 2,
        device_placement: DevicePlacement | None = None,
    ) -> None:
        if device_threads < 1:
            raise ValueError("device_threads must be at least 1")
        self.shared = CopyQueue(threads, cpus)
        self.device_threads = device_threads
        self._device_placement = device_placement or _unpinned
        self.devices: dict[str, CopyQueue] = {}  # by device key, in the order first used
        # The node each device's threads run on, by key (-1: not pinned, or not to one
        # node: the shared threads' round-robin where the host does not say the GPU's).
        self.device_nodes: dict[str, int] = {}

    def for_device(self, device: tuple[str, str] | None) -> CopyQueue:
        """The queue for copies `device` (its key and PCI address) makes: its own
        threads, started now if this is its first copy; None: a CPU copy, the shared
        queue."""
        if device is None:
            return self.shared
        key, pci_bus_id = device
        q = self.devices.get(key)
        if q is None:
            placed = self._device_placement(pci_bus_id, self.device_threads)
            q = self.devices[key] = CopyQueue(
                self.device_threads,
                [p[1] if p else None for p in placed],
                name=f"kvdepot-copy-{key}",
                label=f"GPU {key}",
            )
            nodes = {
                p[0] if p and cpus else -1 for p, cpus in zip(placed, q.thread_cpus, strict=True)
            }
            self.device_nodes[key] = nodes.pop() if len(nodes) == 1 else -1
            where = (
                f"on node {self.device_nodes[key]}"
                if self.device_nodes[key] >= 0
                else "not pinned to one node"
            )
            log.info(
                "copy threads for device %s (PCI %s): %d of its own, %s",
                key,
                pci_bus_id or "unknown",
                self.device_threads,
                where,
            )
        return q

    def check_stalls(self) -> None:
        """On the loop, once a second: `CopyQueue.check_stall` of every queue."""
        for q in (self.shared, *self.devices.values()):
            q.check_stall()

    def close(self, timeout: float = 10.0) -> bool:
        """Stops every queue's threads after their queued copies; False if a copy is
        still running after `timeout` (its memory must then stay mapped)."""
        # One deadline for them all: a GPU whose DMA hangs must not add its wait to
        # every other's (the queues keep copying meanwhile).
        deadline = time.monotonic() + timeout
        stopped = [
            q.close(max(0.0, deadline - time.monotonic()))
            for q in (self.shared, *self.devices.values())
        ]
        return all(stopped)
