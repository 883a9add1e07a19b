"""CopyQueues: each device's copies wait for its own threads, never behind another
device's or the CPU copies, and shutdown stops them all.

A CUDA copy's thread queues the DMA and waits for it. On threads shared by every GPU, a
TP=8 engine's eight rank jobs would take turns on two threads: two of eight links busy.
Each device's threads run on its own NUMA node: the placement comes from a fake host's
sysfs (two nodes, a GPU on each), the pinning is real, on this host's CPUs. Real threads
here; the CUDA engine's `copy_device` (which names a registration's GPU and its PCI
address) runs over the fake driver (tests/cuda) and where CUDA does (tests/gpu).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from kvdepot.server.copy_queue import CopyQueue, CopyQueues
from kvdepot.server.memory import numa
from kvdepot.server.memory.copy_engine import CpuCopyEngine

pytestmark = pytest.mark.timeout(30)


def test_a_devices_copies_never_wait_behind_another_devices_or_the_cpus() -> None:
    async def main() -> None:
        before = threading.enumerate()
        queues = CopyQueues(1, device_threads=1)
        assert queues.for_device(None) is queues.shared
        a, b = queues.for_device(("GPU-a", "")), queues.for_device(("GPU-b", ""))
        assert queues.for_device(("GPU-a", "")) is a and len({id(a), id(b), id(queues.shared)}) == 3
        assert list(queues.devices) == ["GPU-a", "GPU-b"] and a.threads == 1
        # GPU a's thread waits for a long DMA, and the CPU thread is busy too.
        gate, cpu_gate = threading.Event(), threading.Event()
        long_dma = asyncio.ensure_future(a.run(lambda: gate.wait(10)))
        long_cpu = asyncio.ensure_future(queues.shared.run(lambda: cpu_gate.wait(10)))
        await asyncio.sleep(0.05)
        # GPU b's copy starts at once: it waits for neither.
        assert await asyncio.wait_for(b.run(lambda: "b"), 5) == "b"
        # GPU a's next copy waits for GPU a's own thread.
        next_dma = asyncio.ensure_future(a.run(lambda: "a"))
        await asyncio.sleep(0.1)
        assert not next_dma.done()
        gate.set()
        cpu_gate.set()
        assert await long_dma is True and await next_dma == "a" and await long_cpu is True
        assert queues.close()
        still = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        assert not still, still

    asyncio.run(main())


def test_on_one_shared_thread_the_second_device_would_wait() -> None:
    # The control: what the test above rules out, on one queue for every device.
    async def main() -> None:
        shared = CopyQueue(1)
        gate = threading.Event()
        long_dma = asyncio.ensure_future(shared.run(lambda: gate.wait(10)))
        await asyncio.sleep(0.05)
        other = asyncio.ensure_future(shared.run(lambda: "b"))
        await asyncio.sleep(0.1)
        assert not other.done()
        gate.set()
        assert await long_dma is True and await other == "b"
        assert shared.close()

    asyncio.run(main())


def test_cpu_copies_name_no_device() -> None:
    assert CpuCopyEngine().copy_device([]) is None
    with pytest.raises(ValueError, match="device_threads"):
        CopyQueues(1, device_threads=0)


def test_close_waits_once_for_every_stuck_device_together() -> None:
    async def main() -> None:
        queues = CopyQueues(1, device_threads=1)
        gate = threading.Event()
        stuck = [
            asyncio.ensure_future(queues.for_device((f"GPU-{i}", "")).run(lambda: gate.wait(10)))
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        t = time.monotonic()
        assert not queues.close(timeout=0.5)  # their DMA never ends: memory stays mapped
        assert time.monotonic() - t < 1.0  # one 0.5 s wait, not one per GPU
        gate.set()
        await asyncio.gather(*stuck)

    asyncio.run(main())


def test_each_devices_threads_run_on_its_own_node(tmp_path: Path) -> None:
    """A host with a GPU on each of two nodes (this host's two CPUs as the two nodes'):
    each GPU's threads pin themselves to its node's CPU, whatever the shared threads'
    placement; a GPU the host does not list keeps the shared threads' placement."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell two nodes apart")
    root = tmp_path
    for node, cpu in enumerate(cpus[:2]):
        (root / numa.NODE_DIR / f"node{node}").mkdir(parents=True)
        (root / numa.NODE_DIR / f"node{node}" / "cpulist").write_text(f"{cpu}\n")
        (root / numa.NODE_DIR / f"node{node}" / "meminfo").write_text(
            f"Node {node} MemTotal:       1048576 kB\n"
        )
    for address, node in (("0000:18:00.0", 0), ("0000:9a:00.0", 1)):
        dev = root / numa.PCI_DIR / address
        dev.mkdir(parents=True)
        (dev / "vendor").write_text("0x10de\n")
        (dev / "class").write_text("0x030200\n")
        (dev / "numa_node").write_text(f"{node}\n")
    topology = numa.read_topology(tmp_path)
    assert topology.gpu_addresses == ("0000:18:00.0", "0000:9a:00.0")
    placement = numa.place("auto", topology, cpus)
    assert placement.nodes == (0, 1)  # the pool over both GPUs' nodes, the threads too

    queues = CopyQueues(
        1, placement.cpus(1), device_threads=2, device_placement=placement.device_threads
    )
    try:
        # The driver writes upper-case hex, sysfs lower-case: the same GPU.
        on_1 = queues.for_device(("GPU-b", "0000:9A:00.0"))
        on_0 = queues.for_device(("GPU-a", "0000:18:00.0"))
        unknown = queues.for_device(("GPU-c", ""))
        assert on_0.thread_cpus == [frozenset({cpus[0]})] * 2  # as the threads read it back
        assert on_1.thread_cpus == [frozenset({cpus[1]})] * 2
        assert unknown.thread_cpus == [frozenset({cpus[0]}), frozenset({cpus[1]})]
        assert queues.device_nodes == {"GPU-b": 1, "GPU-a": 0, "GPU-c": -1}
    finally:
        assert queues.close()


