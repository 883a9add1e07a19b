"""`python -m kvdepot.bench.connector_bench --quick`: the scheduler-side figures are all
there, per round, and the kvdepot scheduler made one pin call per admission step, on its
pin lane (the steps it times are real vLLM Scheduler steps against a real daemon). No speed
threshold."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_connector_bench_reports_every_setup_per_round() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.bench.connector_bench",
            "--quick",
            "--rounds",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout[proc.stdout.index("{\n") :])
    assert result["config"]["rounds"] == 2
    for name in ("kvdepot", "vllm_cpu", "none"):
        rounds = result["step_rounds"][name]
        assert len(rounds) == 2
        assert all(r["admission_step_ms"] > 0 and r["decode_step_ms_mean"] > 0 for r in rounds)
    for name in ("kvdepot", "vllm_cpu"):
        assert len(result["added_rounds"][name]) == 2
        assert set(result["added_ms"][name]) == {"admission_step", "decode_step"}
        # The time inside the connector's methods is measured, and only where there is one.
        timed = result["step_rounds"][name]
        assert all(r["admission_in_connector_ms"] > 0 < r["decode_in_connector_ms"] for r in timed)
    assert all(r["decode_in_connector_ms"] == 0 for r in result["step_rounds"]["none"])
    # One pin per round's admission step, none in the decode steps; all of it on the
    # pin lane, not over gRPC, in parts sent while vLLM prepared the loads.
    cfg = result["config"]
    keys = cfg["requests"] * cfg["hit_tokens"] // cfg["block_size"]
    assert result["kvdepot_pin_rpcs_in_steps"] == 2
    assert result["kvdepot_lane_pins_in_steps"] == 2 * -(-keys // cfg["early_pin_keys"])
    # The loads' unpins went on the unpin lane (at least one datagram per round).
    assert result["kvdepot_lane_unpins_in_steps"] >= 2
    assert set(result["pin"]) == {f"{n}_keys_{p}" for n in (16, 1024) for p in ("lane", "gRPC")}
    assert result["lookup_us"]["kvdepot"] > 0 and result["lookup_us"]["vllm_cpu"] > 0
    assert "kvdepot <= vLLM CPU, admission" in proc.stdout
    assert "in the connector, decode (ms)" in proc.stdout
