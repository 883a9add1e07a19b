"""The node series (`kvdepot bench --node`): how the node's control-plane ceiling grows
with daemon processes on this host.

For each geometry (a TP=8 70B-like one: 80 layers, one KV head per rank, 8 KiB pages;
a TP=1 8B-like one: 32 layers, 64 KiB pages; a TP=8 DeepSeek-V3-like MLA one: 61 layers,
one latent of 576 bf16 values a token, 18 KiB pages, the same on every rank), at its own
TP or each of `tps`, and each shard count S, the series starts S
independent daemons (`kvdepot serve`, each with its own socket and a pool of
pool/S, copies off as in kvdepot.bench.ceiling) and `engines` x TP engine-rank processes,
the ranks dealt to the shards as the connector deals them (kvdepot.common.shards: rank r
of an engine to its shard r // (TP / gcd(S, TP)), counted from the first shard its
namespace picks; each engine is a namespace of its own, as distinct models), then drives
rank jobs of `chunks` chunks, 4 in flight per rank, both directions, with the ceiling
bench's own driver (ceiling.timed_run). It measures the "shards by rank" design
(`kvdepot serve --shards`) at the level of rank jobs; the scheduler's side (one Watch
stream and one pin per shard) is not in it.

A shard sees only some ranks of an engine: it gets each engine as a world of those ranks
(renumbered 0..k-1, `kv_heads` scaled so the per-rank page is unchanged) in a namespace of
that engine's own, as the connector declares it. Replicated MLA ranks register as the
connector registers them: each is rank 0 of a world of one, so all of an engine's ranks go
to one shard and a row is one section, copied by the first rank that stores it. A rank's
job is then the same job as on one daemon; what one shard does not do is wait for the
ranks another serves. Where a world has more than one rank, jobs run in rounds of
ROUND_JOBS per rank started together (see _one_node); rates are summed over the rounds'
windows.

Runs on the bench's main thread; owns its daemons and worker processes and stops them
before it returns (or raises).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kvdepot.bench.ceiling import DEPTH, KeyCursor, TimedRun, null_copy_daemon, timed_run
from kvdepot.bench.daemon import OwnDaemon
from kvdepot.bench.fleet import Fleet, WorkerProc
from kvdepot.bench.geometry import BenchGeometry
from kvdepot.bench.stats import GB, percentile
from kvdepot.common.shards import first_shard, route_rank

# Presets: (description, geometry). Heads per rank and page size are what a rank's job
# costs by; --quick keeps them and cuts layers (and TP to 2) to run in seconds.
# DeepSeek-V3's MLA: 61 layers, one latent of 512 + 64 = 576 bf16 values a token, the
# same on every rank: replicated (one section a row, as the connector registers it when
# vLLM says so), or, for comparison, a section per rank (as kvdepot stored MLA before).
_MLA = BenchGeometry(layers=61, kv_heads=1, head_dim=576, tp=8, latent=True)
GEOMETRIES = {
    "70b-tp8": ("Llama-3-70B-like, TP=8", BenchGeometry(layers=80, kv_heads=8, tp=8)),
    "8b-tp1": ("Llama-3-8B-like, TP=1", BenchGeometry(layers=32, kv_heads=8, tp=1)),
    "deepseek-v3-tp8": ("DeepSeek-V3-like MLA, TP=8", replace(_MLA, replicated=True)),
    "deepseek-v3-tp8-sections": ("DeepSeek-V3-like MLA, TP=8, a section per rank", _MLA),
}
QUICK_LAYERS = 8
QUICK_MAX_TP = 2
ROUND_JOBS = 50  # jobs per rank between two synchronized starts


def _split(jobs: int, size: int) -> list[int]:
    """`jobs` as rounds of at most `size`: 250, 100 -> [100, 100, 50]."""
    return [min(size, jobs - i) for i in range(0, jobs, size)]


class Series:
    """Rounds of one direction, merged: rates over the rounds' windows, CPU summed."""

    def __init__(self, rounds: list[TimedRun], pool_rows: int, pool_bytes: int) -> None:
        rates = [r.rate() for r in rounds]
        self.window_s = sum(w for _, w in rates)
        self.bytes_per_s = sum(b * w for b, w in rates) / self.window_s if self.window_s else 0.0
        jobs = [r.job_rate() for r in rounds]  # the same windows as `rates`
        self.jobs_per_s = sum(j * w for j, w in jobs) / self.window_s if self.window_s else 0.0
        self.copied_bytes = sum(r.copied_bytes for r in rounds)
        self.daemon_cpu_s = sum(r.daemon_cpu_s for r in rounds)
        self.loop_cpu_s = sum(r.loop_cpu_s for r in rounds)
        self.copies = sum(r.copies for r in rounds)
        self.copy_wait_s = sum(r.copy_wait_s for r in rounds)
        self.engine_cpu_s = sum(r.engine_cpu_s for r in rounds)
        self.submitted = sum(r.submitted for r in rounds)
        self.dropped = sum(r.dropped for r in rounds)
        self.timed_jobs = sum(len(w["jobs"]) for r in rounds for w in r.replies)
        self.overhead_ms = [x for r in rounds for x in r.overhead_ms()]
        # Each round from its first timed submit to its last answer (no start barriers).
        self.span_s = sum(_span(r) for r in rounds)
        # The pool after the series: rows READY and the bytes the pool holds.
        self.pool_rows = pool_rows
        self.pool_bytes = pool_bytes

    def rate(self) -> tuple[float, float]:
        return self.bytes_per_s, self.window_s