def test_the_drivers_pci_address_reads_as_sysfs_writes_it() -> None:
    assert numa.pci_address("0000:3B:00.0") == "0000:3b:00.0"
    assert numa.pci_address("00000000:3B:00.0") == "0000:3b:00.0"  # nvidia-smi's form
    assert numa.pci_address("0001:c1:1f.7\n") == "0001:c1:1f.7"
    assert numa.pci_address("") == numa.pci_address("GPU-0c1d") == ""


def test_a_queue_counts_its_copies_their_wait_and_its_busy_time() -> None:
    """One thread: the second copy waits for the first; a copy cancelled before it
    started is not counted; busy time holds both copies, and a running copy's time
    counts while it runs (busy, and its age as the longest running)."""

    async def main() -> None:
        q = CopyQueue(1)
        gate = threading.Event()
        first = asyncio.ensure_future(q.run(lambda: gate.wait(10)))
        for _ in range(1000):  # until the first holds the thread
            if q.times().copies:
                break
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(q.run(lambda: time.sleep(0.05)))
        dropped = asyncio.ensure_future(q.run(lambda: None))
        await asyncio.sleep(0)  # both queued: the timed wait starts after this
        await asyncio.sleep(0.2)
        held = q.times()  # the first still holds the thread: it counts as it runs
        assert held.copies == 1
        assert held.longest_running_seconds >= 0.2
        assert held.busy_seconds >= held.longest_running_seconds
        dropped.cancel()
        await asyncio.sleep(0)
        gate.set()
        await first
        await second
        with pytest.raises(asyncio.CancelledError):
            await dropped
        t = q.times()
        assert t.copies == 2
        assert t.wait_seconds >= 0.2  # the second waited for the first, queued 0.2 s
        assert t.busy_seconds >= 0.2 + 0.05  # the first held the thread, then the second
        assert t.busy_seconds >= held.busy_seconds + 0.05  # a running copy never counts twice
        assert t.longest_running_seconds == 0.0  # none running now
        assert q.close()

    asyncio.run(main())


def test_a_queue_is_stalled_only_while_every_thread_holds_an_old_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads: one copy that does not end leaves a thread for the next copy (not
    stalled); two that have run `stall_seconds` are a stall; once one ends, none."""
    monkeypatch.setattr(CopyQueue, "stall_seconds", 0.5)

    async def main() -> None:
        q = CopyQueue(2)
        gates = [threading.Event(), threading.Event()]
        first = asyncio.ensure_future(q.run(lambda: gates[0].wait(10)))
        await asyncio.sleep(0.6)
        assert q.stalled() == 0.0  # the other thread is free
        assert await q.run(lambda: "ran") == "ran"
        second = asyncio.ensure_future(q.run(lambda: gates[1].wait(10)))
        await asyncio.sleep(0.05)
        assert q.stalled() == 0.0  # the second copy is young
        await asyncio.sleep(0.5)
        assert q.stalled() >= 0.5  # both threads held 0.5 s or more
        gates[1].set()
        await second
        assert q.stalled() == 0.0
        gates[0].set()
        await first
        assert q.close()

    asyncio.run(main())
