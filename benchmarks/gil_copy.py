"""What a busy event loop costs the copy threads: the GIL, taken back after every memmove.

    python -m kvdepot.bench.gil_copy

`CpuCopyEngine` copies a job run by run (one ctypes memmove per 64 KiB page of a
Llama-3-8B-shaped job, the GIL released during each). This moves 40 jobs of 512
scattered pages with 1 and 2 copy threads, first alone, then beside a thread that
runs Python without pause (the event loop at its busiest), and prints GB/s for each.
The gap between the two is the time copy threads spend waiting to take the GIL
back. Then the same with the compiled run copier (`_runcopy.copy_runs`, one call
per job), which takes the GIL back once per job. A figure, not a test.
"""

from __future__ import annotations

import ctypes
import mmap
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvdepot.server.memory.copy_engine import copy_runs

PAGE = 64 << 10
PAGES = 4096
JOBS = 40
RUNS_PER_JOB = 512  # a 16-chunk job: 16 keys x 32 layers


def main() -> None:
    client = mmap.mmap(-1, PAGE * PAGES)
    pool = mmap.mmap(-1, PAGE * PAGES)
    client.write(random.randbytes(PAGE) * PAGES)
    client_base = ctypes.addressof(ctypes.c_char.from_buffer(client))
    pool_base = ctypes.addressof(ctypes.c_char.from_buffer(pool))
    jobs = [
        [(pool_base + i * PAGE, client_base + p * PAGE) for i, p in enumerate(pages)]
        for pages in (random.sample(range(PAGES), RUNS_PER_JOB) for _ in range(JOBS))
    ]

    def copy(job: list[tuple[int, int]]) -> None:
        for dst, src in job:
            ctypes.memmove(dst, src, PAGE)

    columns = [
        (
            np.array([d for d, _ in job], dtype=np.int64),
            np.array([s for _, s in job], dtype=np.int64),
            np.full(len(job), PAGE, dtype=np.int64),
        )
        for job in jobs
    ]

    def copy_compiled(job: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        copy_runs(*job)

    busy = threading.Event()

    def python_work() -> None:
        while busy.is_set():
            total = 0
            for i in range(20000):
                total += i

    def run(threads: int, with_busy_loop: bool, fn: Callable[[Any], None], work: list) -> float:
        """GB/s of `fn` over the jobs in `work` (one form or the other of `jobs`)."""
        if with_busy_loop:
            busy.set()
        spinner = threading.Thread(target=python_work)
        spinner.start()
        t = time.perf_counter()
        workers = [
            threading.Thread(target=lambda k=k: [fn(j) for j in work[k::threads]])
            for k in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t
        busy.clear()
        spinner.join()
        return JOBS * RUNS_PER_JOB * PAGE / seconds / 1e9

    print(f"{JOBS} jobs of {RUNS_PER_JOB} scattered {PAGE >> 10} KiB pages")
    variants: list[tuple[str, Callable[[Any], None], list]] = [
        ("one ctypes memmove per page", copy, jobs)
    ]
    if copy_runs is not None:
        variants.append(("compiled run copier, one call per job", copy_compiled, columns))
    for name, fn, work in variants:
        print(f" {name}:")
        for threads in (1, 2):
            alone = run(threads, False, fn, work)
            beside = run(threads, True, fn, work)
            print(
                f"  {threads} copy thread(s): {alone:5.1f} GB/s alone, "
                f"{beside:5.1f} GB/s beside a thread running Python"
            )


if __name__ == "__main__":
    main()
