"""`kvdepot bench`: a real run (daemon + engine processes) produces every section.

Speed is the bench's business, not the tests': these check structure, positive
figures and consistent ratios, never a throughput threshold.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvdepot
from kvdepot.bench import optional, output
from kvdepot.bench.stats import median, overlap_rate, percentile

SIZES = [1, 16, 64]
ENGINES = [1, 2, 4]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One `kvdepot bench --quick --json --plot` for every check below."""
    out = tmp_path_factory.mktemp("bench")
    png = out / "bench.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.server.cli",
            "bench",
            "--quick",
            "--json",
            "--quiet",
            "--no-connector",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout), png


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


def _ratio(x: Any) -> bool:
    # Daemon / in-process: below 0 or far above 1 means one side did not measure what it
    # says (a copy that moved nothing reads 100x or more; a clock read in the wrong place).
    # Not 2: on a busy machine one repetition of the in-process side can lose its core
    # (a 7x repetition was seen at load 9 on 2 CPUs).
    return isinstance(x, float) and 0 < x < 20


def _sane_gbps(x: Any) -> bool:
    return _positive(x) and x < 1000  # no host copies a terabyte per second


def _percentiles(p: dict[str, float]) -> bool:
    return 0 <= p["p50"] <= p["p99"] < 60_000  # milliseconds; nothing takes a minute


