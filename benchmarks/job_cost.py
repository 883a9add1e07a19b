"""What one rank job costs the daemon's event loop with no socket: the job path alone.

    python -m kvdepot.bench.job_cost [--tp 8] [--layers 80] [--page-kib 8] [--chunks 16]
                                     [--jobs 20] [--passes 6]

A real DepotState (arena, index, copy threads) and the Depot service's `answer_job`, the
coroutine every job of a lane or a Transfer stream runs, on a uvloop loop, 64 jobs in
flight: `--tp` registrations of one namespace (by default a Llama-3-70B-like rank at TP=8:
80 layers of 8 KiB pages), jobs of `--chunks` chunks, every keyset stored by every rank
and then loaded by every rank. Copies are off as in the control-plane ceiling
(kvdepot.bench.ceiling.NullCopyEngine plans the CUDA engine's DMA and moves nothing), so
the registrations' memory is an address range nothing reads. The pool holds about one and
a half passes of rows: from the second pass on, every store evicts, as in a daemon's
steady state.

It prints the loop thread's CPU per rank job (store, load; the median of the passes after
the first two), then one more pass with each step of the job path timed, in job order:
what is left over is the job's coroutines and the copy-queue hand-off both ways (and
about 0.1 µs of timing per timed call). Left out, unlike the node series' `(loop)` column
(kvdepot.bench.node): the lane's read and answer, uvloop's dispatch, the kernel's work
for them, and the engines' contention for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvloop

from kvdepot.bench.ceiling import NullCopyEngine
from kvdepot.bench.inproc import LocalRegion
from kvdepot.common.kinds import MemoryPath
from kvdepot.server.config import ServeConfig
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.service import depot as depot_service
from kvdepot.server.service.depot import DepotServicer
from kvdepot.server.state import DepotState
from kvdepot.server.state import jobs as job_runner
from kvdepot.server.state.traffic import Traffic
from kvdepot.v1 import depot_pb2 as pb

NAMESPACE = "job-cost"
BLOCKS = 1024  # blocks of each rank's KV tensors: job block ids are sampled from them
DEPTH = 64  # jobs in flight
FILL_PASSES = 2  # passes before the pool is full and stores evict: not in the medians

# The steps of a job, in order: (label, owner, attribute). The owner is the module or
# class the job path looks the name up in when it runs.
STEPS: tuple[tuple[str, Any, str], ...] = (
    ("decode the job (job_from_proto)", depot_service, "job_from_proto"),
    ("admitted: session, counts (admit_job)", DepotState, "admit_job"),
    ("check: registration, size, shape (_check)", job_runner.JobRunner, "_check"),
    ("index claim, store (begin_store_many)", BlockIndex, "begin_store_many"),
    ("index claim, load (begin_read_many)", BlockIndex, "begin_read_many"),
    ("plan (plan_copy)", job_runner, "plan_copy"),
    ("DMA plan (the engine's prepare)", NullCopyEngine, "prepare"),
    ("index settle, store (finish_store_many)", BlockIndex, "finish_store_many"),
    ("index settle, load (end_read_many)", BlockIndex, "end_read_many"),
    ("counting (Traffic.record)", Traffic, "record"),
    ("encode the result (result_to_proto)", depot_service, "result_to_proto"),
)


class _AddressOnly:
    """Registrations' memory as an address range that nothing reads (the null engine
    only plans), served in the slot of a memory path a bare DepotState leaves empty."""

    kind = MemoryPath.PVM

    def __init__(self, size: int) -> None:
        self.size = size

    def open(self, handle: object, session_id: str) -> tuple[LocalRegion, NullCopyEngine]:
        return LocalRegion(1 << 40, self.size), NullCopyEngine()


@contextmanager
def timed_steps(spent: Counter[str]) -> Iterator[None]:
    """Adds each step's wall time (ns; the loop is one thread) to `spent` while open."""
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in STEPS]

    def timer(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - t0

        return timed

    try:
        for (label, owner, name), (_, _, fn) in zip(STEPS, originals, strict=True):
            setattr(owner, name, timer(label, fn))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


class Rig:
    """The state, the service and the registrations; jobs made and run on the loop."""

    def __init__(self, tp: int, layers: int, page: int, chunks: int, keysets: int) -> None:
        self.tp, self.chunks, self.keysets = tp, chunks, keysets
        row_bytes = tp * layers * page
        pool = math.ceil(1.5 * keysets * chunks * row_bytes / (1 << 20)) << 20
        self.state = DepotState.create(
            ServeConfig(
                socket="/nonexistent/kvdepot.sock",
                pool_size=pool,
                copy_threads=2,
                max_writing_per_session="100%",
            )
        )
        self.state.add_memory_path(_AddressOnly(layers * BLOCKS * page))
        self.service = DepotServicer(self.state)
        layout = NamespaceLayout(NAMESPACE, tp, 1, ((page,) * layers,))
        tensors = [TensorView(0, i * BLOCKS * page, BLOCKS, page, page) for i in range(layers)]
        groups = [[LayerRef(i, 0, page) for i in range(layers)]]
        self.session = self.state.open_session("job-cost", os.getpid(), "")
        self.registrations = [
            self.state.register(self.session.id, layout, r, [("pvm", None)], tensors, groups).id
            for r in range(tp)
        ]
        self.rng = random.Random(7)
        self.job_id = 0

    def close(self) -> None:
        self.state.close()

    def make_pass(self) -> tuple[list[pb.TransferJob], list[pb.TransferJob]]:
        """A pass: `keysets` fresh keysets, each stored then loaded by every rank."""
        stores: list[pb.TransferJob] = []
        loads: list[pb.TransferJob] = []
        for _ in range(self.keysets):
            keys = [self.rng.randbytes(28) + bytes(4) for _ in range(self.chunks)]
            block_ids = self.rng.sample(range(BLOCKS), self.chunks)
            for direction, out in ((pb.STORE, stores), (pb.LOAD, loads)):
                for reg in self.registrations:
                    self.job_id += 1
                    out.append(
                        pb.TransferJob(
                            job_id=self.job_id,
                            direction=direction,
                            registration_id=reg,
                            keys=keys,
                            block_ids=block_ids,
                            group_sizes=[self.chunks],
                            block_indices=[0],
                            session_id=self.session.id,
                        )
                    )
        return stores, loads

    async def run(self, jobs: list[pb.TransferJob]) -> float:
        """Runs `jobs`, DEPTH at a time; the loop thread's CPU µs per job. Raises if a
        job fails or a store drops a key (the figure would not be a job's cost)."""
        t0 = time.thread_time()
        for i in range(0, len(jobs), DEPTH):
            batch = jobs[i : i + DEPTH]
            results = await asyncio.gather(*(self.service.answer_job(j) for j in batch))
            for job, r in zip(batch, results, strict=True):
                if not r.success or r.dropped_keys:
                    raise RuntimeError(f"job {job.job_id} failed: {r.error_code} {r.error}")
        return (time.thread_time() - t0) / len(jobs) * 1e6


async def measure(rig: Rig, passes: int) -> tuple[list[float], list[float], Counter[str], float]:
    """Per pass store and load µs per rank job; then one more pass timed step by step:
    its µs per step and in all, a rank job each (stores and loads together)."""
    store_us: list[float] = []
    load_us: list[float] = []
    for i in range(passes):
        stores, loads = rig.make_pass()
        s, ld = await rig.run(stores), await rig.run(loads)
        if i >= FILL_PASSES:
            store_us.append(s)
            load_us.append(ld)
    spent: Counter[str] = Counter()
    stores, loads = rig.make_pass()
    with timed_steps(spent):
        # The total is the loop thread's CPU (Rig.run); the steps are wall time, cheaper to
        # read per call and the same while the loop holds the GIL through each step.
        total_us = await rig.run(stores) * len(stores) + await rig.run(loads) * len(loads)
    jobs = len(stores) + len(loads)
    per_step = Counter({label: ns / 1e3 / jobs for label, ns in spent.items()})
    return store_us, load_us, per_step, total_us / jobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvdepot.bench.job_cost", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--tp", type=int, default=8, help="ranks: registrations of the namespace")
    ap.add_argument("--layers", type=int, default=80, help="layers: pages per chunk")
    ap.add_argument("--page-kib", type=int, default=8, help="a rank's page, KiB")
    ap.add_argument("--chunks", type=int, default=16, help="chunks (vLLM blocks) per job")
    ap.add_argument("--jobs", type=int, default=20, help="keysets per pass (x TP rank jobs)")
    ap.add_argument("--passes", type=int, default=6, help="passes; the first two fill the pool")
    args = ap.parse_args(argv)
    if args.passes <= FILL_PASSES:
        ap.error(f"--passes must be more than {FILL_PASSES}")
    rig = Rig(args.tp, args.layers, args.page_kib << 10, args.chunks, args.jobs)
    try:
        store_us, load_us, per_step, total = uvloop.run(measure(rig, args.passes))
    finally:
        rig.close()
    print(
        f"one rank job of {args.chunks} chunks x {args.layers} layers of {args.page_kib} KiB "
        f"pages, TP={args.tp}, copies off, no socket: the event loop's CPU, median of "
        f"{len(store_us)} passes"
    )
    print(f"store {statistics.median(store_us):8.1f} µs a rank job")
    print(f"load  {statistics.median(load_us):8.1f} µs a rank job")
    print("one more pass, each step timed (µs a rank job, store and load together):")
    for label, _, _ in STEPS:
        print(f"  {label:44} {per_step[label]:6.1f}")
    rest = total - sum(per_step.values())
    print(f"  {'the rest: coroutines, copy-queue hand-off':44} {rest:6.1f}")
    print(f"  {'total':44} {total:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
