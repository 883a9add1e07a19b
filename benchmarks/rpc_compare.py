"""Unary RPCs of several daemon builds, interleaved: a before/after on one machine.

    python -m kvdepot.bench.rpc_compare [--rounds 40] [--calls 60] [--json]
        [--daemon NAME=COMMAND ...]

Starts one `kvdepot serve` per `--daemon` (COMMAND: a `kvdepot` program, e.g. another
checkout's `.venv/bin/kvdepot`; default: this one's, twice, "a" and "b", which shows
the noise), one client of this tree each, an observer namespace on each, and then in
every round, daemon after daemon (the order reversed each round, so that a load that
rises or falls hits them alike), makes `--calls` calls of each kind: Lookup, Pin and
Unpin (wait=True) of 16 keys, through DepotClient, as the scheduler's gRPC fallbacks do.
Reports per daemon and kind the p50 and p90 latency, and per daemon the CPU time its
process spent per call (from /proc), each with its ratio to the first daemon's: figures
taken in the same run. The first round is a warm-up, not counted. The client is this
tree's for every daemon (an older daemon ignores the session metadata it sends).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvdepot.bench.daemon import process_cpu_seconds
from kvdepot.client.depot_client import DepotClient
from kvdepot.testing.daemon import ServeProcess, kvdepot_command
from kvdepot.v1 import depot_pb2 as pb

KINDS = ("lookup", "pin", "unpin")
KEYS = 16
NAMESPACE = "rpc-compare"


def _calls(client: DepotClient, keys: list[bytes]) -> dict[str, Callable[[], Any]]:
    return {
        "lookup": lambda: client.lookup(NAMESPACE, keys),
        "pin": lambda: client.pin(NAMESPACE, keys),
        "unpin": lambda: client.unpin(NAMESPACE, keys, wait=True),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def compare(daemons: list[tuple[str, list[str]]], rounds: int, calls: int) -> dict[str, Any]:
    names = [name for name, _ in daemons]
    samples: dict[tuple[str, str], list[float]] = {(n, k): [] for n in names for k in KINDS}
    cpu = dict.fromkeys(names, 0.0)
    counted = dict.fromkeys(names, 0)
    keys = [os.urandom(32) for _ in range(KEYS)]
    layout = pb.NamespaceLayout(
        id=NAMESPACE,
        world_size=1,
        blocks_per_chunk=1,
        groups=[pb.GroupLayout(layer_page_bytes=[4096])],
    )
    started: list[tuple[ServeProcess, DepotClient]] = []
    with tempfile.TemporaryDirectory(prefix="kvd-rpc-compare-") as tmp:
        try:
            for i, (_, command) in enumerate(daemons):
                workdir = Path(tmp) / str(i)
                workdir.mkdir()
                serve = ServeProcess(workdir, "--pool-size", "64MiB", command=command).start()
                client = DepotClient(serve.target, client_name="rpc-compare").start()
                if not client.wait_connected(20):
                    raise RuntimeError(f"no session with {command}: {serve.log()[-2000:]}")
                client.register_memory(layout, 0, [], [], [])  # a namespace, no memory
                started.append((serve, client))
            for r in range(rounds + 1):  # round 0 warms up
                order = list(range(len(daemons)))
                if r % 2:
                    order.reverse()
                for i in order:
                    name, (serve, client) = names[i], started[i]
                    assert serve.proc is not None
                    before = process_cpu_seconds(serve.proc.pid)
                    for kind, call in _calls(client, keys).items():
                        for _ in range(calls):
                            t0 = time.perf_counter()
                            call()
                            if r:
                                samples[(name, kind)].append(time.perf_counter() - t0)
                    if r:
                        cpu[name] += process_cpu_seconds(serve.proc.pid) - before
                        counted[name] += calls * len(KINDS)
        finally:
            for serve, client in started:
                client.close()
                serve.stop()
    first = names[0]
    out: dict[str, Any] = {"rounds": rounds, "calls": calls, "keys": KEYS, "daemons": {}}
    for name in names:
        row: dict[str, Any] = {}
        for kind in KINDS:
            p50 = _percentile(samples[(name, kind)], 0.5)
            base = _percentile(samples[(first, kind)], 0.5)
            row[kind] = {
                "p50_us": p50 * 1e6,
                "p90_us": _percentile(samples[(name, kind)], 0.9) * 1e6,
                "p50_ratio": p50 / base,
            }
        per_call = cpu[name] / counted[name]
        base_cpu = cpu[first] / counted[first]
        row["daemon_cpu_us_per_call"] = per_call * 1e6
        # None when the first daemon's CPU time read 0 (it exited)
        row["cpu_ratio"] = per_call / base_cpu if base_cpu else None
        out["daemons"][name] = row
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


def _daemon(spec: str) -> tuple[str, list[str]]:
    name, sep, command = spec.partition("=")
    if not sep or not name or not command:
        raise argparse.ArgumentTypeError(f"--daemon {spec!r}: expected NAME=COMMAND")
    return name, shlex.split(command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvdepot.bench.rpc_compare")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=60, help="calls of each kind per round")
    parser.add_argument(
        "--daemon", type=_daemon, action="append", help="NAME=COMMAND (a kvdepot program)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    daemons = args.daemon or [("a", kvdepot_command()), ("b", kvdepot_command())]
    if len({name for name, _ in daemons}) != len(daemons):
        parser.error("--daemon names must differ")
    result = compare(daemons, args.rounds, args.calls)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"{args.rounds} rounds x {args.calls} calls of each kind, {KEYS} keys a call, "
        f"load average {result['loadavg_1min']:.1f}"
    )
    for name, row in result["daemons"].items():
        kinds = "  ".join(
            f"{k} p50 {row[k]['p50_us']:.0f} us ({row[k]['p50_ratio']:.2f})" for k in KINDS
        )
        ratio = "-" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.2f}"
        print(
            f"{name:>12}: {kinds}  daemon CPU {row['daemon_cpu_us_per_call']:.0f} us/call ({ratio})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
