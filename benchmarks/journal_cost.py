"""What the crash journal costs a store (figures, not a test).

    python benchmarks/journal_cost.py             # 2 MiB rows (Llama-3-8B, one block)
    python benchmarks/journal_cost.py --row-kib 64

Two figures, each next to its reference in the same run:

1. Checksum: CRC-32 (zlib, what the journal uses) over rows in a pool file on
   /dev/shm, against memmove of the same rows into the pool (the store's own
   copy). The checksum runs on one background thread after the row is READY, so
   it costs CPU, not latency; the ratio says how much CPU per stored byte.
2. Event-loop time per READY row: BlockIndex.finish_store with the journal's
   listener (write(2) of a record, the row queued for its checksum, then held
   and released around it) against the same without a journal.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import hashlib
import os
import tempfile
import time
import zlib

from kvdepot.server.config import ServeConfig
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.memory.arena import Arena
from kvdepot.server.state import DepotState


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


def checksum_vs_copy(row: int, rows: int) -> tuple[float, float]:
    """(CRC-32 GB/s, memmove GB/s) over `rows` rows of `row` bytes."""
    path = tempfile.mktemp(prefix="kvdepot-cost-", dir="/dev/shm")
    arena = Arena(row * rows, path)
    try:
        src = ctypes.create_string_buffer(os.urandom(row), row)
        for i in range(rows):  # fault the pool in
            ctypes.memmove(arena.address + i * row, src, row)
        t = time.perf_counter()
        for _ in range(3):
            for i in range(rows):
                ctypes.memmove(arena.address + i * row, src, row)
        copy = 3 * rows * row / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for _ in range(3):
            for i in range(rows):
                view = arena.view(i * row, row)
                zlib.crc32(view)
                view.release()
        crc = 3 * rows * row / (time.perf_counter() - t) / 1e9
        return crc, copy
    finally:
        arena.close()
        os.unlink(path)


def loop_cost(rows: int, with_journal: bool, batch: int) -> float:
    """Seconds of event-loop time per READY row (store bookkeeping only)."""
    gran = 4096
    tmp = tempfile.mkdtemp(dir="/dev/shm")
    config = ServeConfig(
        socket="/nonexistent/kvdepot.sock",
        pool_size=(rows + 64) * gran,
        copy_threads=1,
        pool_file=os.path.join(tmp, "pool") if with_journal else None,
    )
    layout = NamespaceLayout("ns", world_size=1, blocks_per_chunk=1, groups=((gran,),))

    async def run() -> float:
        st = DepotState.create(config)
        st.index.declare_namespace(layout)
        keys = [key(i) for i in range(rows)]
        t = time.thread_time()
        for i, k in enumerate(keys):
            d = st.index.begin_store("ns", k, 0, "bench")
            assert d.slot is not None
            st.index.finish_store(d.slot, 0, True)
            if i % batch == batch - 1:  # a job's keys turn READY together
                await asyncio.sleep(0)  # the checksums are queued a loop turn later
        while st.journal is not None and st.journal.seal_backlog:
            await asyncio.sleep(0.001)
        spent = time.thread_time() - t
        st.close()
        return spent / rows

    try:
        return asyncio.run(run())
    finally:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row-kib", type=int, default=2048)
    ap.add_argument("--pool-mib", type=int, default=512)
    ap.add_argument("--rows", type=int, default=20000, help="for the event-loop figure")
    ap.add_argument("--batch", type=int, default=16, help="rows READY per loop turn (a job)")
    args = ap.parse_args()
    row = args.row_kib << 10
    crc, copy = checksum_vs_copy(row, max(1, (args.pool_mib << 20) // row))
    print(
        f"rows of {args.row_kib} KiB: CRC-32 {crc:.2f} GB/s, memmove {copy:.2f} GB/s "
        f"(checksum CPU per stored byte = {copy / crc:.2f}x the copy's)"
    )
    base = loop_cost(args.rows, False, args.batch)
    journ = loop_cost(args.rows, True, args.batch)
    print(
        f"event-loop CPU per READY row (thread time, bookkeeping only): {1e6 * base:.1f} us "
        f"without a journal, {1e6 * journ:.1f} us with (+{1e6 * (journ - base):.1f} us; "
        f"{args.batch} rows per loop turn; checksum hand-offs included)"
    )


if __name__ == "__main__":
    main()
