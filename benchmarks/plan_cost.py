"""What planning one job costs the daemon's event loop: compiled planner against numpy.

    python -m kvdepot.bench.plan_cost [--chunks 16] [--layers 32] [--jobs 2000]
                                      [--engine cuda|cpu]

Plans one store job of the Llama-3-8B geometry (64 KiB pages; 16 chunks of 32 layers
are 512 pages) the way the daemon does on its loop: `check_job`, `plan_copy`, and the
CUDA engine's `plan_dma` (with its 8 MiB page-locking split), or with `--engine cpu`
the compiled CPU engine's `prepare` (what a shared-memory registration's job costs the
loop before its copy thread moves the bytes). Once with the
compiled planner (server/core/_plan.c) and once with numpy, each alone and with a
thread woken per job, as the daemon wakes a copy thread for the job before: numpy's
operations over more than 500 elements release the GIL, and the woken thread takes
it. Prints microseconds per job, the best of 5 passes.
"""

from __future__ import annotations

import argparse
import queue
import random
import sys
import threading
import time
from collections.abc import Callable

from kvdepot.bench.inproc import LocalRegion
from kvdepot.server.core import planner
from kvdepot.server.core.job_check import check_job
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.core.planner import plan_copy
from kvdepot.server.cuda.dma_plan import plan_dma
from kvdepot.server.memory.copy_engine import STORE, CpuCopyEngine

PAGE = 64 << 10
HOST_SPLIT = 8 << 20


def make_job(chunks: int, layers: int, engine: str = "cuda") -> Callable[[], object]:
    """One job's planning, as a callable (the job is the same every call)."""
    num_blocks = max(256, 2 * chunks)
    layout = NamespaceLayout("plan-cost", 1, 1, ((PAGE,) * layers,))
    tensors = [TensorView(0, i * num_blocks * PAGE, num_blocks, PAGE, PAGE) for i in range(layers)]
    memory = MemoryMap.build(
        layout,
        [layers * num_blocks * PAGE],
        tensors,
        [[LayerRef(i, 0, PAGE) for i in range(layers)]],
    )
    rng = random.Random(7)
    keys = [rng.randbytes(28) + bytes(4) for _ in range(chunks)]
    block_ids = rng.sample(range(num_blocks), chunks)
    slot = layout.slot_bytes(0)
    offsets = [rng.randrange(0, 4096) * slot for _ in range(chunks)]

    # `prepare` reads no byte of the region: an address and a size are all it needs.
    cpu, regions = CpuCopyEngine(), [LocalRegion(1 << 40, layers * num_blocks * PAGE)]

    def plan() -> object:
        shape = check_job(layout, memory, block_ids, [chunks], [0], keys=keys)
        copy = plan_copy(layout, 0, memory, shape, offsets)
        if engine == "cpu":
            return cpu.prepare(STORE, regions, 1 << 44, copy, 1 << 40)
        return plan_dma(STORE, copy, [1 << 40], 1 << 44, host_split=HOST_SPLIT)

    return plan


def per_job_us(plan: Callable[[], object], jobs: int, wake: bool) -> float:
    """Best of 5 passes, microseconds per job; `wake`: a thread woken before each job."""
    inbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()

    def woken() -> None:
        while inbox.get() is not None:
            pass

    thread = threading.Thread(target=woken, daemon=True)
    thread.start()
    best = float("inf")
    try:
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(jobs):
                if wake:
                    inbox.put(1)
                plan()
            best = min(best, (time.perf_counter() - start) / jobs)
    finally:
        inbox.put(None)
        thread.join()
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvdepot.bench.plan_cost", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--chunks", type=int, default=16, help="chunks (vLLM blocks) per job")
    ap.add_argument("--layers", type=int, default=32, help="layers: pages per chunk")
    ap.add_argument("--jobs", type=int, default=2000, help="jobs per pass")
    ap.add_argument(
        "--engine", choices=("cuda", "cpu"), default="cuda", help="the copy engine that prepares"
    )
    args = ap.parse_args(argv)
    if planner.compiled is None:
        print("the compiled planner was not built (no C compiler at install)", file=sys.stderr)
        return 1
    plan = make_job(args.chunks, args.layers, args.engine)
    compiled = planner.compiled
    print(
        f"planning one store job of {args.chunks} chunks x {args.layers} layers "
        f"({args.chunks * args.layers} pages of 64 KiB) for the {args.engine} engine, "
        f"microseconds per job, best of 5"
    )
    print(f"{'planner':10}{'alone':>10}{'a thread woken per job':>26}")
    for name in ("compiled", "numpy"):
        planner.compiled = compiled if name == "compiled" else None
        try:
            alone = per_job_us(plan, args.jobs, wake=False)
            woken = per_job_us(plan, args.jobs, wake=True)
        finally:
            planner.compiled = compiled
        print(f"{name:10}{alone:>10.1f}{woken:>26.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
