"""`kvdepot bench`: a real run (daemon + engine processes) produces every section.

Speed is the bench's business, not the tests': these check structure, positive
figures and consistent ratios, never a throughput threshold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdepot.bench import optional
from kvdepot.bench.stats import median, overlap_rate, percentile

SIZES = [1, 16, 64]
ENGINES = [1, 2, 4]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One `kvdepot bench --quick --json --plot` for every check below."""
    out = tmp_path_factory.mktemp("bench")
    png = out / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "kvdepot.server.cli", "bench", "--quick", "--json", "--quiet",
         "--no-connector", "--plot", str(png)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"bench failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout), png


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and x > 0


def test_every_section_is_there(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    for key in ("version", "command", "machine", "config", "verified", "throughput", "latency",
                "aggregate", "control", "connector", "gpu", "targets", "elapsed_s"):
        assert key in result, key
    assert result["config"]["quick"] is True
    assert result["machine"]["cpus"] >= 1
    assert result["verified"]["pages"] > 0 and result["verified"]["mismatched_pages"] == 0
    assert result["connector"] == {"skipped": "--no-connector"}
    # No CUDA on the test machines: the GPU section says why it did not run.
    assert "skipped" in result["gpu"] or "error" not in result["gpu"]


def test_throughput_pairs_daemon_with_in_process(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    rows = result["throughput"]
    assert [r["chunks"] for r in rows] == SIZES
    for r in rows:
        assert _positive(r["job_bytes"]) and _positive(r["runs_per_rank"])
        for d in ("store", "load"):
            f = r[d]
            assert _positive(f["daemon_gbps"]) and _positive(f["inproc_gbps"]), (r["chunks"], d)
            assert _positive(f["inproc_copy_only_gbps"])
            assert _positive(f["ratio"])
            reps = result["config"]["reps"]
            assert len(f["daemon_reps_gbps"]) == len(f["inproc_reps_gbps"]) == reps
            assert len(f["ratio_reps"]) == reps and all(_positive(x) for x in f["ratio_reps"])
            # The ratio is the median of the paired per-repetition ratios.
            assert f["ratio"] == pytest.approx(median(f["ratio_reps"]))
        assert r["load"]["load_sets"] >= 1


def test_latency_splits_round_trip_into_copy_and_overhead(
    quick_run: tuple[dict[str, Any], Path],
) -> None:
    result, _ = quick_run
    rows = result["latency"]
    assert sorted((r["chunks"], r["direction"]) for r in rows) == sorted(
        (c, d) for c in SIZES for d in ("store", "load")
    )
    for r in rows:
        assert r["samples"] > 0
        assert _positive(r["rtt_ms"]["p50"]) and r["rtt_ms"]["p99"] >= r["rtt_ms"]["p50"]
        assert _positive(r["copy_ms"]["p50"])
        assert r["rtt_ms"]["p50"] >= r["copy_ms"]["p50"]  # a round trip contains its copy
        assert r["overhead_ms"]["p99"] >= r["overhead_ms"]["p50"] > 0
        assert 0 < r["noncopy_share"] < 1


def test_aggregate_covers_one_two_four_engines(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    rows = result["aggregate"]
    assert [r["engines"] for r in rows] == ENGINES
    for r in rows:
        assert r["processes"] == r["engines"]  # TP=1: one process per engine
        for d in ("store", "load"):
            assert _positive(r[d]["daemon_gbps"]) and _positive(r[d]["inproc_gbps"])
            assert _positive(r[d]["ratio"])
            assert r["latency"][d]["samples"] > 0


def test_control_plane_and_targets(quick_run: tuple[dict[str, Any], Path]) -> None:
    result, _ = quick_run
    ctl = result["control"]
    assert _positive(ctl["lookup_keys_per_s"]) and _positive(ctl["rpc_lookup_keys_per_s"])
    assert 0 < ctl["lookup_hit_share"] < 1
    assert _positive(ctl["pin_ms"]["p50"]) and ctl["pin_ms"]["p99"] >= ctl["pin_ms"]["p50"]
    assert ctl["pinned_share"] == 1.0  # every key pinned was ready
    names = [t["name"] for t in result["targets"]]
    assert len(names) == 4, names
    for t in result["targets"]:
        assert isinstance(t["met"], bool) and _positive(t["measured"])


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
    assert optional.gpu_section(quick=True, sizes=[1], reps=1) == {
        "skipped": optional.need_cuda()
    }


def test_an_error_inside_a_section_is_reported_not_raised() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    out = optional.guarded("gpu_bench", broken)
    assert out["error"] == "gpu_bench: RuntimeError: boom"
    assert "broken" in out["traceback"]
    assert optional.guarded("gpu_bench", lambda: {"gbps": 1.0}) == {"gbps": 1.0}
