"""`kvdepot bench --capacity`: what a full pool is worth, next to vLLM's own CPU tier.

    kvdepot bench --capacity [--quick] [--json] [--capacity-pool 64] [--capacity-requests 400]
    python -m kvdepot.bench.capacity [same flags]

The same traces (kvdepot.bench.capacity_traces: multi-turn chat, shared documents,
agent loops; working sets 2x, 4x, 8x the pool) replayed one request at a time
(kvdepot.bench.capacity_runs), in one run, through:

- kvdepot: a real daemon (`kvdepot serve`, pool of exactly the bench's chunks) and the
  real KVDepotConnector, once per eviction policy (`--eviction-policy lru`, `arc`), and
  once with the disk tier (`--disk`, `CAPACITY_DISK_POOLS` x the pool, LRU);
- vLLM 0.33's OffloadingConnector with its CPUOffloadingManager of the same chunks,
  policies `lru` and `arc`;
- Belady's MIN (offline, the whole trace known): the ceiling.

Per trace and system: the token hit rate (tokens of leading chunks found / prompt
tokens: a hit after a miss is no hit), the bytes stored into the tier, and the rows
held that no lookup can reach (kvdepot: read from the daemon after every request;
must be 0). With the disk, also those across the tiers: rows of the pool or the disk
with an earlier chunk neither holds (the disk's records read from the daemon's Watch
stream; must be 0), and Belady's at the pool's and the disk's size together. The
targets: kvdepot's hit rate >= the best of vLLM's `lru` and `arc` and >= 0.8 x
Belady's on every trace; RAM+disk >= RAM only; RAM+disk unreachable across the tiers 0.
`--capacity-disk-only` replays kvdepot with the disk alone (and Belady's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

FULL = {"pool": 64, "requests": 400, "ratios": [2, 4, 8]}
# --quick: a smoke run in seconds (one ratio, few requests), not figures to publish.
QUICK = {"pool": 16, "requests": 24, "ratios": [4]}
KVDEPOT_POLICIES = ("lru", "arc")
VLLM_POLICIES = ("lru", "arc")
CAPACITY_DISK_POOLS = 4  # the disk tier's size, in pools
SEED = 7
BELADY_SHARE = 0.8


def add_arguments(g: argparse._ActionsContainer) -> None:
    """The `--capacity-*` flags, in `g` (a parser or its group; `--capacity` itself is
    kvdepot.bench.cli's)."""
    g.add_argument(
        "--capacity-pool",
        type=int,
        help="pool in chunks of 16 tokens, kvdepot's and vLLM's alike (default 64; --quick 16)",
    )
    g.add_argument(
        "--capacity-requests",
        type=int,
        help="requests per trace (default 400; --quick 24)",
    )
    g.add_argument(
        "--capacity-ratios",
        help="working sets in pools, e.g. 2,4,8 (default 2,4,8; --quick 4)",
    )
    g.add_argument(
        "--capacity-traces",
        default="chat,docs,agent",
        help="traces to replay, of chat, docs, agent (default all)",
    )
    g.add_argument(
        "--capacity-no-disk", action="store_true", help="skip the kvdepot run with --disk"
    )
    g.add_argument(
        "--capacity-disk-only",
        action="store_true",
        help="only the kvdepot run with --disk (and Belady's): the tiers' figures",
    )


def run_capacity(
    pool: int,
    requests: int,
    ratios: list[float],
    families: list[str],
    disk: bool = True,
    on_step: Callable[[str], None] | None = None,
    disk_only: bool = False,
) -> dict[str, Any]:
    """Every trace through every system (`disk_only`: kvdepot with the disk alone);
    the figures, per trace."""
    from kvdepot.bench.capacity_runs import DiskTier, run_kvdepot, run_vllm
    from kvdepot.bench.capacity_traces import belady, make_trace
    from kvdepot.bench.connector_bench import cpu_environment

    cpu_environment()
    step = on_step or (lambda _: None)
    chunk = _chunk_bytes()
    rows = []
    for family in families:
        for ratio in ratios:
            trace = make_trace(family, ratio, pool, requests, SEED)
            where = f"{family} {ratio:g}x"
            systems: dict[str, Any] = {}
            ceiling = belady(trace, pool)
            systems["belady"] = {
                "system": "belady",
                "hit_tokens": ceiling["hit_tokens"],
                "hit_rate": ceiling["hit_tokens"] / trace.prompt_tokens,
                "stored_chunks": ceiling["stored_chunks"],
                "stored_bytes": ceiling["stored_chunks"] * chunk,
            }
            unbounded = belady(trace, 1 << 40)["hit_tokens"] / trace.prompt_tokens
            for policy in () if disk_only else VLLM_POLICIES:
                step(f"{where}: vLLM {policy}")
                systems[f"vllm-{policy}"] = run_vllm(trace, pool, policy).figures(trace, chunk)
            for policy in () if disk_only else KVDEPOT_POLICIES:
                step(f"{where}: kvdepot {policy}")
                replay = run_kvdepot(trace, pool, policy)
                systems[f"kvdepot-{policy}"] = replay.figures(trace, chunk)
            if disk:
                step(f"{where}: kvdepot lru + disk")
                replay = run_kvdepot(trace, pool, "lru", DiskTier(CAPACITY_DISK_POOLS * pool))
                systems["kvdepot-lru+disk"] = replay.figures(trace, chunk)
            row = {"trace": trace.summary(), "unbounded_hit_rate": unbounded, "systems": systems}
            if disk:  # the hierarchy's ceiling: Belady's with the RAM and the disk's rows
                both = belady(trace, (1 + CAPACITY_DISK_POOLS) * pool)["hit_tokens"]
                row["belady_ram_disk_hit_rate"] = both / trace.prompt_tokens
            rows.append(row)
    return {
        "config": {
            "pool_chunks": pool,
            "chunk_tokens": 16,
            "chunk_bytes": chunk,
            "requests": requests,
            "ratios": ratios,
            "traces": families,
            "seed": SEED,
            "disk_chunks": CAPACITY_DISK_POOLS * pool if disk else 0,
            "kvdepot_policies": [] if disk_only else list(KVDEPOT_POLICIES),
            "vllm_policies": [] if disk_only else list(VLLM_POLICIES),
        },
        "rows": rows,
    }


def _chunk_bytes() -> int:
    from kvdepot.bench.capacity_runs import _engine_config, chunk_bytes
    from kvdepot.testing.vllm_engine import SyntheticEngine

    probe = SyntheticEngine(_engine_config(socket=None, workers=False, connector=None))
    try:
        return chunk_bytes(probe)
    finally:
        probe.shutdown()


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, per trace and kvdepot policy (RAM only), and the disk's."""
    targets = []
    cfg = result["config"]
    for row in result["rows"]:
        t = row["trace"]
        name = _name(t)
        s = row["systems"]
        ceiling = s["belady"]["hit_rate"]
        for policy in cfg["kvdepot_policies"]:
            best_vllm = max(s[f"vllm-{p}"]["hit_rate"] for p in cfg["vllm_policies"])
            k = s[f"kvdepot-{policy}"]
            targets += [
                _target(name, f"kvdepot {policy} >= best vLLM", k["hit_rate"], best_vllm),
                _target(
                    name,
                    f"kvdepot {policy} >= {BELADY_SHARE} Belady",
                    k["hit_rate"],
                    BELADY_SHARE * ceiling,
                ),
                _target(name, f"kvdepot {policy} unreachable", k["unreachable_max"], 0, most=True),
            ]
        disk = s.get("kvdepot-lru+disk")
        if disk is not None and "kvdepot-lru" in s:
            targets.append(
                _target(
                    name, "RAM+disk >= RAM only", disk["hit_rate"], s["kvdepot-lru"]["hit_rate"]
                )
            )
        if disk is not None:
            targets.append(
                _target(
                    name,
                    "RAM+disk unreachable across the tiers",
                    disk["xtier_unreachable_max"],
                    0,
                    most=True,
                )
            )
    return targets


def _target(
    trace: str, what: str, value: float, bound: float, most: bool = False
) -> dict[str, Any]:
    met = value <= bound if most else value >= bound - 1e-12
    return {"trace": trace, "target": what, "value": value, "bound": bound, "met": met}


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    vllm, kvdepot = cfg["vllm_policies"], cfg["kvdepot_policies"]
    systems = ["belady", *(f"vllm-{p}" for p in vllm), *(f"kvdepot-{p}" for p in kvdepot)]
    if cfg["disk_chunks"]:
        systems.append("kvdepot-lru+disk")
    lines = [
        f"kvdepot bench --capacity: pool {cfg['pool_chunks']} chunks of {cfg['chunk_tokens']} "
        f"tokens ({cfg['chunk_bytes']} B each), {cfg['requests']} requests per trace"
        + (f", disk {cfg['disk_chunks']} chunks" if cfg["disk_chunks"] else ""),
        "",
        "token hit rate, % (leading chunks only); x: kvdepot over the best of vLLM's",
        f"{'trace':<10}{'ws/pool':>8}{'no limit':>9}"
        + "".join(f"{s:>18}" for s in systems)
        + "".join(f"{'x ' + p:>7}" for p in kvdepot),
    ]
    for row in result["rows"]:
        t, s = row["trace"], row["systems"]
        best = max((s[f"vllm-{p}"]["hit_rate"] for p in vllm), default=0.0)
        cells = "".join(f"{100 * s[name]['hit_rate']:>18.1f}" for name in systems)
        ratios = "".join(
            f"{s[f'kvdepot-{p}']['hit_rate'] / best if best else float('nan'):>7.2f}"
            for p in kvdepot
        )
        lines.append(
            f"{_name(t):<10}"
            f"{t['working_set_over_pool']:>8.2f}{100 * row['unbounded_hit_rate']:>9.1f}"
            + cells
            + ratios
        )
    lines += [
        "",
        "bytes stored (MiB); kvdepot: rows held no lookup reaches, the most after any request",
        f"{'trace':<10}" + "".join(f"{s:>18}" for s in systems) + f"{'unreachable':>14}",
    ]
    for row in result["rows"]:
        t, s = row["trace"], row["systems"]
        cells = "".join(f"{s[name]['stored_bytes'] / (1 << 20):>18.2f}" for name in systems)
        unreachable = "/".join(
            str(s[name]["unreachable_max"]) for name in systems if name.startswith("kvdepot")
        )
        lines.append(f"{_name(t):<10}" + cells + f"{unreachable:>14}")
    if cfg["disk_chunks"]:
        lines += [
            "",
            "RAM+disk: hit rate, Belady's at the pool's and the disk's rows together, and rows",
            "no lookup reaches across the tiers (of the pool or the disk; the disk's among",
            "them), the most after any request / after the last",
            f"{'trace':<10}{'hit %':>8}{'Belady %':>10}{'unreachable':>14}{'on disk':>10}",
        ]
        for row in result["rows"]:
            d = row["systems"]["kvdepot-lru+disk"]
            lines.append(
                f"{_name(row['trace']):<10}{100 * d['hit_rate']:>8.1f}"
                f"{100 * row['belady_ram_disk_hit_rate']:>10.1f}"
                f"{d['xtier_unreachable_max']:>8}/{d['xtier_unreachable_end']:<5}"
                f"{d['disk_orphans_max']:>5}/{d['disk_orphans_end']:<4}"
            )
    targets = result.get("targets", [])
    missed = [t for t in targets if not t["met"]]
    lines += ["", f"targets: {len(targets) - len(missed)} met, {len(missed)} missed"]
    for t in missed:
        lines.append(
            f"  missed: {t['trace']}: {t['target']} ({t['value']:.4g} against {t['bound']:.4g})"
        )
    return "\n".join(lines)


def _name(trace: dict[str, Any]) -> str:
    return f"{trace['family']} {trace['ratio']:g}x"


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4,8, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    """`kvdepot bench --capacity`: the run, its table (stderr with --json) and JSON."""
    from kvdepot.bench.capacity_traces import FAMILIES
    from kvdepot.bench.cli import machine_info
    from kvdepot.bench.output import report_stop
    from kvdepot.bench.progress import Progress

    preset = QUICK if args.quick else FULL
    pool = args.capacity_pool or preset["pool"]
    requests = args.capacity_requests or preset["requests"]
    try:
        ratios = _floats(args.capacity_ratios) if args.capacity_ratios else preset["ratios"]
    except argparse.ArgumentTypeError as exc:
        print(f"kvdepot bench: --capacity-ratios: {exc}", file=sys.stderr)
        return 2
    families = [f.strip() for f in args.capacity_traces.split(",") if f.strip()]
    if not families or any(f not in FAMILIES for f in families) or pool < 4 or requests < 1:
        print(
            f"kvdepot bench: --capacity-traces takes {', '.join(FAMILIES)}; "
            "--capacity-pool at least 4 chunks; --capacity-requests at least 1",
            file=sys.stderr,
        )
        return 2
    started, load_before = time.monotonic(), os.getloadavg()[0]
    runs = len(families) * len(ratios)
    disk_only = args.capacity_disk_only
    if disk_only and args.capacity_no_disk:
        print("kvdepot bench: --capacity-disk-only with --capacity-no-disk", file=sys.stderr)
        return 2
    per_run = 0 if disk_only else len(VLLM_POLICIES) + len(KVDEPOT_POLICIES)
    progress = Progress(
        runs * (per_run + (0 if args.capacity_no_disk else 1)), enabled=not args.quiet
    )

    def on_step(label: str) -> None:
        progress.step(label)

    try:
        result = run_capacity(
            pool,
            requests,
            ratios,
            families,
            disk=not args.capacity_no_disk,
            on_step=on_step,
            disk_only=disk_only,
        )
    except (KeyboardInterrupt, Exception) as exc:
        return report_stop("kvdepot bench --capacity", exc, progress)
    progress.close()
    result["command"] = " ".join(["kvdepot", "bench", *_argv_tail()])
    result["machine"] = machine_info()
    result["elapsed_s"] = time.monotonic() - started
    result["loadavg_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
    result["targets"] = check_targets(result)
    table = format_table(result)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print(table)
    if args.strict and not all(t["met"] for t in result["targets"]):
        return 1
    return 0


def _argv_tail() -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index("bench") + 1 :] if "bench" in argv else argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvdepot.bench.capacity")
    parser.add_argument("--capacity", action="store_true", help="(implied)")
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--strict", action="store_true")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
