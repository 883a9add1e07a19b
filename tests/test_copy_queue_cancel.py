"""CopyQueue: order, shutdown, and CopyQueue.run under cancellation (found while
building the fault tests).

A handler whose RPC is cancelled (a Put past its client's deadline, a Transfer job
at shutdown) releases the slot its copy writes in a `finally`. If the copy thread
could still write after that, a late copy would land in whatever key reuses the
extent: another client's data, corrupted. So: a copy that has not started when its
caller is cancelled never runs, and one that is running holds the caller until it
has finished.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvdepot.server.copy_queue import CopyQueue

pytestmark = pytest.mark.timeout(30)


async def _blocked_queue() -> tuple[CopyQueue, threading.Event, asyncio.Future]:
    """A one-thread queue whose thread is busy until the returned event is set."""
    q = CopyQueue(1)
    gate = threading.Event()
    blocker = asyncio.ensure_future(q.run(lambda: gate.wait(10)))
    await asyncio.sleep(0.05)
    return q, gate, blocker


def test_a_queued_copy_of_a_cancelled_caller_never_runs() -> None:
    async def main() -> None:
        q, gate, blocker = await _blocked_queue()
        ran: list[float] = []
        task = asyncio.ensure_future(q.run(lambda: ran.append(time.monotonic())))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await blocker
        assert await q.run(lambda: 42) == 42  # the queue goes on
        assert ran == []
        q.close()

    asyncio.run(main())


def test_a_running_copy_holds_its_cancelled_caller_until_it_ends() -> None:
    async def main() -> None:
        q = CopyQueue(1)
        started, gate = threading.Event(), threading.Event()
        events: list[str] = []

        def copy() -> None:
            started.set()
            gate.wait(10)
            events.append("copy done")

        async def handler() -> None:
            try:
                await q.run(copy)
            finally:
                events.append("slot released")

        task = asyncio.ensure_future(handler())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done() and events == []  # still held: the copy is running
        task.cancel()  # a second cancel does not let it go either
        await asyncio.sleep(0.05)
        assert not task.done()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert events == ["copy done", "slot released"]
        q.close()

    asyncio.run(main())


def test_results_and_errors_pass_through() -> None:
    async def main() -> None:
        q = CopyQueue(2)
        assert await q.run(lambda: "bytes") == "bytes"

        def boom() -> None:
            raise OSError("copy failed")

        with pytest.raises(OSError, match="copy failed"):
            await q.run(boom, expedited=True)
        q.close()

    asyncio.run(main())


def test_expedited_copies_jump_the_queue_and_close_runs_what_was_queued() -> None:
    async def main() -> None:
        q, gate, blocker = await _blocked_queue()
        order: list[str] = []
        normal = [asyncio.ensure_future(q.run(lambda i=i: order.append(f"n{i}"))) for i in range(3)]
        await asyncio.sleep(0.02)
        urgent = asyncio.ensure_future(q.run(lambda: order.append("e"), expedited=True))
        await asyncio.sleep(0.02)
        gate.set()
        await asyncio.gather(blocker, urgent, *normal)
        assert order == ["e", "n0", "n1", "n2"]

        # close() after queued work: every queued copy runs, then the threads stop.
        gate.clear()
        blocker = asyncio.ensure_future(q.run(lambda: gate.wait(10)))
        later = [asyncio.ensure_future(q.run(lambda i=i: order.append(f"c{i}"))) for i in range(2)]
        await asyncio.sleep(0.02)
        gate.set()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, q.close)
        await asyncio.gather(blocker, *later)
        assert order[-2:] == ["c0", "c1"]

    asyncio.run(main())


def test_idle_counts_the_threads_a_new_copy_would_find_free() -> None:
    """`idle` (what the job runner cuts a large plan for): threads neither copying nor
    spoken for by a queued copy; it never reads below zero, and every thread is idle
    again once the copies end."""

    async def main() -> None:
        q = CopyQueue(2)
        gates = [threading.Event() for _ in range(3)]
        assert q.idle == 2
        running = [asyncio.ensure_future(q.run(lambda g=g: g.wait(10))) for g in gates]
        await asyncio.sleep(0.05)  # two copying, one queued behind them
        assert q.idle == 0
        gates[0].set()
        await running[0]
        await asyncio.sleep(0.05)  # the queued one took the freed thread
        assert q.idle == 0
        gates[1].set()
        await running[1]
        await asyncio.sleep(0.05)
        assert q.idle == 1
        gates[2].set()
        await asyncio.gather(*running)
        await asyncio.sleep(0.05)
        assert q.idle == 2
        assert q.close()

    asyncio.run(main())
