"""Scale figure: Pin latency while admin calls and scrapes run on a 10^6-block index.

    python benchmarks/admin_scale.py --blocks 1000000          # the figure
    python benchmarks/admin_scale.py --blocks 20000 --seconds 1  # smoke run

A daemon process (`kvdepot serve`'s own Daemon, on a private socket, metrics on)
starts with its index filled in-process: `--blocks` READY blocks of a tiny layout
(one 64-byte page per row, slot granularity 64) through the index's own store
calls, so the pool stays small (64 MB for 10^6 blocks) while the index is full
size. Then a probe pins and unpins 16 ready keys every 2 ms over the gRPC socket,
while a second process drives one kind of admin load at a time (GetStats,
ListNamespaces, ListBlocks paged through with its page token, a Prometheus
scrape, all four together, then "churn": new blocks stored as fast as 1 ms slices allow,
each evicting the coldest (the index and the garbage collector under turnover), and last
a Clear of every block). `KVDEPOT_GC_FREEZE=0` in the environment gives the "before"
figures of the daemon's garbage-collection policy (server/gc_policy.py). Each phase reports
the Pin round trip's p50, p99 and max, next to the idle phase of the same run:
the delay an admin call adds is the difference. Next to it, "held": the event
loop thread's CPU time between two wake-ups of a 0.5 ms timer in the daemon (the
longest stretch of work a Pin could queue behind, free of the noise a busy
machine adds to round trips). Not a test: figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

NS = "scale"
GRAN = 64
PIN_KEYS = 16


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest() + (0).to_bytes(4, "big")


async def watch_loop(lag_file: str) -> None:
    """In the daemon: the event loop thread's CPU time between two wake-ups of a
    0.5 ms timer, i.e. how long other work held the loop. CPU time, not wall
    time, so that a busy machine preempting the daemon does not count. Written
    to `lag_file` (time, held seconds) on SIGUSR1."""
    samples: list[tuple[float, float]] = []
    loop = asyncio.get_running_loop()

    gcs: list[tuple[float, int, float]] = []  # (time, generation, seconds)
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gcs.append((time.time(), info["generation"], time.perf_counter() - started[0]))

    gc.callbacks.append(on_gc)

    def dump() -> None:
        # The GC runs first, then the samples by rename: the reader waits for the
        # samples file, which must never be seen half written (it can be 100s of MB).
        Path(lag_file + ".gc").write_text(json.dumps(gcs))
        Path(lag_file + ".tmp").write_text(json.dumps(samples))
        os.replace(lag_file + ".tmp", lag_file)

    loop.add_signal_handler(signal.SIGUSR1, dump)
    while True:
        c = time.thread_time()
        await asyncio.sleep(0.0005)
        samples.append((time.time(), time.thread_time() - c))


CHURN: list[asyncio.Task[None]] = []


def toggle_churn(st: object, first_key: int) -> None:
    """SIGUSR2 in the daemon: starts (or stops) storing new blocks as fast as 1 ms
    slices allow, each store evicting the coldest block once the pool is full:
    the index and the garbage collector under a steady turnover."""
    if CHURN:
        CHURN.pop().cancel()
        return

    async def churn() -> None:
        index = st.index  # type: ignore[attr-defined]
        i = first_key
        while True:
            end = time.perf_counter() + 0.001
            while time.perf_counter() < end:
                d = index.begin_store(NS, key(i), 0, "bench-churn")
                if d.slot is not None:
                    index.finish_store(d.slot, 0, True)
                i += 1
            await asyncio.sleep(0.001)

    CHURN.append(asyncio.get_running_loop().create_task(churn()))


def serve(socket: str, blocks: int, metrics_port: int, lag_file: str) -> None:
    """The daemon process: DepotState.create fills the index before serving."""
    from kvdepot.server import daemon
    from kvdepot.server.config import ServeConfig
    from kvdepot.server.core.layout import NamespaceLayout
    from kvdepot.server.state import DepotState

    create = DepotState.create
    tasks: list[asyncio.Task[None]] = []

    def filled(config: ServeConfig) -> DepotState:
        st = create(config)
        loop = asyncio.get_running_loop()
        tasks.append(loop.create_task(watch_loop(lag_file)))
        layout = NamespaceLayout(NS, world_size=1, blocks_per_chunk=1, groups=((GRAN,),))
        st.index.declare_namespace(layout)
        t = time.perf_counter()
        for i in range(blocks):
            d = st.index.begin_store(NS, key(i), 0, "bench-fill")
            st.index.finish_store(d.slot, 0, True)
        print(f"filled {blocks} blocks in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        loop.add_signal_handler(signal.SIGUSR2, toggle_churn, st, blocks)
        return st

    DepotState.create = staticmethod(filled)  # type: ignore[method-assign]
    config = ServeConfig(
        socket=socket,
        pool_size=(blocks + 4096) * GRAN,
        slot_granularity=GRAN,
        copy_threads=1,
        metrics_port=metrics_port,
        log_level="warning",
    )
    daemon.serve(config)


def admin_load(socket: str, kind: str, seconds: float, metrics_port: int, out: mp.Queue) -> None:
    """One kind of admin traffic for `seconds`; puts the calls' durations (s)."""
    import grpc

    from kvdepot.v1 import admin_pb2 as apb
    from kvdepot.v1 import admin_pb2_grpc

    # Admin is served on the daemon's operator socket, beside the data socket.
    stub = admin_pb2_grpc.AdminStub(grpc.insecure_channel(f"unix:{socket}.admin"))
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    token = ""

    def list_page() -> None:
        nonlocal token
        resp = stub.ListBlocks(apb.ListBlocksRequest(page_size=1000, page_token=token), timeout=60)
        token = resp.next_page_token

    calls = {
        "GetStats": lambda: stub.GetStats(apb.GetStatsRequest(), timeout=60),
        "ListNamespaces": lambda: stub.ListNamespaces(apb.ListNamespacesRequest(), timeout=60),
        "ListBlocks": list_page,
        "metrics": lambda: urllib.request.urlopen(url, timeout=60).read(),
    }
    kinds = list(calls) if kind == "all" else [kind]
    durations: list[float] = []
    if kind == "Clear":
        t = time.perf_counter()
        stub.Clear(apb.ClearRequest(), timeout=600)
        durations.append(time.perf_counter() - t)
    else:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            t = time.perf_counter()
            calls[kinds[n % len(kinds)]]()
            durations.append(time.perf_counter() - t)
            n += 1
    out.put(durations)


