"""The GPU data path, measured: store (GPU -> pool) and load (pool -> GPU) through the
daemon, next to the same copies done in this process, in the same run.

An engine-like process (this one, by kvdepot.bench.cuda_engine) holds torch CUDA
KV tensors in vLLM's canonical layout (32 layers of 64 KiB pages: 2 MiB per block,
each layer its own region of one allocation), registers them with a daemon over
CUDA IPC, and moves blocks in jobs of 1, 16 and 64 chunks (one chunk = one block
here). Every job is submitted at once per round (the daemon pipelines them over its
GPU's copy threads); a round moves `bytes_per_round` and takes the wall time from the
first submit to the last result.

Beside it, in this process and on the same kinds of buffers (device memory, and
a memfd page-locked with cuMemHostRegister exactly as the daemon's pool):
- `inproc_memcpy`: PyTorch `copy_(non_blocking=True)`, i.e. cudaMemcpyAsync, one
  contiguous copy per job (the DMA limit for that copy size);
- `inproc_pages_batch`: the daemon's descriptors (planner + plan_dma without 2-D copies:
  32 scattered 64 KiB pages per block) by cuMemcpyBatchAsync, in process;
- `inproc_pages_loop`: the same pages, one cuMemcpyAsync each;
- `inproc_pages_2d`: the daemon's strided copies (one cuMemcpy2DAsync per block,
  its 32 layer pages as rows), which it uses for this layout.
`ratio` = daemon GB/s / inproc_memcpy GB/s (the strict one), `ratio_pages` = daemon /
inproc_pages_batch (what the daemon adds over its own DMA pattern).

    python -m kvdepot.bench.gpu_bench --out DIR            # starts its own daemon
    python -m kvdepot.bench.gpu_bench --target unix:///run/kvdepot/kvdepot.sock

Also `kvdepot bench` calls `run_gpu_bench(target=...)` when CUDA is present.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvdepot.bench.cuda_engine import BLOCK, LAYERS, PAGE, CudaEngine, make_key
from kvdepot.bench.daemon import DaemonUnderTest, OwnDaemon
from kvdepot.v1 import depot_pb2 as pb

STORE_TARGET_GBPS = 45.0
RATIO_TARGET = 0.85
GiB = 1 << 30


# -- in-process baselines ------------------------------------------------------------------


class PinnedHost:
    """A memfd mapping page-locked with cuMemHostRegister, like the daemon's pool."""

    def __init__(self, drv: Any, size: int, chunk: int = 256 << 20) -> None:
        fd = os.memfd_create("kvdepot-gpu-bench", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        import ctypes

        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.address = ctypes.addressof(self._anchor)
        self.size = size
        self.drv = drv
        self.chunk = chunk
        self._ranges = []
        for off in range(0, size, chunk):
            drv.host_register(self.address + off, min(chunk, size - off))
            self._ranges.append(off)

    def close(self) -> None:
        for off in self._ranges:
            self.drv.host_unregister(self.address + off)
        self._ranges = []


def _planned_dma(
    engine: CudaEngine,
    direction: int,
    blocks: Sequence[int],
    host_offsets: Sequence[int],
    dev_base: int,
    host_base: int,
    host_split: int,
    strided: bool,
) -> Any:
    """The daemon's DMA plan for one job, computed in process (same planner)."""
    from kvdepot.server.core.layout import NamespaceLayout
    from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
    from kvdepot.server.core.planner import plan_job
    from kvdepot.server.cuda.dma_plan import plan_dma

    nb, page, layers = engine.num_blocks, engine.page, engine.layers
    lay = NamespaceLayout("inproc", 1, 1, ((page,) * layers,))
    mem = MemoryMap.build(
        lay,
        [layers * nb * page],
        [TensorView(0, i * nb * page, nb, page, page) for i in range(layers)],
        [[LayerRef(i, 0, page) for i in range(layers)]],
    )
    plan = plan_job(lay, 0, mem, list(blocks), [len(blocks)], [0], list(host_offsets))
    return plan_dma(direction, plan, [dev_base], host_base, host_split=host_split, strided=strided)


def inprocess(engine: CudaEngine, job_chunks: int, chunks: int, reps: int) -> dict[str, Any]:
    """GB/s of the three in-process copies, per direction, for jobs of `job_chunks`."""
    import torch

    from kvdepot.common import cuda_driver
    from kvdepot.server.memory.copy_engine import LOAD, STORE

    drv = cuda_driver.load()
    ctx = drv.primary_context(engine.device.index)
    drv.set_current(ctx)
    nbytes = chunks * engine.block_bytes
    host = PinnedHost(drv, nbytes)
    host_t = torch.frombuffer(host.mm, dtype=torch.int8)
    out: dict[str, Any] = {"host_is_pinned": bool(host_t.is_pinned())}
    stream = drv.stream_create()
    tstream = torch.cuda.Stream(engine.device)
    dev_base = engine.kv.data_ptr()
    # The contiguous copies get their own device buffer (the KV tensors keep their
    # bytes); the page copies move the source blocks' own pages, and a load writes
    # back exactly what the store before it read.
    scratch = torch.empty(nbytes, dtype=torch.int8, device=engine.device)
    jobs = [list(range(i, min(i + job_chunks, chunks))) for i in range(0, chunks, job_chunks)]
    try:
        for direction, name in ((STORE, "store"), (LOAD, "load")):
            res: dict[str, float] = {}
            # 1) cudaMemcpyAsync (PyTorch copy_), one contiguous copy per job.
            times = []
            for _ in range(reps + 1):
                torch.cuda.synchronize(engine.device)
                t0 = time.perf_counter()
                with torch.cuda.stream(tstream):
                    for j in jobs:
                        a, b = j[0] * engine.block_bytes, (j[-1] + 1) * engine.block_bytes
                        if direction == STORE:
                            host_t[a:b].copy_(scratch[a:b], non_blocking=True)
                        else:
                            scratch[a:b].copy_(host_t[a:b], non_blocking=True)
                tstream.synchronize()
                times.append(time.perf_counter() - t0)
            res["inproc_memcpy_gbps"] = nbytes / statistics.median(times[1:]) / 1e9
            # 2) to 4) the daemon's page descriptors, batched and one by one, and its
            # strided copies (one 2-D copy per block). Chunk k's row sits at host
            # offset k * block_bytes, as a pool slot would.
            plans = {
                strided: [
                    _planned_dma(
                        engine,
                        direction,
                        j,
                        [k * engine.block_bytes for k in j],
                        dev_base,
                        host.address,
                        host.chunk,
                        strided,
                    )
                    for j in jobs
                ]
                for strided in (False, True)
            }
            for key, how in (
                ("inproc_pages_batch_gbps", "batch"),
                ("inproc_pages_loop_gbps", "loop"),
                ("inproc_pages_2d_gbps", "2d"),
            ):
                if how == "batch" and not drv.has_batch:
                    res[key] = float("nan")
                    continue
                times, issue = [], []
                for _ in range(reps + 1):
                    drv.stream_synchronize(stream)
                    t0 = time.perf_counter()
                    for dma in plans[how == "2d"]:
                        sc = dma.strided
                        if sc is not None:
                            for d, s, w in zip(sc.dsts, sc.srcs, sc.widths, strict=True):
                                drv.memcpy_2d_async(
                                    d, s, w, sc.rows, sc.dst_pitch, sc.src_pitch, stream
                                )
                        for bt in dma.batches:
                            if how == "batch":
                                drv.memcpy_batch_async(bt.dsts, bt.srcs, bt.sizes, stream)
                            else:
                                for d, s, n in zip(bt.dsts, bt.srcs, bt.sizes, strict=True):
                                    drv.memcpy_async(d, s, n, stream)
                    issue.append(time.perf_counter() - t0)  # the CPU's share: queueing
                    drv.stream_synchronize(stream)
                    times.append(time.perf_counter() - t0)
                res[key] = nbytes / statistics.median(times[1:]) / 1e9
                res[key.replace("_gbps", "_issue_ms_per_job")] = (
                    1e3 * statistics.median(issue[1:]) / len(jobs)
                )
            out[name] = res
    finally:
        drv.stream_destroy(stream)
        del host_t, scratch
        host.close()
    return out


# -- through the daemon ------------------------------------------------------------------


def through_daemon(
    engine: CudaEngine,
    job_chunks: int,
    chunks: int,
    reps: int,
    tag: bytes,
) -> dict[str, Any]:
    """Store and load GB/s through the daemon for jobs of `job_chunks`; checks bytes."""
    import torch

    src = list(range(chunks))
    dst = list(range(chunks, 2 * chunks))
    nbytes = chunks * engine.block_bytes
    out: dict[str, Any] = {}
    store_times, store_copy = [], []
    keys: list[bytes] = []
    for r in range(reps + 1):
        keys = [make_key(tag + b"/%d" % r, i) for i in range(chunks)]
        results, seconds = engine.run(pb.STORE, keys, src, job_chunks)
        bad = [x for x in results if not x.success]
        if bad:
            raise RuntimeError(f"store job failed: {bad[0].error_code}: {bad[0].error}")
        stored = sum(x.stored_keys for x in results)
        if stored != chunks:
            raise RuntimeError(f"stored {stored} of {chunks} keys (pool too small?)")
        store_times.append(seconds)
        store_copy.append(sum(x.copy_seconds for x in results))
    load_times, load_copy = [], []
    verified = False
    for _ in range(reps + 1):
        engine.zero(dst)
        torch.cuda.synchronize(engine.device)
        results, seconds = engine.run(pb.LOAD, keys, dst, job_chunks)
        bad = [x for x in results if not x.success]
        if bad:
            raise RuntimeError(f"load job failed: {bad[0].error_code}: {bad[0].error}")
        load_times.append(seconds)
        load_copy.append(sum(x.copy_seconds for x in results))
        if not verified:  # every byte, once per job size
            if not torch.equal(engine.pages(src), engine.pages(dst)):
                raise RuntimeError("loaded bytes differ from the stored ones")
            verified = True
    jobs = -(-chunks // job_chunks)
    for name, times, copy in (("store", store_times, store_copy), ("load", load_times, load_copy)):
        t = statistics.median(times[1:])
        out[name] = {
            "daemon_gbps": nbytes / t / 1e9,
            "daemon_seconds": t,
            "per_job_ms": 1e3 * t / jobs,
            "copy_ms_per_job": 1e3 * statistics.median(copy[1:]) / jobs,
        }
    out["verified_bytes"] = nbytes if verified else 0
    return out


def run_gpu_bench(
    target: str | None = None,
    *,
    serve_cmd: Sequence[str] | None = None,
    pool_size: str = "4GiB",
    gpu_copy_threads: int = 2,
    sizes: Sequence[int] = (1, 16, 64),
    reps: int = 3,
    bytes_per_round: int = GiB,
    quick: bool = False,
    log_dir: str | None = None,
    with_event: bool = True,
    **_: Any,
) -> dict[str, Any]:
    """Runs the benchmark; returns a dict (headline figures at the top level).

    Without `target` it starts its own daemon (`serve_cmd serve ...`) and stops it
    at the end, leaving its log in `log_dir/gpu_bench_daemon.log` when given.
    """
    import torch

    from kvdepot.client import DepotClient
    from kvdepot.common import cuda_driver

    if quick:
        bytes_per_round, reps = min(bytes_per_round, 256 << 20), min(reps, 2)
    chunks = max(1, bytes_per_round // BLOCK)
    if any(s > chunks for s in sizes):
        raise ValueError(f"job sizes {sizes} exceed the {chunks} chunks of a round")
    daemon = (
        DaemonUnderTest(target)
        if target is not None
        # The daemon's own log level: its log says which copy path ran ("CUDA copies").
        else OwnDaemon(
            pool_size,
            extra=["--gpu-copy-threads", str(gpu_copy_threads)],
            command=list(serve_cmd or []),
            log_level=None,
        )
    )
    target = daemon.target
    client = DepotClient(target, client_name="kvdepot gpu bench").start()
    engine: CudaEngine | None = None
    try:
        stats = daemon.wait_warm(timeout=300.0)  # faulted and page-locked
        if not client.wait_connected(30):
            raise RuntimeError(f"no session with the daemon at {target}")
        drv = cuda_driver.load()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        engine = CudaEngine(client, num_blocks=2 * chunks, with_event=with_event)
        engine.fill_random(range(chunks), seed=1)  # the source blocks: bytes worth checking
        result: dict[str, Any] = {
            "device": props.name,
            "device_uuid": engine.export.device_uuid,
            "driver_version": drv.version(),
            "batch_api": {
                2: "cuMemcpyBatchAsync (CUDA 13 ABI)",
                1: "cuMemcpyBatchAsync (CUDA 12.8 ABI)",
            }.get(drv.batch_abi, "none"),
            "torch": torch.__version__,
            "block_bytes": BLOCK,
            "layers": LAYERS,
            "page_bytes": PAGE,
            "bytes_per_round": chunks * BLOCK,
            "reps": reps,
            "pool_bytes": stats.capacity_bytes,
            "gpu_copy_threads": gpu_copy_threads,
            "inter_process_event": with_event,
            "rows": [],
        }
        for size in sizes:
            row: dict[str, Any] = {"job_chunks": size, "job_bytes": size * BLOCK}
            d = through_daemon(engine, size, chunks, reps, tag=b"bench/%d" % size)
            ip = inprocess(engine, size, chunks, reps)
            row["verified_bytes"] = d["verified_bytes"]
            row["host_is_pinned"] = ip["host_is_pinned"]
            for name in ("store", "load"):
                r = {**d[name], **ip[name]}
                r["ratio"] = r["daemon_gbps"] / r["inproc_memcpy_gbps"]
                r["ratio_pages"] = r["daemon_gbps"] / r["inproc_pages_batch_gbps"]
                r["target_met"] = (
                    r["daemon_gbps"] >= STORE_TARGET_GBPS and r["ratio"] >= RATIO_TARGET
                )
                row[name] = r
            result["rows"].append(row)
            print(progress(size, row), file=sys.stderr, flush=True)
            result[f"store_gbps_{size}"] = row["store"]["daemon_gbps"]
            result[f"load_gbps_{size}"] = row["load"]["daemon_gbps"]
            result[f"store_ratio_{size}"] = row["store"]["ratio"]
            result[f"load_ratio_{size}"] = row["load"]["ratio"]
        return result
    finally:
        if engine is not None:
            engine.close()
        client.close()
        daemon.stop(keep_log=Path(log_dir) / "gpu_bench_daemon.log" if log_dir else None)


def progress(size: int, row: dict[str, Any]) -> str:
    """One job size's line (store / load), printed as it completes."""

    def both(key: str, fmt: str) -> str:
        return " / ".join(format(row[d].get(key, float("nan")), fmt) for d in ("store", "load"))

    return (
        f"gpu_bench: {size}-chunk jobs: daemon {both('daemon_gbps', '.1f')} GB/s, ratio "
        f"{both('ratio', '.2f')}; in process: descriptors {both('inproc_pages_batch_gbps', '.1f')}"
        f" GB/s (queued in {both('inproc_pages_batch_issue_ms_per_job', '.3f')} ms a job), "
        f"2-D copies {both('inproc_pages_2d_gbps', '.1f')} GB/s (queued in "
        f"{both('inproc_pages_2d_issue_ms_per_job', '.3f')} ms a job)"
    )


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"kvdepot GPU path: {result['device']} ({result['device_uuid']}), driver "
        f"{result['driver_version']}, {result['batch_api']}, torch {result['torch']}",
        f"blocks of {result['block_bytes'] >> 20} MiB ({result['layers']} layers x "
        f"{result['page_bytes'] >> 10} KiB), {result['bytes_per_round'] >> 20} MiB per round, "
        f"median of {result['reps']}, {result['gpu_copy_threads']} copy threads of the GPU's own",
        f"targets: >= {STORE_TARGET_GBPS:.0f} GB/s each way and >= {RATIO_TARGET} of in-process "
        f"cudaMemcpyAsync",
        "",
        f"{'dir':5} {'chunks/job':>10} {'daemon GB/s':>11} {'ms/job':>8} {'memcpy GB/s':>11} "
        f"{'pages batch':>11} {'pages loop':>10} {'pages 2-D':>9} {'ratio':>6} {'r.pages':>7}  met",
    ]
    for row in result["rows"]:
        for name in ("store", "load"):
            r = row[name]
            lines.append(
                f"{name:5} {row['job_chunks']:>10} {r['daemon_gbps']:>11.1f} "
                f"{r['per_job_ms']:>8.2f} {r['inproc_memcpy_gbps']:>11.1f} "
                f"{r['inproc_pages_batch_gbps']:>11.1f} {r['inproc_pages_loop_gbps']:>10.1f} "
                f"{r.get('inproc_pages_2d_gbps', float('nan')):>9.1f} "
                f"{r['ratio']:>6.2f} {r['ratio_pages']:>7.2f}  {'yes' if r['target_met'] else 'NO'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="a running daemon (default: start one)")
    p.add_argument(
        "--serve-script",
        help="a python script to run as `kvdepot` (default: the module kvdepot.server.cli)",
    )
    p.add_argument("--pool-size", default="4GiB")
    p.add_argument(
        "--gpu-copy-threads", type=int, default=2, help="the daemon's --gpu-copy-threads"
    )
    p.add_argument("--sizes", default="1,16,64", help="chunks per job, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--round-mib", type=int, default=1024, help="MiB moved per round")
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--no-event",
        action="store_true",
        help="register without the inter-process event (the engine synchronises its "
        "device before each round instead): what the daemon's event waits cost",
    )
    p.add_argument("--out", help="directory for gpu_bench.json and gpu_bench.txt")
    args = p.parse_args(argv)
    from kvdepot.server.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"gpu_bench: skipped, no CUDA: {reason}", file=sys.stderr)
        return 3
    serve_cmd = [sys.executable, args.serve_script] if args.serve_script else None
    result = run_gpu_bench(
        args.target,
        serve_cmd=serve_cmd,
        pool_size=args.pool_size,
        gpu_copy_threads=args.gpu_copy_threads,
        sizes=[int(s) for s in args.sizes.split(",")],
        reps=args.reps,
        bytes_per_round=args.round_mib << 20,
        quick=args.quick,
        log_dir=args.out,
        with_event=not args.no_event,
    )
    table = format_table(result)
    print(table, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=2))
        (out / "gpu_bench.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
