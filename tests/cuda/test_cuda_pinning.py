"""Page-locking the pool: the pinner registers and unregisters chunks, stops at the
first failure, and the arena warm-up hook pins the whole pool.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest

from kvdepot.common.cuda_driver import CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, CudaError
from kvdepot.server.cuda import cuda_path, enable_cuda
from kvdepot.server.cuda.pinning import PoolPinner
from kvdepot.server.state import DepotState
from tests.support.fake_cuda import FakeDriver

# -- page-locking the pool ------------------------------------------------------------------


class FakeDevice:
    def __init__(self, drv: FakeDriver) -> None:
        self.drv = drv

    def make_current(self) -> None:
        self.drv.set_current(1000)


def test_pinner_registers_chunks_and_unregisters_them_at_close() -> None:
    drv = FakeDriver()
    p = PoolPinner(drv, FakeDevice(drv), base=1 << 30, size=10 << 20)
    for off in range(0, 10 << 20, 4 << 20):
        p.after_chunk(off, min(4 << 20, (10 << 20) - off))
    assert p.complete and p.split_bytes == 4 << 20
    assert drv.registered == {
        (1 << 30): 4 << 20,
        (1 << 30) + (4 << 20): 4 << 20,
        (1 << 30) + (8 << 20): 2 << 20,
    }
    p.close()
    p.close()
    assert drv.registered == {}
    p.after_chunk(0, 4096)  # after close: ignored
    assert drv.registered == {}


def test_pinner_stops_at_the_first_failure_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    drv = FakeDriver()
    drv.fail_register_after = 2
    p = PoolPinner(drv, FakeDevice(drv), base=0, size=8 << 20)
    with caplog.at_level(logging.WARNING, logger="kvdepot.cuda"):
        for off in range(0, 8 << 20, 2 << 20):
            p.after_chunk(off, 2 << 20)
    assert p.pinned_bytes == 4 << 20 and p.failed and not p.complete
    assert "LimitMEMLOCK" in caplog.text
    assert len(drv.registered) == 2
    p.close()
    assert drv.registered == {}


def test_pinner_counts_memory_someone_else_registered_but_leaves_it_alone() -> None:
    class Already(FakeDriver):
        def host_register(self, ptr: int, size: int, flags: int = 1) -> None:
            raise CudaError(
                "cuMemHostRegister",
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
                "already registered",
            )

    drv = Already()
    p = PoolPinner(drv, FakeDevice(drv), base=0, size=4096)
    p.after_chunk(0, 4096)
    assert p.complete and p.failed is None
    p.close()  # nothing of ours to unregister


def test_the_arena_warmup_hook_page_locks_the_whole_pool(state: DepotState) -> None:
    drv = FakeDriver()
    arena = state.arena
    assert enable_cuda(state, arena, driver=drv, env={})
    path = cuda_path(state)
    assert path is not None
    arena.start_warmup(chunk_bytes=8 << 20)  # enable_cuda added the page-locking hook
    assert arena.wait_warmup(30)
    assert sum(drv.registered.values()) == arena.size
    assert min(drv.registered) == arena.address
    assert path.engine.host_split() == 8 << 20
    arena.close()  # its close hook unregisters before unmapping, destroys the streams
    assert drv.registered == {}


def test_enabling_after_the_warmup_began_follows_it(state: DepotState) -> None:
    arena = state.arena
    arena.start_warmup(chunk_bytes=8 << 20)
    assert arena.wait_warmup(30)
    drv = FakeDriver()
    assert enable_cuda(state, arena, driver=drv, env={})
    deadline = threading.Event()
    for _ in range(200):
        if sum(drv.registered.values()) == arena.size:
            break
        deadline.wait(0.02)
    assert sum(drv.registered.values()) == arena.size


def test_page_locking_is_reported_apart_from_warmup(state: DepotState) -> None:
    """GetStats, `kvdepot status` and Prometheus show page-locking on its own: here it
    stops at 16 of 64 MiB (a locked-memory limit) while the warm-up completes."""
    from rich.console import Console

    from kvdepot.server.metrics import Metrics
    from kvdepot.server.status.render import render
    from kvdepot.server.status.report import Sample, build_report
    from kvdepot.v1 import admin_pb2

    def report() -> dict:
        stats = admin_pb2.GetStatsResponse(**state.stats())
        return build_report("/x.sock", None, Sample(0, stats, [], []))

    def screen(r: dict) -> str:
        console = Console(width=100)
        with console.capture() as cap:
            console.print(render(r))
        return cap.get()

    assert state.stats()["page_locking"] is False  # no CUDA: nothing to lock, no line
    assert report()["page_locking"] is None and "page-lock" not in screen(report())

    drv = FakeDriver()
    drv.fail_register_after = 2
    arena = state.arena
    assert enable_cuda(state, arena, driver=drv, env={})
    arena.start_warmup(chunk_bytes=8 << 20)
    assert arena.wait_warmup(30)
    stats = state.stats()
    assert stats["warmup_complete"] and stats["warmup_done_bytes"] == arena.size
    assert stats["page_locking"] is True and stats["page_locked_bytes"] == 16 << 20
    assert stats["page_locking_error"]  # the driver's refusal, in words
    r = report()
    assert r["page_locking"]["fraction"] == 0.25 and not r["page_locking"]["complete"]
    text = screen(r)
    assert re.search(r"^page-lock\b.* 25%", text, re.M), text
    assert "stopped:" in text and "locked-memory limit" in text, text

    registry = Metrics(state).registry
    assert registry.get_sample_value("kvdepot_pool_page_locked_bytes") == 16 << 20
    assert registry.get_sample_value("kvdepot_pool_page_locking_failed") == 1