def _span(run: TimedRun) -> float:
    jobs = [j for r in run.replies for j in r["jobs"]]
    return max(j[1] for j in jobs) - min(j[0] for j in jobs) if jobs else 0.0


def default_engines(cores: int) -> int:
    """Engines of the series: 2 here, up to 8 (a node of eight GPUs) on a large host."""
    return min(8, max(2, cores // 2))


def default_shards(cores: int) -> list[int]:
    """1, 2, 4, ... up to half the cores (at least 2): 1..8 on a 16-core host."""
    top, out = max(2, cores // 2), [1]
    while out[-1] * 2 <= top:
        out.append(out[-1] * 2)
    return out


def preset(name: str, quick: bool, tp: int | None = None) -> BenchGeometry:
    """Geometry `name`; at `tp` ranks if given (the model's KV heads split over them,
    every rank's whole latent for MLA), else at its own TP, cut to QUICK_MAX_TP by
    `quick` with the same heads per rank."""
    geo = GEOMETRIES[name][1]
    if tp is not None:
        geo = replace(geo, tp=tp)
    elif quick and geo.tp > QUICK_MAX_TP:
        heads = geo.kv_heads if geo.latent else geo.kv_heads // geo.tp * QUICK_MAX_TP
        geo = replace(geo, kv_heads=heads, tp=QUICK_MAX_TP)
    return replace(geo, layers=min(geo.layers, QUICK_LAYERS)) if quick else geo


def shard_views(
    geo: BenchGeometry, engines: int, shards: int, namespace: str = "node"
) -> dict[tuple[int, int], tuple[int, BenchGeometry, int]]:
    """(engine, rank) -> (shard, the rank's geometry on it, its rank there), routed as
    the connector routes (kvdepot.common.shards: engine e, in namespace
    `engine_namespace(namespace, e)`, from its `first_shard`); on its shard an engine is
    a world of the ranks it sent there."""
    out: dict[tuple[int, int], tuple[int, BenchGeometry, int]] = {}
    world = geo.registered_world  # replicated ranks: each is rank 0 of a world of 1
    for e in range(engines):
        first = first_shard(engine_namespace(namespace, e), shards, world)
        for r in range(geo.tp):
            route = route_rank(r % world, world, shards, first)
            if geo.replicated:
                view = geo  # the whole latent, one section a row: as registered
            else:
                heads = geo.kv_heads if geo.latent else geo.kv_heads // geo.tp * route.world_size
                view = replace(geo, kv_heads=heads, tp=route.world_size)
            out[(e, r)] = (route.shard, view, route.rank)
    return out


def engine_namespace(namespace: str, engine: int) -> str:
    """The namespace of the series' engine `engine`: each its own, as distinct models'."""
    return f"{namespace}-e{engine}"


def measure_node(
    geometries: Sequence[str],
    engines: int,
    shard_counts: Sequence[int],
    chunks: int,
    rank_jobs: int,
    warmup: int,
    pool_bytes: int,
    namespace: str,
    salt: bytes,
    quick: bool = False,
    on_step: Callable[[str], None] | None = None,
    tps: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every (geometry, TP, shards, direction) row; `pool_bytes` is the node's, split
    evenly; `tps`: the TP sizes to run each geometry at (default: each its own).
    Each series times about `rank_jobs` rank jobs over the node (split over its ranks,
    so that a TP=1 series runs as long as a TP=8 one)."""
    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    described: dict[str, str] = {}
    for name in geometries:
        for tp in tps or [None]:
            geo = preset(name, quick, tp)
            label = name if tp is None else f"{name} at TP={tp}"
            described[label] = f"{GEOMETRIES[name][0]}: {geo.describe()}"
            for shards in shard_counts:
                if shards > engines * geo.tp:
                    skipped.append(f"{label}: {shards} shards > {engines * geo.tp} ranks")
                    continue
                if on_step is not None:
                    on_step(f"node series: {name}, {engines} x TP={geo.tp}, {shards} shard(s)")
                series_ns = f"{namespace}-{name}-tp{geo.tp}-s{shards}"
                views = shard_views(geo, engines, shards, series_ns)
                try:
                    runs = _one_node(
                        geo,
                        views,
                        engines,
                        shards,
                        chunks,
                        max(1, rank_jobs // (engines * geo.tp)),
                        warmup,
                        pool_bytes,
                        series_ns,
                        salt,
                    )
                except _PoolTooSmall as exc:
                    skipped.append(f"{label}, {shards} shard(s): {exc}")
                    continue
                used = len({shard for shard, _, _ in views.values()})
                for direction, run in runs:
                    row = _row(name, geo, engines, shards, cores, chunks, direction, run)
                    rows.append({**row, "shards_used": used})
    base = {(r["geometry"], r["tp"], r["direction"]): r for r in rows if r["shards"] == 1}
    for r in rows:
        one = base.get((r["geometry"], r["tp"], r["direction"]))
        r["vs_one_shard"] = r["rank_jobs_per_s"] / one["rank_jobs_per_s"] if one else None
    return {
        "rows": rows,
        "skipped": skipped,
        "engines": engines,
        "depth": DEPTH,
        "chunks": chunks,
        "cores": cores,
        "pool_bytes": pool_bytes,
        "quick": quick,
        "geometries": described,
        "copy_engine": "NullCopyEngine (CUDA descriptors planned, no bytes moved)",
    }


class _PoolTooSmall(ValueError):
    pass


def _one_node(
    geo: BenchGeometry,
    views: dict[tuple[int, int], tuple[int, BenchGeometry, int]],
    engines: int,
    shards: int,
    chunks: int,
    jobs: int,
    warmup: int,
    pool_bytes: int,
    namespace: str,
    salt: bytes,
) -> list[tuple[str, Series]]:
    """`shards` daemons and one fleet, the ranks dealt as `views` (shard_views of
    `namespace`) says; a store series then a load series."""
    rank_job = chunks * geo.chunk_bytes_per_rank()
    # In-flight slots and a load set must fit a shard's pool four times over (as in
    # the ceiling bench): the busiest shard decides, by the sections it holds a row
    # (replicated ranks share one).
    busiest = max(
        len({(e, rank) for (e, _), (shard, _, rank) in views.items() if shard == s})
        for s in range(shards)
    )
    sets = min(16, pool_bytes // shards // 4 // (busiest * rank_job))
    if sets < DEPTH:
        raise _PoolTooSmall(
            f"a pool of {pool_bytes >> 20} MiB holds {sets} load sets per shard, "
            f"{DEPTH} needed (--pool-size)"
        )
    num_blocks = 4 * chunks * geo.blocks_per_chunk
    daemons: list[OwnDaemon] = []
    fleet: Fleet | None = None
    try:
        for _ in range(shards):
            daemons.append(null_copy_daemon(f"{max(1, pool_bytes // shards >> 20)}MiB"))
        for d in daemons:
            d.wait_warm()
        fleet = Fleet(engines, geo.tp)

        def setup(w: WorkerProc) -> dict[str, Any]:
            shard, view, rank = views[(w.engine, w.rank)]
            return {
                "cmd": "setup",
                "target": daemons[shard].target,
                "geometry": vars(view),
                "rank": rank,
                "engine": w.engine,
                "num_blocks": num_blocks,
                "salt": salt.hex(),
                "namespace": engine_namespace(namespace, w.engine),  # its world per shard
                "arena_bytes": 1 << 20,
            }

        fleet.call(fleet.workers, setup)
        for d in daemons:
            d.wait_mapped()
        keys = KeyCursor()
        out = []
        for direction in ("store", "load"):
            # Rounds of ROUND_JOBS, each started together: the bench's ranks are not
            # held in step as a model's are (a step is every rank's job), and over a
            # long series on few cores some run dozens of jobs ahead. Their rows wait,
            # reserved, for the slow ranks, and the pool fills with them. On a host
            # busy with other work a rank can still stall for a round: the keys its
            # mates then find no room for are dropped, counted, and said (a load
            # whose key was dropped still fails the series).
            # A world of one rank has no mates to wait for: one round (replicated ranks
            # too: a row is READY once the first of them copied it).
            size = ROUND_JOBS if max(v[1].registered_world for v in views.values()) > 1 else jobs
            try:
                rounds = [
                    timed_run(fleet, daemons, keys, direction, chunks, n, warmup, sets, True)
                    for n in _split(jobs, size)
                ]
            except RuntimeError as exc:
                raise RuntimeError(
                    f"node series, {engines} x TP={geo.tp} on {shards} shard(s), {direction}: {exc}"
                ) from exc
            pool = [d.stats() for d in daemons]
            rows, held = sum(p.ready_blocks for p in pool), sum(p.used_bytes for p in pool)
            out.append((direction, Series(rounds, rows, held)))
        return out
    finally:
        if fleet is not None:
            fleet.close()
        for d in daemons:
            d.stop()


def _row(
    name: str,
    geo: BenchGeometry,
    engines: int,
    shards: int,
    cores: int,
    chunks: int,
    direction: str,
    run: Series,
) -> dict[str, Any]:
    rate, window = run.rate()
    rank_job = chunks * geo.chunk_bytes_per_rank()
    daemon_us = 1e6 * run.daemon_cpu_s / run.submitted
    # Chunks the engines stored or loaded (each engine's ranks name the same keys).
    engine_chunks = run.submitted / geo.tp * chunks
    return {
        "geometry": name,
        "engines": engines,
        "tp": geo.tp,
        "shards": shards,
        "cores": cores,
        "direction": direction,
        "chunks": chunks,
        "rank_job_bytes": rank_job,
        "rank_jobs": run.timed_jobs,
        "dropped_keys": run.dropped,  # stores (a load's: of its set) with no room
        # Every rank's job counts, whatever it copied (a replicated store that finds its
        # row copied by another rank copies nothing).
        "rank_jobs_per_s": run.jobs_per_s,
        # The bytes the rank jobs name: a rank's KV in or out, per second.
        "equivalent_gbps": run.jobs_per_s * rank_job / GB,
        # The bytes the daemons copied (planned: copies are off), per second.
        "copied_gbps": rate / GB,
        "window_s": window,
        # Bytes the daemons copied per chunk an engine stored or loaded (GetStats, warm-up
        # included): a row's sections once per store, every rank's section per load.
        "copied_bytes_per_chunk": run.copied_bytes / engine_chunks if engine_chunks else 0.0,
        # The pool after the series: bytes per READY row (one chunk of the one group).
        "pool_bytes_per_row": run.pool_bytes / run.pool_rows if run.pool_rows else 0.0,
        # CPU per rank job, warm-up included, from /proc of every daemon / worker.
        "daemon_cpu_us_per_rank_job": daemon_us,
        "engine_cpu_us_per_rank_job": 1e6 * run.engine_cpu_s / run.submitted,
        # Of the daemons' CPU, their event loops' (each shard's serial part; the rest is
        # the copy threads and the kernel's work for them).
        "loop_cpu_us_per_rank_job": 1e6 * run.loop_cpu_s / run.submitted,
        # From a copy queued to a copy thread starting it (copies off: the hand-off alone,
        # the thread's wait for the GIL while the loop is busy included).
        "copy_wait_ms_mean": 1e3 * run.copy_wait_s / run.copies if run.copies else 0.0,
        # What one daemon core, fully busy at this cost, could feed: the scaling model.
        "one_core_gbps": rank_job / daemon_us * 1e6 / GB if daemon_us > 0 else 0.0,
        # The host's cores the daemons and engines used over the rounds (1.0: all of
        # them; CPU of the warm-up jobs included, /proc's tick-sampled accounting).
        "host_cpu_share": (run.daemon_cpu_s + run.engine_cpu_s) / (run.span_s * cores)
        if run.span_s > 0
        else 0.0,
        "overhead_ms_p50": percentile(run.overhead_ms, 50),
    }


def format_node_table(result: dict[str, Any]) -> str:
    """The node series' table (printed by kvdepot.bench.output.emit)."""
    info = result["node"]
    load = result["loadavg_1min"]
    lines = [
        f"kvdepot bench --node {result['version']} ({result['elapsed_s']:.0f} s): "
        f"control-plane ceiling of the node, copies off, {info['engines']} engines x TP ranks, "
        f"{info['depth']} jobs in flight per rank, {info['chunks']}-chunk jobs",
        f"host: {info['cores']} cores (daemons and engines share them); load average "
        f"{load['start']:.1f} at start, {load['end']:.1f} at end; node pool "
        f"{info['pool_bytes'] >> 20} MiB split over the shards",
        *(f"{n}: {text}" for n, text in info["geometries"].items()),
        "",
    ]
    width = max([8, *(len(r["geometry"]) for r in info["rows"])])
    lines.append(
        f" {'geometry':{width}s}  dir   engxTP shards | rank jobs/s  GB/s-eq  copied  vs 1 |"
        " daemon us  (loop)  engine us  /rank job | 1 core GB/s  host CPU | ovh p50 ms"
        "  copy wait ms | KiB copied/chunk  pool KiB/row"
    )
    for r in info["rows"]:
        vs = f"{r['vs_one_shard']:4.2f}" if r["vs_one_shard"] is not None else "   -"
        lines.append(
            f" {r['geometry']:{width}s}  {r['direction']:5s} {r['engines']:2d}x{r['tp']:<2d}  "
            f"{r['shards']:5d} | {r['rank_jobs_per_s']:11.0f}  {r['equivalent_gbps']:7.1f}  "
            f"{r['copied_gbps']:6.1f}  "
            f"{vs} | {r['daemon_cpu_us_per_rank_job']:9.0f}  "
            f"({r['loop_cpu_us_per_rank_job']:4.0f})  "
            f"{r['engine_cpu_us_per_rank_job']:9.0f}            | "
            f"{r['one_core_gbps']:11.1f}  {r['host_cpu_share']:8.0%} | "
            f"{r['overhead_ms_p50']:10.2f}  {r['copy_wait_ms_mean']:12.2f} | "
            f"{r['copied_bytes_per_chunk'] / 1024:16.0f}  "
            f"{r['pool_bytes_per_row'] / 1024:12.0f}"
        )
    for r in info["rows"]:
        if r["direction"] == "store" and r.get("shards_used", r["shards"]) < r["shards"]:
            lines.append(
                f" note: {r['geometry']} on {r['shards']} shards: the engines' namespaces "
                f"picked {r['shards_used']} of them (kvdepot.common.shards.first_shard)"
            )
    for r in info["rows"]:
        if r["dropped_keys"]:
            lines.append(
                f" note: {r['geometry']} {r['direction']} {r['shards']} shard(s): "
                f"{r['dropped_keys']} key(s) dropped (ranks out of step on a busy host)"
            )
    for s in info["skipped"]:
        lines.append(f" not run: {s}")
    lines.append(
        " (loop): of the daemon's CPU, its event loop's (one thread per shard; the rest is the"
        " copy threads' and the kernel's work for them); 1 core GB/s: what one daemon core,"
        " fully busy at this CPU per rank job, could feed; host CPU: daemons + engines CPU"
        " over the series / all cores; copy wait: from a copy queued to a copy thread"
        " starting it (the hand-off, the thread's wait for the GIL included); GB/s-eq: the"
        " bytes the rank jobs name, copied: the bytes the daemons copied (planned; copies"
        " are off), per second; KiB copied/chunk: per chunk an engine stored or loaded;"
        " pool KiB/row: what the pool holds per stored chunk"
    )
    return "\n".join(lines)