def pctl(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=4.0, help="per phase")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.blocks, args.metrics_port, args.serve + ".lag")
        return

    import socket as so
    import subprocess

    from kvdepot.client import DepotClient

    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="kvdepot-scale-")
    sock = os.path.join(tmp, "kvdepot.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve",
            sock,
            "--blocks",
            str(args.blocks),
            "--metrics-port",
            str(port),
        ],
    )
    rows = []
    spans: list[tuple[float, float]] = []
    try:
        client = DepotClient(f"unix://{sock}", client_name="admin-scale").start()
        assert client.wait_connected(600), "the daemon did not come up"
        pin_keys = [key(i * 7919 % args.blocks) for i in range(PIN_KEYS)]
        ctx = mp.get_context("spawn")
        phases = ("idle", "GetStats", "ListNamespaces", "ListBlocks", "metrics", "all", "churn")
        for kind in (*phases, "Clear"):
            lat: list[float] = []
            stop = threading.Event()
            t_start = time.time()

            def probe(lat: list[float] = lat, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    client.pin(NS, pin_keys, timeout=30)
                    lat.append(time.perf_counter() - t)
                    client.unpin(NS, pin_keys, wait=True, timeout=30)
                    time.sleep(0.002)

            q: mp.Queue = ctx.Queue()
            th = threading.Thread(target=probe)
            th.start()
            admin = None
            if kind in ("idle", "churn"):
                if kind == "churn":
                    os.kill(proc.pid, signal.SIGUSR2)
                time.sleep(args.seconds)
                if kind == "churn":
                    os.kill(proc.pid, signal.SIGUSR2)
                calls: list[float] = []
            else:
                time.sleep(0.3)  # the probe runs before the load starts
                admin = ctx.Process(target=admin_load, args=(sock, kind, args.seconds, port, q))
                admin.start()
                calls = q.get(timeout=900)
                admin.join()
            stop.set()
            th.join()
            spans.append((t_start, time.time()))
            rows.append(
                {
                    "phase": kind,
                    "pins": len(lat),
                    "pin_p50_ms": 1e3 * pctl(lat, 0.5),
                    "pin_p99_ms": 1e3 * pctl(lat, 0.99),
                    "pin_max_ms": 1e3 * max(lat),
                    "admin_calls": len(calls),
                    "admin_p50_ms": 1e3 * statistics.median(calls) if calls else 0.0,
                    "admin_max_ms": 1e3 * max(calls) if calls else 0.0,
                }
            )
        client.close()
        os.kill(proc.pid, signal.SIGUSR1)
        lag_file = Path(sock + ".lag")
        for _ in range(600):
            if lag_file.exists():
                break
            time.sleep(0.1)
        lag = json.loads(lag_file.read_text())
        gc_runs = json.loads(Path(sock + ".lag.gc").read_text())
        for r, (t0, t1) in zip(rows, spans, strict=True):
            held = [h for t, h in lag if t0 <= t <= t1]
            r["loop_held_p99_ms"] = 1e3 * pctl(held, 0.99)
            r["loop_held_max_ms"] = 1e3 * max(held, default=float("nan"))
            full = [d for t, g, d in gc_runs if t0 <= t <= t1 + 1 and g == 2]
            r["full_gc_runs"] = len(full)
            r["full_gc_max_ms"] = 1e3 * max(full, default=0.0)
    finally:
        proc.terminate()
        proc.wait(60)
    idle = rows[0]
    for r in rows:
        r["pin_p99_over_idle_ms"] = r["pin_p99_ms"] - idle["pin_p99_ms"]
    if args.json:
        print(json.dumps({"blocks": args.blocks, "phases": rows}, indent=1))
    print(
        f"{args.blocks} blocks; Pin of {PIN_KEYS} keys every 2 ms during each phase "
        f"({args.seconds:g} s; Clear: one call)",
        file=sys.stderr,
    )
    print(
        f"{'phase':<15}{'pins':>6}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'p99-idle':>10}"
        f"{'calls':>7}{'call p50':>10}{'call max':>10}{'held p99':>10}{'held max':>10}"
        f"{'full GCs':>10}{'GC max':>8}",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['phase']:<15}{r['pins']:>6}{r['pin_p50_ms']:>9.2f}{r['pin_p99_ms']:>9.2f}"
            f"{r['pin_max_ms']:>9.2f}{r['pin_p99_over_idle_ms']:>10.2f}{r['admin_calls']:>7}"
            f"{r['admin_p50_ms']:>10.2f}{r['admin_max_ms']:>10.2f}"
            f"{r['loop_held_p99_ms']:>10.2f}{r['loop_held_max_ms']:>10.2f}"
            f"{r['full_gc_runs']:>10}{r['full_gc_max_ms']:>8.0f}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