def test_every_section_is_there(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    for key in (
        "version",
        "command",
        "machine",
        "config",
        "verified",
        "throughput",
        "latency",
        "latency_floor",
        "aggregate",
        "control",
        "connector",
        "gpu",
        "targets",
        "elapsed_s",
        "machine_limits",
        "control_ceiling",
        "control_ceiling_info",
    ):
        assert key in result, key
    assert result["version"] == kvdepot.__version__
    assert result["command"].startswith("kvdepot bench --quick")
    config = result["config"]
    assert config["quick"] is True and config["sizes"] == SIZES and config["engines"] == ENGINES
    assert result["machine"]["cpus"] >= 1
    assert 0 < result["elapsed_s"] < 120
    assert result["verified"]["pages"] > 0 and result["verified"]["mismatched_pages"] == 0
    assert result["connector"] == {"skipped": "--no-connector"}
    # No CUDA on the test machines: the GPU section says why it did not run.
    assert "skipped" in result["gpu"] or "error" not in result["gpu"]


def test_geometry_and_job_sizes_agree(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    geo = result["config"]["geometry"]
    # K and V, every head, every token of a block: one layer's page of one block.
    page = 2 * geo["kv_heads"] * geo["head_dim"] * geo["dtype_bytes"] * geo["block_size"]
    assert geo["page_bytes"] == page
    chunk = page * geo["layers"] * geo["blocks_per_chunk"] * geo["tp"]
    assert geo["chunk_bytes"] == chunk
    for r in result["throughput"]:
        assert r["job_bytes"] == r["chunks"] * chunk
        assert r["runs_per_rank"] == r["chunks"] * geo["layers"] * geo["blocks_per_chunk"]
    for r in result["aggregate"]:
        assert r["job_bytes"] == result["config"]["agg_chunks"] * chunk
    assert result["config"]["pool_bytes"] > 0


def test_throughput_pairs_daemon_with_in_process(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    reps = result["config"]["reps"]
    rows = result["throughput"]
    assert [r["chunks"] for r in rows] == SIZES
    for r in rows:
        for d in ("store", "load"):
            f = r[d]
            where = (r["chunks"], d)
            for key in ("daemon_gbps", "inproc_gbps", "inproc_copy_only_gbps"):
                assert _sane_gbps(f[key]), (where, key, f[key])
            assert len(f["daemon_reps_gbps"]) == len(f["inproc_reps_gbps"]) == reps
            assert len(f["ratio_reps"]) == reps
            # Each repetition's ratio is that repetition's daemon over in-process GB/s;
            # the headline figures are the medians.
            for daemon, inproc, ratio in zip(
                f["daemon_reps_gbps"], f["inproc_reps_gbps"], f["ratio_reps"], strict=True
            ):
                assert _ratio(ratio) and ratio == pytest.approx(daemon / inproc), where
            assert f["ratio"] == pytest.approx(median(f["ratio_reps"]))
            assert f["daemon_gbps"] == pytest.approx(median(f["daemon_reps_gbps"]))
            assert f["inproc_gbps"] == pytest.approx(median(f["inproc_reps_gbps"]))
            assert f["jobs_per_rep"] >= 1
        assert r["store"]["load_sets"] is None
        assert 1 <= r["load"]["load_sets"] <= r["load"]["jobs_per_rep"]


def test_latency_splits_round_trip_into_copy_and_overhead(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_run
    reps = result["config"]["reps"]
    jobs = {
        (r["chunks"], d): r[d]["jobs_per_rep"]
        for r in result["throughput"]
        for d in ("store", "load")
    }
    rows = result["latency"]
    assert sorted((r["chunks"], r["direction"]) for r in rows) == sorted(jobs)
    for r in rows:
        # One sample per timed job of the throughput series (warm-up jobs excluded).
        assert r["samples"] == reps * jobs[r["chunks"], r["direction"]], r
        for key in ("rtt_ms", "copy_ms", "overhead_ms", "in_daemon_ms", "wire_ms"):
            assert _percentiles(r[key]), (key, r[key])
        assert _positive(r["copy_ms"]["p50"])
        # overhead = rtt - copy sample by sample, so its median cannot exceed rtt's.
        assert 0 < r["overhead_ms"]["p50"] <= r["rtt_ms"]["p50"]
        assert r["rtt_ms"]["p50"] >= r["copy_ms"]["p50"]
        assert 0 < r["noncopy_share"] < 1
        # The daemon's copies waited for a copy thread some of the time in the daemon
        # (GetStats' copy times over the series' daemon runs).
        assert r["copy_wait_ms_mean"] is not None and r["copy_wait_ms_mean"] >= 0, r
    floor = result["latency_floor"]
    assert floor["direction"] == "empty" and floor["samples"] > 0
    assert floor["copy_ms"] == {"p50": 0.0, "p99": 0.0} and floor["noncopy_share"] == 1.0
    assert _positive(floor["rtt_ms"]["p50"]) and _percentiles(floor["rtt_ms"])
    assert floor["overhead_ms"]["p50"] == pytest.approx(floor["rtt_ms"]["p50"])


def test_aggregate_covers_one_two_four_engines(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    reps = result["config"]["reps"]
    rows = result["aggregate"]
    assert [r["engines"] for r in rows] == ENGINES
    for r in rows:
        assert r["processes"] == r["engines"]  # TP=1: one process per engine
        assert r["chunks"] == result["config"]["agg_chunks"]
        for d in ("store", "load"):
            f = r[d]
            assert _sane_gbps(f["daemon_gbps"]) and _sane_gbps(f["inproc_gbps"])
            # Engines share the CPUs: one repetition may be skewed, the median may not.
            assert _ratio(f["ratio"]) and all(_positive(x) for x in f["ratio_reps"])
            assert f["ratio"] == pytest.approx(median(f["ratio_reps"]))
            # Every process's jobs of every repetition are timed.
            assert r["latency"][d]["samples"] == reps * f["jobs_per_rep"] * r["processes"]
            assert _percentiles(r["latency"][d]["rtt_ms"])


def test_control_plane_and_targets(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    ctl = result["control"]
    assert ctl["ready_keys"] > 0 and ctl["pins"] > 0 and ctl["pin_keys"] >= 16
    assert _positive(ctl["lookup_keys_per_s"]) and _positive(ctl["rpc_lookup_keys_per_s"])
    assert ctl["lookup_hit_share"] == pytest.approx(0.5)  # half the keys looked up are ready
    assert _positive(ctl["pin_ms"]["p50"]) and _percentiles(ctl["pin_ms"])
    assert _positive(ctl["unpin_ms"]["p50"]) and _percentiles(ctl["unpin_ms"])
    assert ctl["pinned_share"] == 1.0  # every key pinned was ready
    targets = {t["name"]: t for t in result["targets"]}
    assert len(targets) == 7, list(targets)
    for t in targets.values():
        # "met" is the comparison the target states, applied to the measured figure.
        m = re.fullmatch(r"(>=|<=|<) ([0-9.]+)(?: ms| keys/s| GB/s-equivalent)?", t["target"])
        assert m, t["target"]
        bound = float(m.group(2))
        assert _positive(t["measured"]) and t["where"], t
        met = {
            ">=": t["measured"] >= bound,
            "<=": t["measured"] <= bound,
            "<": t["measured"] < bound,
        }[m.group(1)]
        assert t["met"] is met, t


def test_control_plane_ceiling_runs_the_job_path_with_copies_off(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    """Rows for every job size, both directions, 2 engines x 4 in flight; the jobs
    really went through the daemon (bytes counted), at a rate that fits the window."""
    result, _ = quick_run
    rows = result["control_ceiling"]
    info = result["control_ceiling_info"]
    assert "NullCopyEngine" in info["copy_engine"], info
    run = sorted({r["chunks"] for r in rows} | set(info["skipped_chunks"]))
    assert run == SIZES and 16 in {r["chunks"] for r in rows}
    chunk = result["config"]["geometry"]["chunk_bytes"]
    for r in rows:
        assert r["engines"] == 2 and r["depth"] == 4 and r["direction"] in ("store", "load")
        assert r["job_bytes"] == r["chunks"] * chunk
        assert _positive(r["jobs_per_s"]) and _positive(r["window_s"])
        assert r["equivalent_gbps"] == pytest.approx(r["jobs_per_s"] * r["job_bytes"] / 1e9)
        # More jobs per second than the window holds would mean jobs not timed.
        assert r["jobs_per_s"] * r["window_s"] <= r["jobs"] + 1
        assert _positive(r["daemon_cpu_ms_per_job"]) and r["engine_cpu_ms_per_job"] >= 0
        # One engine's ranks (TP=1 here: none out of step) never find the pool full.
        assert r["dropped_keys"] == 0, r


def test_machine_limits_are_measured_in_the_same_run(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_run
    lim = result["machine_limits"]
    mm = lim["memmove"]
    assert mm["threads"] == result["machine"]["cpus"] and mm["bytes"] >= 64 << 20
    assert _sane_gbps(mm["one_thread_gbps"]) and _sane_gbps(mm["all_cores_gbps"])
    echo = lim["grpc_echo"]
    assert echo["message_bytes"] == 200 and echo["messages"] > 0
    assert _positive(echo["rtt_ms"]["p50"]) and _percentiles(echo["rtt_ms"])
    assert lim["empty_job_over_echo"] == pytest.approx(
        result["latency_floor"]["rtt_ms"]["p50"] / echo["rtt_ms"]["p50"]
    )


def test_plot_is_a_png(quick_run: tuple[dict[str, Any], Path]) -> None:
    _, png = quick_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the pieces, without processes --------------------------------------------------------


def test_overlap_rate_counts_only_the_time_all_workers_run() -> None:
    # Worker a runs 0..4 s, worker b 1..3 s, 1 byte per second each.
    a = [(float(t), float(t + 1), 1) for t in range(4)]
    b = [(1.0, 2.0, 1), (2.0, 3.0, 1)]
    rate, window = overlap_rate([a, b])
    assert window == pytest.approx(2.0)
    assert rate == pytest.approx(2.0)  # both busy from 1 s to 3 s
    # A job straddling the window's edge counts by its overlap.
    rate, _ = overlap_rate([[(0.0, 2.0, 4)], [(1.0, 2.0, 1)]])
    assert rate == pytest.approx((2 + 1) / 1.0)
    # Workers that never overlapped: all bytes over the whole span.
    rate, window = overlap_rate([[(0.0, 1.0, 10)], [(2.0, 3.0, 10)]])
    assert window == pytest.approx(3.0) and rate == pytest.approx(20 / 3)
    assert overlap_rate([]) == (0.0, 0.0)


def test_percentiles_and_median() -> None:
    values = list(range(1, 101))
    assert median(values) == 50.5
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert median([]) == 0.0 and percentile([], 50) == 0.0


def test_an_optional_section_says_why_it_did_not_run() -> None:
    # No CUDA on the test machines: the GPU section is a reason, not an error.
    if optional.need_cuda() is None:
        pytest.skip("this machine has CUDA")
    assert optional.gpu_section(quick=True, sizes=[1], reps=1) == {"skipped": optional.need_cuda()}


def test_an_error_inside_a_section_is_reported_not_raised() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    out = optional.guarded("gpu_bench", broken)
    assert out["error"] == "gpu_bench: RuntimeError: boom"
    assert "broken" in out["traceback"]
    assert optional.guarded("gpu_bench", lambda: {"gbps": 1.0}) == {"gbps": 1.0}


def test_a_run_that_stops_early_says_why_and_exits_as_a_shell_would(
    capsys: pytest.CaptureFixture[str],
) -> None:
    closed: list[bool] = []

    class Bar:
        def close(self) -> None:
            closed.append(True)

    assert output.report_stop("kvdepot bench", KeyboardInterrupt(), Bar()) == 130
    assert output.report_stop("kvdepot bench serve", OSError(28, "No space left")) == 1
    assert closed == [True]
    assert capsys.readouterr().err == (
        "kvdepot bench: interrupted\n"
        "kvdepot bench serve: failed: OSError: [Errno 28] No space left\n"
    )


def bench_module_lines(module: str, *args: str) -> list[str]:
    """`python -m kvdepot.bench.<module> <args>`: its stdout's lines, once it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", f"kvdepot.bench.{module}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.parametrize("engine", ["cuda", "cpu"])
def test_plan_cost_times_both_planners(engine: str) -> None:
    """`python -m kvdepot.bench.plan_cost`: the compiled and the numpy planner, each
    alone and beside a woken thread (a figure per cell, no speed threshold), for the
    CUDA engine's DMA plan or the CPU engine's prepared copy."""
    lines = bench_module_lines("plan_cost", "--jobs", "20", "--chunks", "4", "--engine", engine)
    assert "4 chunks x 32 layers (128 pages" in lines[0] and f"the {engine} engine" in lines[0]
    rows = {cells[0]: [float(x) for x in cells[1:]] for cells in map(str.split, lines[2:])}
    assert set(rows) == {"compiled", "numpy"}
    assert all(len(cells) == 2 and min(cells) > 0 for cells in rows.values()), rows


def test_index_cost_reports_each_figure() -> None:
    """`python -m kvdepot.bench.index_cost`: a figure per line (no speed threshold), on
    an index it checks afterwards."""
    lines = bench_module_lines("index_cost", "--rows", "4096", "--reps", "1")
    assert "4096 READY rows" in lines[0]
    figures = {line.rsplit(maxsplit=1)[0]: float(line.split()[-1]) for line in lines[1:]}
    assert [name.split(",")[0] for name in figures] == ["store", "pin", "unpin", "memory"]
    assert all(value > 0 for value in figures.values()), figures


def test_job_cost_reports_both_directions_and_every_step() -> None:
    """`python -m kvdepot.bench.job_cost`: the job path on a real DepotState, no socket;
    a figure per direction and per step of the job (no speed threshold). It raises, and
    exits non-zero, if a job fails or a store drops a key."""
    args = ("--tp", "2", "--layers", "4", "--jobs", "4", "--passes", "3")
    lines = bench_module_lines("job_cost", *args)
    assert "16 chunks x 4 layers of 8 KiB pages, TP=2" in lines[0]
    assert [line.split()[0] for line in lines[1:3]] == ["store", "load"]
    assert all(float(line.split()[1]) > 0 for line in lines[1:3]), lines
    steps = {line[:46].strip(): float(line.split()[-1]) for line in lines[4:]}
    assert list(steps)[:3] == [
        "decode the job (job_from_proto)",
        "admitted: session, counts (admit_job)",
        "check: registration, size, shape (_check)",
    ]
    rest = "the rest: coroutines, copy-queue hand-off"
    assert list(steps)[-2:] == [rest, "total"]
    timed = {k: v for k, v in steps.items() if k not in (rest, "total")}
    assert len(timed) == 11 and all(v > 0 for v in timed.values()), steps
    # Not compared with the steps: the total is the loop thread's CPU, the steps wall
    # time, and on a busy machine a step's wall time may outgrow it (a descheduled loop).
    assert steps["total"] > 0


@pytest.mark.parametrize(
    "command",
    [["-m", "kvdepot.server.cli", "bench"], ["-m", "kvdepot.bench"]],
    ids=["kvdepot bench", "python -m kvdepot.bench"],
)
def test_the_bench_is_its_own_program_and_kvdepot_bench_hands_on_to_it(
    command: list[str],
) -> None:
    """The daemon's command never imports the bench (docs/architecture.md §2): it hands
    `kvdepot bench ...` to kvdepot.bench.cli by name, whose parser answers both ways."""
    proc = subprocess.run(
        [sys.executable, *command, "--layers", "many"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "kvdepot bench: error: argument --layers: invalid int value: 'many'\n"


# -- the node series (`kvdepot bench --node`) ---------------------------------------------


def run_node_bench(args: list[str], timeout: float) -> tuple[dict, str]:
    """`kvdepot bench --node --quick --json --quiet ARGS` as a subprocess: its figures
    and what it printed on stderr (the table)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server.cli", "bench", "--node", "--quick", "--json",
         "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"bench --node failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout), proc.stderr


def test_node_series_runs_one_and_two_daemon_shards() -> None:
    """A short `kvdepot bench --node --quick` (the 70B-like geometry cut to 8 layers and
    TP=2, 2 engines): a row per shard count and direction, with the jobs' rate and the
    CPU the daemons and engines spent, read from /proc (figures, no speed threshold)."""
    result, table = run_node_bench(
        ["--node-geometry", "70b-tp8", "--node-engines", "2", "--node-shards", "1,2"], 120
    )
    rows = result["node_ceiling"]
    assert sorted((r["shards"], r["direction"]) for r in rows) == [
        (1, "load"),
        (1, "store"),
        (2, "load"),
        (2, "store"),
    ]
    info = result["node"]
    for r in rows:
        assert r["geometry"] == "70b-tp8" and r["engines"] == 2 and r["tp"] == 2
        assert r["cores"] == result["machine"]["cpus"]
        # One KV head per rank, 8 KiB pages, as the 70B-like geometry at TP=8.
        assert r["rank_job_bytes"] == info["chunks"] * 8 * 8192
        assert r["rank_jobs"] == 16 * 60  # --quick: 16 x 60 timed jobs over the 4 ranks
        assert _positive(r["rank_jobs_per_s"]) and _positive(r["overhead_ms_p50"])
        assert r["equivalent_gbps"] == pytest.approx(
            r["rank_jobs_per_s"] * r["rank_job_bytes"] / 1e9
        )
        assert _positive(r["daemon_cpu_us_per_rank_job"]) and r["engine_cpu_us_per_rank_job"] >= 0
        # The event loops' share of it, read from the daemons themselves: a part, not more.
        loop = r["loop_cpu_us_per_rank_job"]
        assert 0 < loop <= r["daemon_cpu_us_per_rank_job"] * 1.1 + 20, r
        assert r["copy_wait_ms_mean"] > 0  # every rank job's (null) copy was handed over
        one = next(o for o in rows if o["shards"] == 1 and o["direction"] == r["direction"])
        assert r["vs_one_shard"] == pytest.approx(r["rank_jobs_per_s"] / one["rank_jobs_per_s"])
        # Stores the pool had no room for (ranks out of step on a busy host): counted.
        assert isinstance(r["dropped_keys"], int) and r["dropped_keys"] >= 0
        assert r["shards_used"] == r["shards"]  # TP=2 on 1 or 2 shards: every one
    assert info["skipped"] == []
    assert "kvdepot bench --node" in table and "rank jobs/s" in table
    assert len([line for line in table.splitlines() if line.startswith(" 70b-tp8")]) == 4


def test_node_series_deals_ranks_to_shards_as_the_connector_does() -> None:
    """Rank r of every engine goes to shard r // (TP / gcd(S, TP)); there an engine is a
    world of the ranks it sent, renumbered, each rank's page unchanged."""
    from kvdepot.bench.node import preset, shard_views

    geo = preset("70b-tp8", quick=False)
    views = shard_views(geo, engines=2, shards=4)
    assert len(views) == 16
    for (engine, rank), (shard, view, local) in views.items():
        assert shard == rank // 2
        assert view.page_bytes == geo.page_bytes == 8192 and view.layers == 80
        mates = sorted(r for (e, r), v in views.items() if e == engine and v[0] == shard)
        assert view.tp == len(mates) == 2 and local == mates.index(rank)
    gcd_one = shard_views(geo, engines=2, shards=3)  # each engine whole on one shard
    for engine in range(2):
        assert len({v[0] for (e, _), v in gcd_one.items() if e == engine}) == 1
    assert {v[1].tp for v in gcd_one.values()} == {8}
    assert {v[1].tp for v in shard_views(geo, engines=2, shards=1).values()} == {8}
    # TP=1 engines, each a namespace of its own (as distinct models): each on the shard
    # its namespace picks, and together spread over the node's shards.
    # Replicated MLA ranks register as the connector's do: rank 0 of a world of one,
    # every rank of an engine on its one shard, the whole latent each.
    mla = preset("deepseek-v3-tp8", quick=False)
    for shards in (1, 2, 8):
        routed = shard_views(mla, engines=2, shards=shards)
        assert {(v.registered_world, local, v.page_bytes) for _, v, local in routed.values()} == {
            (1, 0, 576 * 2 * 16)
        }
        for engine in range(2):
            assert len({v[0] for (e, _), v in routed.items() if e == engine}) == 1
    one_rank = preset("8b-tp1", quick=False)
    spread = shard_views(one_rank, engines=16, shards=4)
    assert {local for _, _, local in spread.values()} == {0}
    assert len({shard for shard, _, _ in spread.values()}) > 1


def test_node_series_stores_a_replicated_mla_row_once_at_every_tp() -> None:
    """`kvdepot bench --node --node-geometry deepseek-v3-tp8 --node-tp 1,2` (cut to 8
    layers): an MLA row is one section (8 layers x 16 tokens x 576 bf16 values), the same
    in the pool at TP=1 and TP=2, copied in once per chunk however many ranks store it and
    out once per rank. A section per rank, as kvdepot stored MLA before, doubles both."""
    result, table = run_node_bench(
        [
            "--node-geometry",
            "deepseek-v3-tp8,deepseek-v3-tp8-sections",
            "--node-tp",
            "2,1",
            "--node-engines",
            "1",
            "--node-shards",
            "1",
        ],
        180,
    )
    section = 8 * 16 * 576 * 2
    rows = {(r["geometry"], r["tp"], r["direction"]): r for r in result["node_ceiling"]}
    assert len(rows) == 8
    for (name, tp, direction), r in rows.items():
        replicated = name == "deepseek-v3-tp8"
        row = section if replicated else tp * section
        assert r["rank_job_bytes"] == result["node"]["chunks"] * section  # a rank's latent
        assert r["pool_bytes_per_row"] == row, r
        assert _positive(r["rank_jobs_per_s"]) and r["dropped_keys"] == 0
        assert r["equivalent_gbps"] == pytest.approx(
            r["rank_jobs_per_s"] * r["rank_job_bytes"] / 1e9
        )
        # A store copies each row once (a rank that finds it copied copies nothing; a
        # row evicted before a slow rank's store is copied again: within 5 %); every
        # rank loads its section.
        copied = row if direction == "store" else tp * section
        assert r["copied_bytes_per_chunk"] == pytest.approx(copied, rel=0.05), r
    assert "DeepSeek-V3-like MLA" in table and "one section a row" in table


def test_node_series_refuses_a_tp_the_heads_do_not_split_over() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.bench", "--node", "--node-geometry", "70b-tp8",
         "--node-tp", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--node-tp: 70b-tp8: 8 KV heads do not split over TP=3" in proc.stderr


def test_node_series_refuses_an_unknown_geometry() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.bench", "--node", "--node-geometry", "405b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--node-geometry takes 70b-tp8, 8b-tp1" in proc.stderr


def test_node_table_says_when_engines_picked_fewer_shards_than_the_node_has() -> None:
    from kvdepot.bench.node import format_node_table

    def row(shards: int, used: int, direction: str) -> dict:
        return {
            "geometry": "8b-tp1", "engines": 2, "tp": 1, "shards": shards, "shards_used": used,
            "direction": direction, "rank_jobs_per_s": 100.0, "equivalent_gbps": 3.2,
            "vs_one_shard": 1.0, "daemon_cpu_us_per_rank_job": 200.0,
            "loop_cpu_us_per_rank_job": 180.0, "engine_cpu_us_per_rank_job": 90.0,
            "one_core_gbps": 50.0, "host_cpu_share": 0.6, "copy_wait_ms_mean": 0.5,
            "overhead_ms_p50": 2.0, "dropped_keys": 0, "copied_gbps": 3.2,
            "copied_bytes_per_chunk": 2048.0, "pool_bytes_per_row": 2048.0,
        }  # fmt: skip

    node = {
        "engines": 2, "depth": 4, "chunks": 16, "cores": 2, "pool_bytes": 1 << 32,
        "geometries": {"8b-tp1": "TP=1"}, "skipped": [],
        "rows": [row(1, 1, "store"), row(2, 1, "store"), row(2, 1, "load"), row(4, 2, "store")],
    }  # fmt: skip
    table = format_node_table(
        {"version": "x", "elapsed_s": 1.0, "node": node, "loadavg_1min": {"start": 0, "end": 0}}
    )
    notes = [line for line in table.splitlines() if "namespaces picked" in line]
    assert notes == [
        " note: 8b-tp1 on 2 shards: the engines' namespaces picked 1 of them "
        "(kvdepot.common.shards.first_shard)",
        " note: 8b-tp1 on 4 shards: the engines' namespaces picked 2 of them "
        "(kvdepot.common.shards.first_shard)",
    ]


# -- the capacity replay (`kvdepot bench --capacity`) ---------------------------------------


def test_capacity_replay_runs_every_system_and_keeps_no_unreachable_rows() -> None:
    """A short `kvdepot bench --capacity --quick` on the shared-documents trace: every
    system replayed the same requests, kvdepot's LRU pool never held a row no lookup
    reaches, nor did the pool and the disk together, and the targets that hold by
    construction hold (figures, not a speed)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.server.cli",
            "bench",
            "--capacity",
            "--quick",
            "--json",
            "--quiet",
            "--capacity-traces",
            "docs",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"bench --capacity failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout)
    assert result["command"].startswith("kvdepot bench --capacity --quick")
    [row] = result["rows"]
    trace = row["trace"]
    assert trace["family"] == "docs" and trace["requests"] == result["config"]["requests"]
    systems = row["systems"]
    assert set(systems) == {
        "belady",
        "vllm-lru",
        "vllm-arc",
        "kvdepot-lru",
        "kvdepot-arc",
        "kvdepot-lru+disk",
    }
    tokens = trace["prompt_tokens"]
    for name, s in systems.items():
        assert 0 < s["hit_tokens"] < tokens, name  # some hits, never every token
        assert s["hit_tokens"] % 16 == 0, name  # whole chunks only
        assert s["hit_rate"] == pytest.approx(s["hit_tokens"] / tokens)
        assert s["stored_bytes"] == s["stored_chunks"] * result["config"]["chunk_bytes"] > 0
    assert row["unbounded_hit_rate"] >= systems["belady"]["hit_rate"]
    lru = systems["kvdepot-lru"]
    assert lru["unreachable_max"] == 0 and lru["unreachable_end"] == 0
    assert lru["held_end"] == result["config"]["pool_chunks"]  # full, all of it reachable
    assert lru["load_failures"] == 0 and lru["dropped_stores"] == 0
    assert lru["hit_rate"] >= systems["vllm-lru"]["hit_rate"]
    disk = systems["kvdepot-lru+disk"]
    assert disk["hit_rate"] >= lru["hit_rate"]
    assert disk["disk_hit_chunks"] > 0
    # No row of the pool or the disk behind a chunk neither holds (read from the daemon).
    assert disk["xtier_unreachable_max"] == 0 and disk["disk_orphans_max"] == 0
    assert row["belady_ram_disk_hit_rate"] >= systems["belady"]["hit_rate"]
    targets = {t["target"] for t in result["targets"]}
    assert "RAM+disk >= RAM only" in targets and "kvdepot lru unreachable" in targets
    assert "RAM+disk unreachable across the tiers" in targets
    assert "kvdepot bench --capacity" in proc.stderr and "belady" in proc.stderr


def test_rpc_compare_runs_each_daemon_interleaved_and_reports_ratios() -> None:
    """`python -m kvdepot.bench.rpc_compare`: two daemons of this tree, every kind of
    call timed on each, ratios to the first (no speed threshold)."""
    lines = bench_module_lines("rpc_compare", "--rounds", "2", "--calls", "5", "--json")
    result = json.loads("\n".join(lines))
    assert list(result["daemons"]) == ["a", "b"]
    for row in result["daemons"].values():
        for kind in ("lookup", "pin", "unpin"):
            assert row[kind]["p50_us"] > 0 and row[kind]["p90_us"] >= row[kind]["p50_us"]
        assert row["daemon_cpu_us_per_call"] >= 0
    assert result["daemons"]["a"]["pin"]["p50_ratio"] == 1.0
