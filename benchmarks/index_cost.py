"""What the daemon's block index costs per key and per row, on the index alone (sans-I/O).

    python -m kvdepot.bench.index_cost [--rows 200000] [--reps 5]

Three figures, each the median of `--reps` passes, on `BlockIndex` as the daemon's loop
calls it (no sockets, no copies):
- store: a 16-key store job claimed and settled (`begin_store_many`, `finish_store_many`)
  into a full pool of 2,048 rows, so that every key evicts the least recently used row
  (the control-plane ceiling's TP=1 store series in steady state), µs a key;
- pin / unpin: 1,024 keys pinned then unpinned by one session (a scheduler step's pins
  with 64 requests' hits) at a random place in an index of `--rows` READY rows, µs a key
  (the keys are cold in the CPU's caches, as in a daemon serving many engines);
- memory: the resident bytes a READY row costs the index, filling `--rows` of them
  (keys, slots, the namespace's dict and paging order, the eviction order).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

from kvdepot.server.core.allocator import ExtentAllocator
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.layout import NamespaceLayout

NS = "index-cost"
STORE_ROWS = 2048
STORE_JOB_KEYS = 16
PIN_KEYS = 1024
GRANULARITY = 64  # one 64-byte slot a row: the pool stays small at any row count


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def make_index(rows: int) -> BlockIndex:
    index = BlockIndex(ExtentAllocator(rows * GRANULARITY, GRANULARITY), on_event=lambda e: None)
    index.declare_namespace(NamespaceLayout(NS, 1, 1, ((GRANULARITY,),)))
    return index


def fill(index: BlockIndex, first: int, count: int, per_job: int = 4096) -> None:
    for start in range(first, first + count, per_job):
        keys = [key(i) for i in range(start, min(start + per_job, first + count))]
        claim = index.begin_store_many(NS, keys, 0, "filler")
        index.finish_store_many(claim.slots, 0, True)


def store_us_per_key(jobs: int = 3000) -> float:
    index = make_index(STORE_ROWS)
    fill(index, 0, STORE_ROWS)
    batches = [
        [key(STORE_ROWS + j * STORE_JOB_KEYS + i) for i in range(STORE_JOB_KEYS)]
        for j in range(jobs)
    ]
    start = time.perf_counter()
    for keys in batches:
        claim = index.begin_store_many(NS, keys, 0, "engine")
        index.finish_store_many(claim.slots, 0, True)
    return (time.perf_counter() - start) / (jobs * STORE_JOB_KEYS) * 1e6


def pin_unpin_us_per_key(index: BlockIndex, rows: int, calls: int = 200) -> tuple[float, float]:
    rng = random.Random(1)
    pins, unpins = [], []
    for _ in range(calls):
        first = rng.randrange(0, rows - PIN_KEYS)
        keys = [key(i) for i in range(first, first + PIN_KEYS)]
        start = time.perf_counter()
        index.pin(NS, keys, "scheduler")
        pinned = time.perf_counter()
        index.unpin(NS, keys, "scheduler")
        pins.append(pinned - start)
        unpins.append(time.perf_counter() - pinned)
    per_key = 1e6 / PIN_KEYS
    return statistics.median(pins) * per_key, statistics.median(unpins) * per_key


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvdepot.bench.index_cost", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=200_000, help="READY rows (pins, memory)")
    ap.add_argument("--reps", type=int, default=5, help="passes; the median is printed")
    args = ap.parse_args(argv)
    if args.rows < 2 * PIN_KEYS:
        ap.error(f"--rows: at least {2 * PIN_KEYS}")

    store = statistics.median(store_us_per_key() for _ in range(args.reps))
    gc.collect()
    before = resident_bytes()
    index = make_index(args.rows)
    fill(index, 0, args.rows)
    row_bytes = (resident_bytes() - before) / args.rows
    passes = [pin_unpin_us_per_key(index, args.rows) for _ in range(args.reps)]
    pin = statistics.median(p for p, _ in passes)
    unpin = statistics.median(u for _, u in passes)
    index.check_invariants()
    print(f"block index, sans-I/O: medians of {args.reps} passes; {args.rows} READY rows")
    print(f"store, {STORE_JOB_KEYS}-key jobs, each key evicting (us a key)  {store:8.2f}")
    print(f"pin, {PIN_KEYS} cold keys (us a key)                      {pin:8.2f}")
    print(f"unpin, {PIN_KEYS} cold keys (us a key)                    {unpin:8.2f}")
    print(f"memory, a READY row (bytes)                         {row_bytes:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
