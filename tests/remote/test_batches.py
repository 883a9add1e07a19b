"""The batching queue the remote tier's reader and writer share
(kvdepot.server.remote.batches): its contract, driven on a real event loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvdepot.server.remote.batches import BatchWorkers


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_batches_keep_order_stay_within_the_byte_budget_and_release_every_byte() -> None:
    async def main() -> None:
        batches: list[list[int]] = []
        done: list[int] = []
        gate = asyncio.Event()

        async def handle(batch: list[int]) -> None:
            await gate.wait()  # hold the worker: every item is queued before the first batch
            batches.append(batch)

        q: BatchWorkers[int] = BatchWorkers(
            handle,
            size_of=lambda n: n,
            batch_bytes=10,
            workers=1,
            what="test",
            on_error=lambda b: pytest.fail(f"no error expected: {b}"),
            on_done=done.extend,
        )
        q.start()
        q.put(1)  # taken alone: the worker is idle
        await _until(lambda: len(q) == 0)
        for n in (4, 6, 3, 25, 2):
            q.put(n)
        assert q.pending_bytes == 1 + 4 + 6 + 3 + 25 + 2
        gate.set()
        await _until(lambda: q.pending_bytes == 0)
        await q.close()
        # First in, first out; 4+6 fills the budget; 25 is bigger than it and goes alone.
        assert batches == [[1], [4, 6], [3], [25], [2]]
        assert done == [1, 4, 6, 3, 25, 2]

    asyncio.run(main())


def test_a_failing_batch_is_logged_and_counted_and_the_worker_carries_on(caplog) -> None:
    async def main() -> None:
        handled: list[list[str]] = []
        lost: list[list[str]] = []

        async def handle(batch: list[str]) -> None:
            if "bad" in batch:
                raise RuntimeError("a bug")
            handled.append(batch)

        q: BatchWorkers[str] = BatchWorkers(
            handle,
            size_of=len,
            batch_bytes=3,
            workers=2,
            what="remote test",
            on_error=lost.append,
        )
        q.start()
        for item in ("bad", "ok1", "ok2"):
            q.put(item)
        await _until(lambda: len(handled) == 2)
        assert q.pending_bytes == 0
        await q.close()
        assert lost == [["bad"]] and sorted(handled) == [["ok1"], ["ok2"]]

    with caplog.at_level(logging.ERROR, logger="kvdepot.remote"):
        asyncio.run(main())
    assert "remote test of 1 row(s) failed" in caplog.text


def test_close_cancels_a_batch_in_flight_and_releases_its_bytes() -> None:
    async def main() -> None:
        started = asyncio.Event()
        done: list[int] = []

        async def handle(batch: list[int]) -> None:
            started.set()
            await asyncio.sleep(3600)  # a call to a tier that never answers

        q: BatchWorkers[int] = BatchWorkers(
            handle,
            size_of=lambda n: n,
            batch_bytes=100,
            workers=1,
            what="test",
            on_error=lambda b: None,
            on_done=done.extend,
        )
        q.start()
        q.put(7)
        await started.wait()
        assert q.pending_bytes == 7
        await asyncio.wait_for(q.close(), 5)
        assert q.pending_bytes == 0 and done == [7]

    asyncio.run(main())
