"""`kvdepot bench`: measured throughput and latency, next to the in-process limit.

    kvdepot bench                        # full run on a daemon it starts (~1 min)
    kvdepot bench --quick --json         # smoke run, JSON on stdout (the test uses it)
    kvdepot bench --socket /run/kvdepot/kvdepot.sock --plot bench.png
    kvdepot bench --node                 # only the node series: ranks over 1..N daemons
    kvdepot bench --capacity             # only the capacity replay: hit rates at a full pool

What runs, in order: a daemon (or the one at --socket) with its pool pre-faulted;
synthetic engine processes (benchmarks/worker.py) with pre-faulted memfd KV
memory; a content check; store/load series for jobs of each size on one engine;
the same with 1, 2, 4 engines side by side; the control plane (lookups, pins);
the vLLM connector's and the GPU path's own benches where they apply. Then the
table (stderr when --json), the JSON, the plot. See benchmarks/README.md.

Its own program (`main`; also `python -m kvdepot.bench`): the daemon's `kvdepot`
command hands `kvdepot bench ...` here by module name and never imports this package.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import secrets
import shutil
import sys
import time
from typing import Any

import kvdepot
from kvdepot.bench import optional
from kvdepot.bench.control import measure_control
from kvdepot.bench.daemon import DaemonUnderTest, OwnDaemon, target_of
from kvdepot.bench.fleet import Fleet
from kvdepot.bench.geometry import BenchGeometry
from kvdepot.bench.output import emit, report_stop
from kvdepot.bench.progress import Progress
from kvdepot.bench.report import check_targets, format_table, plot
from kvdepot.bench.throughput import ThroughputBench, ThroughputPlan
from kvdepot.server.memory.copy_engine import copier

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# --quick: the same sections on a smaller model and fewer repetitions (a smoke
# run in seconds, not figures to publish).
QUICK = {
    "ceiling_jobs": 60,
    "ceiling_pool": "256MiB",
    "echo_msgs": 300,
    "layers": 8,
    "reps": 3,
    "warmup": 1,
    "rep_mib": 24,
    "min_jobs": 3,
    "pool_size": "256MiB",
    "arena_mib": 48,
    "load_set_mib": 48,
    "lookups": 200_000,
    "pins": 50,
    "floor_jobs": 100,
}
FULL = {
    "ceiling_jobs": 400,
    "ceiling_pool": "4GiB",
    "echo_msgs": 2000,
    "layers": 32,
    "reps": 5,
    "warmup": 2,
    "rep_mib": 256,
    "min_jobs": 4,
    "pool_size": "1GiB",
    "arena_mib": 256,
    "load_set_mib": 256,
    "lookups": 2_000_000,
    "pins": 300,
    "floor_jobs": 500,
}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,16,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """`kvdepot bench [flags]` (server/cli.py hands its arguments here)."""
    # One-line errors with exit status 2, as the daemon's own subcommands give them.
    from kvdepot.server.config import SettingsParser

    parser = SettingsParser(
        prog="kvdepot bench",
        description="Measure throughput and latency next to the in-process limit.",
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvdepot bench`."""
    g = parser.add_argument_group("daemon")
    g.add_argument(
        "--socket",
        help="measure the daemon already running on this socket (default: start a private one)",
    )
    g.add_argument(
        "--admin-socket",
        help="that daemon's operator socket, read for its figures (default: the --socket "
        "path + .admin; the bench needs access to it, as `kvdepot status` does)",
    )
    g.add_argument(
        "--pool-size", help="pool of the daemon the bench starts (default 1GiB; --quick 256MiB)"
    )
    g.add_argument(
        "--copy-threads",
        type=int,
        help="--copy-threads of the daemon the bench starts (default: its default)",
    )
    g = parser.add_argument_group("model geometry (default: Llama-3-8B-like)")
    g.add_argument("--layers", type=int, help="layers (default 32; --quick 8)")
    g.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    g.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    g.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="KV cache dtype (default bf16)"
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    g.add_argument(
        "--blocks-per-chunk", type=int, default=1, help="GPU blocks per offloaded chunk (default 1)"
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per engine, one process each (default 1)",
    )
    g.add_argument(
        "--hybrid",
        action="store_true",
        help="two KV-cache groups: half the layers with half-size pages",
    )
    g = parser.add_argument_group("what to measure")
    g.add_argument(
        "--sizes",
        type=_ints,
        default=[1, 16, 64],
        help="job sizes in chunks, one engine (default 1,16,64)",
    )
    g.add_argument(
        "--engines",
        type=_ints,
        default=[1, 2, 4],
        help="engine counts for the aggregate series (default 1,2,4)",
    )
    g.add_argument(
        "--agg-chunks", type=int, default=16, help="job size of the aggregate series (default 16)"
    )
    g.add_argument("--reps", type=int, help="repetitions per figure (default 5; --quick 3)")
    g.add_argument("--warmup", type=int, help="untimed jobs before each run (default 2)")
    g.add_argument(
        "--rep-mib", type=int, help="MiB each rank moves per repetition (default 256; --quick 24)"
    )
    g.add_argument(
        "--depth",
        type=int,
        default=1,
        help="jobs in flight per engine rank (default 1: one at a time)",
    )
    g.add_argument(
        "--num-blocks",
        type=int,
        default=0,
        help="KV blocks per rank (default: four times the largest job)",
    )
    g.add_argument("--no-aggregate", action="store_true", help="skip the engines series")
    g.add_argument(
        "--no-ceiling",
        action="store_true",
        help="skip the control-plane ceiling (copies off; needs its own daemon)",
    )
    g.add_argument("--no-connector", action="store_true", help="skip the vLLM connector's bench")
    g.add_argument("--no-gpu", action="store_true", help="skip the GPU path's bench")
    g.add_argument(
        "--remote",
        metavar="URL",
        help="measure only the remote tier at this redis:// URL against bare "
        "redis-py, and the miss-to-loaded-block time (kvdepot.bench.remote_bench)",
    )
    g = parser.add_argument_group("node series (kvdepot.bench.node; runs alone)")
    g.add_argument(
        "--node",
        action="store_true",
        help="run only the node series: engines x TP ranks over 1..N daemon shards, copies "
        "off, TP=8 70B-like and TP=1 8B-like (--pool-size: the node's pool, split)",
    )
    g.add_argument("--node-engines", type=int, help="engines (default: CPUs / 2, between 2 and 8)")
    g.add_argument(
        "--node-shards",
        type=_ints,
        help="daemon processes, e.g. 1,2,4 (default: 1, 2, 4 ... up to CPUs / 2, at least 2)",
    )
    g.add_argument(
        "--node-geometry",
        default="70b-tp8,8b-tp1",
        help="geometries to run, of 70b-tp8, 8b-tp1, deepseek-v3-tp8 (MLA: 61 layers, one "
        "latent of 576 bf16 values a token, one section a row) and deepseek-v3-tp8-sections "
        "(the same, a section per rank) (default: 70b-tp8,8b-tp1)",
    )
    g.add_argument(
        "--node-tp",
        type=_ints,
        help="run each geometry at these TP sizes, e.g. 1,2,4,8 (default: each its own)",
    )
    g.add_argument("--node-chunks", type=int, default=16, help="chunks per job (default 16)")
    g = parser.add_argument_group("capacity (kvdepot.bench.capacity; runs alone)")
    g.add_argument(
        "--capacity",
        action="store_true",
        help="run only the capacity replay: token hit rates of chat, shared-document and "
        "agent traces through kvdepot (a real daemon per policy, with and without --disk), "
        "vLLM's CPU tier (lru, arc) and Belady's optimum, pools of the same chunks",
    )
    from kvdepot.bench.capacity import add_arguments as add_capacity_arguments

    add_capacity_arguments(g)
    g = parser.add_argument_group("output")
    g.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 8 layers, 3 repetitions, small pool (seconds)",
    )
    g.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    g.add_argument("--plot", metavar="FILE.png", help="write a PNG of the figures (matplotlib)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    # `kvdepot bench serve`: real vLLM servers end to end (kvdepot.bench.serve). Its flags
    # are its own; its module imports only the standard library until it runs.
    from kvdepot.bench.serve import add_arguments as add_serve_arguments

    sub = parser.add_subparsers(dest="bench_command", metavar="serve")
    add_serve_arguments(
        sub.add_parser(
            "serve",
            help="TTFT, throughput and hit rates of real vLLM servers with and without kvdepot",
        )
    )


def _copy_times(s: Any) -> tuple[int, float]:
    """The daemon's copies started and seconds they waited for a copy thread, the CPU
    threads' and every GPU's together (0 from a daemon older than the copy-time fields)."""
    return (
        getattr(s, "copies_started", 0) + sum(getattr(s, "gpu_copies_started", ())),
        getattr(s, "copy_wait_seconds", 0.0) + sum(getattr(s, "gpu_copy_wait_seconds", ())),
    )


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return value if value is not None else (QUICK if args.quick else FULL)[name]


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    mem = 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) / (1 << 20)
    except OSError:
        pass
    accelerator = "NVIDIA GPU present" if shutil.which("nvidia-smi") else "no GPU"
    return {
        "cpus": os.cpu_count() or 1,
        "cpu_model": model,
        "memory_gib": mem,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "accelerator": accelerator,
    }


