"""`python -m kvdepot.bench.connector_bench --quick`: the scheduler-side figures are all
there, per round, and the kvdepot scheduler made one pin call per admission step, on its
pin lane (the steps it times are real vLLM Scheduler steps against a real daemon). No speed
threshold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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
        # The scheduler thread's own CPU: measured, and never more than the wall time.
        assert all(
            0 < r["admission_step_cpu_ms"] <= r["admission_step_ms"] * 1.05 + 0.1 for r in rounds
        )
        assert all(r["decode_step_cpu_ms_mean"] > 0 for r in rounds)
    for name in ("kvdepot", "vllm_cpu"):
        assert len(result["added_rounds"][name]) == 2
        assert set(result["added_ms"][name]) == {
            "admission_step",
            "decode_step",
            "admission_step_cpu",
            "decode_step_cpu",
        }
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
    assert "added thread CPU per admission step (ms)" in proc.stdout
    assert "in the connector, decode (ms)" in proc.stdout


def test_engines_at_a_tp_the_test_model_cannot_split_get_a_config_they_can(tmp_path) -> None:
    """`--shards 8` runs kvdepot's engines at TP=8, which OPT-125m's 12 attention heads
    do not divide (vLLM refuses the config): they get a copy with 24 heads; a TP that
    divides 12 keeps the model itself, and one no head count fits is refused in words."""
    from kvdepot.testing.environment import find_model_dir, model_dir_for_tp

    assert model_dir_for_tp(4, tmp_path / "tp4") == find_model_dir()
    copy = model_dir_for_tp(8, tmp_path / "tp8")
    config = json.loads((copy / "config.json").read_text())
    original = json.loads((find_model_dir() / "config.json").read_text())
    assert config == {**original, "num_attention_heads": 24}
    with pytest.raises(ValueError, match="cannot be split over 5 ranks"):
        model_dir_for_tp(5, tmp_path / "tp5")
