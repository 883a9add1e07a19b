"""What a KV-event subscriber that never reads costs the daemon (`--kv-events`).

    python -m kvdepot.bench.kv_events_stuck [--rounds 3] [--json] [-- BENCH FLAGS]

Starts one daemon with `--kv-events tcp://*:PORT` and runs `kvdepot bench --socket` on
it (copy-path figures only: `--quick --sizes 1,16` unless flags follow `--`) in
alternating rounds: without a subscriber, then with a ZMQ SUB socket that connects,
subscribes to everything and never reads (receive high-water mark 1). Every store
names fresh keys, so every stored chunk is a BlockStored and the full pool's evictions
BlockRemoved: the stream runs all along. Reports the median of each figure per mode,
the ratio stuck / none (taken in the same run, rounds interleaved so drift hits both),
the daemon's resident memory after each round (what a stuck subscriber's queue would
grow: ZMQ's per-subscriber pipe, bounded by the PUB socket's high-water mark), its
`kv_events_published` and `kv_events_dropped`, and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from kvdepot.testing.daemon import ServeProcess, kvdepot_command

DEFAULT_BENCH = ["--quick", "--sizes", "1,16"]
FIXED_BENCH = ["--no-aggregate", "--no-ceiling", "--no-connector", "--no-gpu", "--json", "--quiet"]


def _free_port_pair() -> int:
    """A port whose next one is free too (the PUB socket and its replay ROUTER)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _figures(report: dict[str, Any]) -> dict[str, float]:
    """The copy figures of one `kvdepot bench --json` run: GB/s per direction and size."""
    out: dict[str, float] = {}
    for row in report["throughput"]:
        for direction in ("store", "load"):
            if row.get(direction):
                out[f"{direction} {row['chunks']} chunks GB/s"] = row[direction]["daemon_gbps"]
    return out


def _stuck_subscriber(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)  # the kernel's buffer small too: the PUB side fills
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def run(rounds: int, bench_flags: list[str], pool_size: str) -> dict[str, Any]:
    port = _free_port_pair()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvd-evstuck-") as tmp:
        d = ServeProcess(Path(tmp), "--pool-size", pool_size, "--kv-events", f"tcp://*:{port}")
        d.start()
        ctx = zmq.Context()
        runs: list[dict[str, Any]] = []
        try:
            assert d.proc is not None
            for i in range(2 * rounds):
                mode = "stuck" if i % 2 else "none"
                sub = _stuck_subscriber(ctx, f"tcp://127.0.0.1:{port}") if mode == "stuck" else None
                time.sleep(0.3)  # the subscription reaches the PUB socket
                cmd = [*kvdepot_command(), "bench", "--socket", d.socket_path]
                done = subprocess.run(
                    [*cmd, "--pool-size", pool_size, *bench_flags, *FIXED_BENCH],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                st = d.stats()
                runs.append(
                    {
                        "mode": mode,
                        "figures": _figures(json.loads(done.stdout)),
                        "daemon_rss_mib": _rss_mib(d.proc.pid),
                        "kv_events_published": st.kv_events_published,
                        "kv_events_dropped": st.kv_events_dropped,
                    }
                )
                if sub is not None:
                    sub.close(linger=0)
                print(f"round {i + 1}/{2 * rounds} ({mode}) done", file=sys.stderr)
        finally:
            ctx.destroy(linger=0)
            d.stop()
    names = list(runs[0]["figures"])
    median = {
        mode: {
            n: statistics.median(r["figures"][n] for r in runs if r["mode"] == mode) for n in names
        }
        for mode in ("none", "stuck")
    }
    return {
        "command": " ".join(sys.argv),
        "bench_flags": bench_flags,
        "pool_size": pool_size,
        "rounds": runs,
        "median": median,
        "ratio_stuck_over_none": {n: median["stuck"][n] / median["none"][n] for n in names},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'figure':<26} {'none':>8} {'stuck':>8} {'stuck/none':>11}"]
    for name, ratio in result["ratio_stuck_over_none"].items():
        none, stuck = result["median"]["none"][name], result["median"]["stuck"][name]
        lines.append(f"{name:<26} {none:>8.2f} {stuck:>8.2f} {ratio:>11.2f}")
    lines.append("")
    for r in result["rounds"]:
        lines.append(
            f"{r['mode']:<6} daemon RSS {r['daemon_rss_mib']:7.1f} MiB, "
            f"kv_events_published {r['kv_events_published']}, "
            f"kv_events_dropped {r['kv_events_dropped']}"
        )
    start, end = result["loadavg_start"], result["loadavg_end"]
    lines.append(
        f"load average: {start[0]:.2f} {start[1]:.2f} {start[2]:.2f} at the start, "
        f"{end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at the end ({os.cpu_count()} CPUs)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_flags = DEFAULT_BENCH
    if "--" in argv:
        at = argv.index("--")
        argv, bench_flags = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m kvdepot.bench.kv_events_stuck")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode (default 3)")
    parser.add_argument("--pool-size", default="256MiB", help="the daemon's pool (default 256MiB)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table to stderr)")
    args = parser.parse_args(argv)
    result = run(args.rounds, bench_flags, args.pool_size)
    print(table(result), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
