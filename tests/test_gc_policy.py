"""The daemon's garbage-collection policy (server/gc_policy.py), on the real
collector: young garbage is still collected, survivors leave the collector's
walks, and a frozen object freed by reference counting is really freed."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator

import pytest

from kvdepot.server.gc_policy import GcPolicy
from tests.support.daemon import DaemonProcess
from tests.support.ops import free_port, sample, scrape


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def policy() -> Iterator[GcPolicy]:
    p = GcPolicy()
    gc.disable()  # no automatic collection between a test's steps: only the ticks
    try:
        yield p
    finally:
        gc.enable()
        p.stop()  # leave pytest's collector unfrozen


def test_a_tick_collects_cyclic_garbage_made_since_the_last(policy: GcPolicy) -> None:
    policy.start()
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b  # a cycle: only the collector can free it
    assert gone() is not None
    policy.tick()
    assert gone() is None
    assert policy.stats.collected >= 2 and policy.stats.ticks == 1


def test_survivors_leave_the_collectors_walks(policy: GcPolicy) -> None:
    policy.start()
    index = [Node() for _ in range(10_000)]  # long-lived, like the index's slots
    frozen_before = gc.get_freeze_count()
    policy.tick()
    assert gc.get_freeze_count() >= frozen_before + len(index)
    assert policy.stats.frozen >= len(index)
    # A full collection no longer walks them: none is in any generation.
    walked = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
    assert not any(id(n) in walked for n in index)


def test_a_frozen_object_is_freed_when_its_last_reference_goes(policy: GcPolicy) -> None:
    policy.start()
    slot = Node()
    policy.tick()
    gone = weakref.ref(slot)
    frozen = gc.get_freeze_count()
    del slot
    assert gone() is None
    assert gc.get_freeze_count() <= frozen - 1


def test_a_serving_daemon_freezes_and_says_so(tmp_path) -> None:
    port = free_port()
    d = DaemonProcess(tmp_path, "--pool-size", "16MiB", "--metrics-port", str(port)).start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = scrape(port)
            if sample(m, "kvdepot_gc_frozen_objects_total") > 0:
                break
            time.sleep(0.2)
        # Start-up's objects are frozen and the ticks are short.
        assert sample(m, "kvdepot_gc_frozen_objects_total") > 1000
        assert sample(m, "kvdepot_gc_tick_max_seconds") < 1.0
        assert sample(m, "python_gc_collections_total", generation="0") > 0
    finally:
        d.stop()


# Run in a process of its own, as the daemon is one: in pytest's worker, earlier tests
# leave free chunks inside the heap, and a block malloc carves from one of those never
# reaches the top of the heap that trimming would give back.
_KEEPS_FREED_HEAP = """
import ctypes, sys
from kvdepot.server.gc_policy import GcPolicy

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    sys.exit(3)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "policy":
    assert GcPolicy().heap_kept
block = libc.malloc(2 << 20)  # a large plan: from the heap, not a mapping of its own
ctypes.memset(block, 1, 2 << 20)  # touched, as a plan's columns are
libc.free(block)
print(libc.mallinfo2().keepcost)
"""


def _kept_after_free(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _KEEPS_FREED_HEAP, mode], capture_output=True, text=True, timeout=60
    )
    if out.returncode == 3:
        pytest.skip("not glibc >= 2.33")
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_the_daemon_keeps_freed_heap_for_the_next_job() -> None:
    """A job's plan arrays are made and freed per job: with the policy, glibc keeps
    the freed top of its heap (reused by the next job) instead of giving it back to
    the kernel and faulting it in again page by page. Without it, glibc hands the
    block back at once (so the check can fail)."""
    assert _kept_after_free("policy") >= 2 << 20, "the freed heap went back to the kernel"
    assert _kept_after_free("default") < 2 << 20  # glibc alone: mapped, unmapped on free