def _parse_size(text: str) -> int:
    from kvdepot.server.config import parse_size

    return parse_size(text)


def run_bench(args: argparse.Namespace) -> int:
    """Runs every section, prints the table (and JSON, plot); returns the exit code."""
    import json

    if getattr(args, "bench_command", None) == "serve":
        from kvdepot.bench.serve import run as run_serve

        return run_serve(args)
    if args.remote:  # its own figures and table (kvdepot.bench.remote_bench)
        from kvdepot.bench.remote_bench import format_table as remote_table
        from kvdepot.bench.remote_bench import run_remote_bench

        remote = run_remote_bench(args.remote, args.quick)
        print(remote_table(remote), file=sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(remote, indent=1))
        return 1 if args.strict and not all(t["met"] for t in remote["targets"]) else 0
    if args.node:
        return _node(args)
    if args.capacity:  # its own figures and table (kvdepot.bench.capacity)
        from kvdepot.bench.capacity import run as run_capacity

        return run_capacity(args)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        geo = BenchGeometry(
            layers=_pick(args, "layers"),
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype_bytes=DTYPE_BYTES[args.dtype],
            block_size=args.block_size,
            blocks_per_chunk=args.blocks_per_chunk,
            tp=args.tp,
            hybrid=args.hybrid,
        )
    except ValueError as exc:
        print(f"kvdepot bench: {exc}", file=sys.stderr)
        return 2
    engines = [] if args.no_aggregate else sorted(set(args.engines))
    plan = ThroughputPlan(
        geo=geo,
        sizes=sorted(set(args.sizes)),
        engines=engines,
        agg_chunks=args.agg_chunks,
        reps=max(1, _pick(args, "reps")),
        warmup=max(0, _pick(args, "warmup")),
        rep_bytes=_pick(args, "rep_mib") << 20,
        min_jobs=_pick(args, "min_jobs"),
        depth=max(1, args.depth),
        num_blocks=args.num_blocks,
        arena_bytes=_pick(args, "arena_mib") << 20,
        load_set_bytes=_pick(args, "load_set_mib") << 20,
    )
    progress = Progress(plan.steps() + 4, enabled=not args.quiet)
    daemon: DaemonUnderTest | None = None
    fleet: Fleet | None = None
    result: dict[str, Any] = {}
    try:
        pool_size = _pick(args, "pool_size")
        if args.socket:
            admin = target_of(args.admin_socket) if args.admin_socket else None
            daemon = DaemonUnderTest(target_of(args.socket), admin)
            daemon_text = f"running daemon at {args.socket}"
        else:
            progress.label("starting kvdepot serve")
            daemon = OwnDaemon(pool_size, args.copy_threads)
            daemon_text = f"own `kvdepot serve --pool-size {pool_size}" + (
                f" --copy-threads {args.copy_threads}`" if args.copy_threads else "` (defaults)"
            )
        stats = daemon.wait_warm(
            on_progress=lambda done, total: progress.label(
                f"daemon pool warm-up {100 * done // max(total, 1)}%"
            )
        )
        progress.step("daemon pool warm")
        namespace = f"kvdepot-bench-{secrets.token_hex(6)}"
        salt = secrets.token_bytes(16)
        n_engines = max([1, *engines])
        fleet = Fleet(n_engines, geo.tp)
        progress.label(f"starting {len(fleet.workers)} engine process(es), pre-faulting memory")
        fleet.setup(daemon.target, vars(geo), plan.num_blocks, salt, namespace, plan.arena_bytes)
        progress.label("the daemon maps the engines' memory")
        daemon.wait_mapped()
        progress.step("engines registered")
        bench = ThroughputBench(
            plan, fleet, stats.capacity_bytes, progress, lambda: _copy_times(daemon.stats())
        )
        verified = bench.verify()
        floor = bench.floor(_pick(args, "floor_jobs"))
        progress.label("the machine's limits: memmove bandwidth, bare gRPC echo")
        limits = _limits(args, plan, floor)
        rows, lat_rows = bench.per_size()
        agg_rows = bench.aggregate()
        fleet.close()
        fleet = None
        progress.label("control-plane ceiling (copies off)")
        ceiling = _ceiling(args, geo, plan, namespace, salt)
        progress.label("control plane: lookups and pins")
        try:
            control = measure_control(
                daemon.target,
                namespace,
                salt,
                _pick(args, "lookups"),
                _pick(args, "pins"),
                pin_keys=max(plan.sizes[0], 16),
            )
        except Exception as exc:  # reported, not fatal: the data-path figures stand
            control = {"error": f"{type(exc).__name__}: {exc}"}
        progress.step("control plane measured")
        progress.label("vLLM connector bench")
        connector = (
            {"skipped": "--no-connector"}
            if args.no_connector
            # Its own table goes to stderr beside ours (nowhere with --quiet).
            else (
                optional.connector_section(
                    daemon.target, args.quick, io.StringIO() if args.quiet else sys.stderr
                )
            )
        )
        progress.step("connector bench done")
        progress.label("GPU path bench")
        # The GPU bench sizes its own pool (GiB of pinned memory): it starts its own
        # daemon unless the user pointed the bench at one.
        gpu = (
            {"skipped": "--no-gpu"}
            if args.no_gpu
            else optional.gpu_section(
                args.quick,
                plan.sizes,
                plan.reps,
                target=daemon.target if args.socket else None,
            )
        )
        progress.step("GPU bench done")
        result = {
            "version": kvdepot.__version__,
            "command": " ".join(["kvdepot", "bench", *_argv_tail()]),
            "machine": machine_info(),
            "config": {
                "geometry": geo.as_dict(),
                "geometry_text": geo.describe(),
                "daemon": daemon_text,
                # This install's CPU copier: the in-process side's, and an own daemon's.
                "copier": copier(),
                "pool_bytes": stats.capacity_bytes,
                "sizes": plan.sizes,
                "engines": plan.engines,
                "agg_chunks": plan.agg_chunks,
                "reps": plan.reps,
                "warmup_jobs": plan.warmup,
                "rep_bytes": plan.rep_bytes,
                "depth": plan.depth,
                "num_blocks": plan.num_blocks,
                "arena_bytes": plan.arena_bytes,
                "quick": args.quick,
            },
            "verified": verified,
            "throughput": rows,
            "latency": lat_rows,
            "latency_floor": floor,
            "aggregate": agg_rows,
            "machine_limits": limits,
            "control_ceiling": ceiling.get("rows", []),
            "control_ceiling_info": {k: v for k, v in ceiling.items() if k != "rows"},
            "control": control,
            "connector": connector,
            "gpu": gpu,
            "notes": bench.notes,
        }
    except (KeyboardInterrupt, Exception) as exc:
        return report_stop("kvdepot bench", exc, progress)
    finally:
        if fleet is not None:
            fleet.close()
        if daemon is not None:
            daemon.stop()
    progress.close()
    result["elapsed_s"] = time.monotonic() - started
    # Other processes on the machine skew every figure; say how busy it was.
    result["machine"]["loadavg_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
    cpus = result["machine"]["cpus"]
    if load_before > cpus / 2:
        result["notes"].append(
            f"the machine was busy before the bench began (load average {load_before:.1f} on "
            f"{cpus} CPUs): other processes took CPU time from both paths, most of all from "
            f"the in-process aggregate (it needs every core): aggregate ratios may read higher "
            f"than on a quiet machine"
        )
    result["targets"] = check_targets(result)
    shown = emit(
        result,
        format_table(result),
        as_json=args.json,
        plot_path=args.plot,
        plot=plot,
        command="kvdepot bench",
    )
    if not shown:
        return 1
    if args.strict and not all(t["met"] for t in result["targets"]):
        return 1
    return 0


def _limits(
    args: argparse.Namespace, plan: ThroughputPlan, floor: dict[str, Any]
) -> dict[str, Any]:
    """Copy bandwidth and the gRPC echo (kvdepot.bench.baselines), measured now."""
    from kvdepot.bench.baselines import echo_floor, memmove_bandwidth

    out: dict[str, Any] = {}
    try:
        out["memmove"] = memmove_bandwidth(max(plan.geo.job_bytes(max(plan.sizes)), 64 << 20))
    except Exception as exc:
        out["memmove"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        echo = out["grpc_echo"] = echo_floor(_pick(args, "echo_msgs"))
        out["empty_job_over_echo"] = floor["rtt_ms"]["p50"] / echo["rtt_ms"]["p50"]
    except Exception as exc:
        out["grpc_echo"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _ceiling(
    args: argparse.Namespace,
    geo: BenchGeometry,
    plan: ThroughputPlan,
    namespace: str,
    salt: bytes,
) -> dict[str, Any]:
    """The control-plane ceiling on a daemon of its own (kvdepot.bench.ceiling)."""
    if args.no_ceiling:
        return {"skipped": "--no-ceiling"}
    if args.socket:
        return {"skipped": "needs a daemon the bench starts (copies off): not with --socket"}
    from kvdepot.bench.ceiling import measure_ceiling

    pool = _pick(args, "ceiling_pool")
    try:
        return measure_ceiling(
            geo,
            plan.sizes,
            plan.num_blocks,
            pool,
            _parse_size(pool),
            _pick(args, "ceiling_jobs"),
            max(plan.warmup, 3),
            namespace + "-ceiling",
            salt,
        )
    except Exception as exc:  # reported, not fatal: the data-path figures stand
        return {"error": f"{type(exc).__name__}: {exc}"}


def _node(args: argparse.Namespace) -> int:
    """`kvdepot bench --node`: the node series alone, its table and JSON."""
    from kvdepot.bench import node

    cores = os.cpu_count() or 1
    names = [n.strip() for n in args.node_geometry.split(",") if n.strip()]
    unknown = [n for n in names if n not in node.GEOMETRIES]
    engines = args.node_engines or node.default_engines(cores)
    if unknown or not names or engines < 1 or args.node_chunks < 1:
        print(
            f"kvdepot bench: --node-geometry takes {', '.join(node.GEOMETRIES)}; "
            f"--node-engines and --node-chunks at least 1",
            file=sys.stderr,
        )
        return 2
    tps = sorted(set(args.node_tp)) if args.node_tp else None
    try:
        for name in names:
            for tp in tps or [None]:
                node.preset(name, args.quick, tp)
    except ValueError as exc:
        print(f"kvdepot bench: --node-tp: {name}: {exc}", file=sys.stderr)
        return 2
    if args.socket or args.plot:
        print(
            "kvdepot bench: --node starts its own daemons and draws no plot (not with "
            "--socket or --plot)",
            file=sys.stderr,
        )
        return 2
    started, load_before = time.monotonic(), os.getloadavg()[0]
    progress = Progress(1, enabled=not args.quiet)
    pool = args.pool_size or _pick(args, "ceiling_pool")
    try:
        measured = node.measure_node(
            names,
            engines,
            sorted(set(args.node_shards or node.default_shards(cores))),
            args.node_chunks,
            16 * _pick(args, "ceiling_jobs"),  # the ceiling's 2 x 8 ranks' worth
            max(_pick(args, "warmup"), 3),
            _parse_size(pool),
            f"kvdepot-bench-node-{secrets.token_hex(6)}",
            secrets.token_bytes(16),
            quick=args.quick,
            on_step=progress.label,
            tps=tps,
        )
    except (KeyboardInterrupt, Exception) as exc:
        return report_stop("kvdepot bench", exc, progress)
    progress.close()
    result = {
        "version": kvdepot.__version__,
        "command": " ".join(["kvdepot", "bench", *_argv_tail()]),
        "machine": machine_info(),
        "node": measured,
        "node_ceiling": measured["rows"],
        "elapsed_s": time.monotonic() - started,
        "loadavg_1min": {"start": load_before, "end": os.getloadavg()[0]},
    }
    emit(
        result,
        node.format_node_table(result),
        as_json=args.json,
        plot_path=None,  # no plot of this series
        plot=plot,
        command="kvdepot bench --node",
    )
    return 0


def _argv_tail() -> list[str]:
    """The flags this run was given (for the report's `command`)."""
    argv = sys.argv[1:]
    return argv[argv.index("bench") + 1 :] if "bench" in argv else argv
