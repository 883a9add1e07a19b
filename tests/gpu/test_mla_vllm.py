"""MLA under vLLM 0.33 on a GPU: the checks the CPU engine tests cannot make.

NOT RUN YET: written without a GPU host. tests/gpu/run_h200.sh runs this file where vLLM
with CUDA imports (the device image of this workplace has no vLLM, and its wheel does
not fit what a device call carries); elsewhere every test here skips, saying why.

- vLLM's V2 model runner, the default on GPU, allocates the KV cache itself: an engine
  on it loads what an engine on the V1 runner stored (one namespace, the same pages),
  and computes what it computed alone.
- MLA at TP=2 (two GPUs; skipped on one): the ranks store one section a row (the pool
  holds one latent a token, not two) and a TP=1 engine of the model loads it.

The model: tests/data/hf-config-deepseek-v2-tiny (2 layers, no MoE, one latent of 576
values a token) with seeded random weights, in bfloat16 (vLLM's MLA kernels on GPU take
no float32). Each engine's first output is computed (vLLM's counters show no token from
kvdepot); store_threshold 2 keeps the engine that checks loads from storing that run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 with CUDA")

from kvdepot.bench.vllm_models import build_model
from kvdepot.testing.environment import prompt_for
from kvdepot.testing.waiting import log_tails, wait_for
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import external_tokens
from tests.engine.test_mla_engine import registered_ranks
from tests.support.daemon import stats

pytestmark = pytest.mark.timeout(600)

PROMPT = prompt_for(401, 8 * 64 + 5)  # 8 chunks of 64 tokens, 32 of 16: either block size
FULL = 8 * 64  # the prompt's tokens in full blocks: what can come from kvdepot
LATENT_BYTES = 576 * 2  # one token's latent in one layer, bfloat16
LAYERS = 2
ONE_COPY = FULL * LAYERS * LATENT_BYTES  # the prompt's rows, one section each
LOGPROB_TOLERANCE = 0.05  # bfloat16 over a few decode steps
# Small and quick to start: eager mode (no CUDA graphs, no compilation).
GPU_ARGS = {"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": 0.2}


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("deepseek-v2-tiny", tmp_path_factory.mktemp("deepseek-v2"))


def assert_same_tokens(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"], (got, want)
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert abs(a - b) <= LOGPROB_TOLERANCE, (got["logprobs"], want["logprobs"])


def computed(engine: LLMEngine, model: Path) -> dict:
    before = external_tokens(engine, model)
    out = engine.generate([PROMPT])[0]
    assert external_tokens(engine, model) == before, "the reference output was not computed"
    return out


def wait_stored(daemon, engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    """Until the pool holds the prompt's full blocks, none still being written."""

    def stored() -> bool:
        s = stats(daemon)
        return s.used_bytes >= ONE_COPY and s.writing_blocks == 0

    wait_for(stored, 60, "the prompt's rows stored", detail=log_tails(engine, daemon))


def loads(engine: LLMEngine, model: Path, want: dict) -> None:
    """The prompt again, vLLM's own cache emptied: every full block from kvdepot, and the
    output equal to `want`."""
    engine.reset_prefix_cache()
    before = external_tokens(engine, model)
    assert_same_tokens(engine.generate([PROMPT])[0], want)
    assert external_tokens(engine, model) - before == FULL


def test_v2_model_runner_loads_what_the_v1_runner_stored(
    mla_model: Path, cuda_daemon, tmp_path: Path, monkeypatch
) -> None:
    daemon = cuda_daemon("--pool-size", "1GiB")
    # vLLM takes the runner the variable names, before any default (VllmConfig).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    v2 = LLMEngine(
        mla_model, tmp_path, readme_kv_config(daemon.target, store_threshold=2), **GPU_ARGS
    )
    try:
        want = computed(v2, mla_model)
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        v1 = LLMEngine(mla_model, tmp_path, readme_kv_config(daemon.target), **GPU_ARGS)
        try:
            assert_same_tokens(computed(v1, mla_model), want)
            wait_stored(daemon, v1)
            # One namespace: the runners' pages are described alike.
            assert len({ns for ns, _ in registered_ranks(daemon.admin_target)}) == 1
        finally:
            v1.close()
        loads(v2, mla_model, want)
        assert stats(daemon).used_bytes == ONE_COPY  # one latent a token, stored once
    finally:
        v2.close()


def test_tp2_stores_one_section_a_row_that_tp1_loads(
    mla_model: Path, cuda_daemon, tmp_path: Path, monkeypatch
) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("TP=2 needs two GPUs")
    daemon = cuda_daemon("--pool-size", "1GiB")
    tp1 = LLMEngine(
        mla_model, tmp_path, readme_kv_config(daemon.target, store_threshold=2), **GPU_ARGS
    )
    try:
        want = computed(tp1, mla_model)
        tp2 = LLMEngine(
            mla_model,
            tmp_path,
            readme_kv_config(daemon.target),
            tensor_parallel_size=2,
            **GPU_ARGS,
        )
        try:
            assert computed(tp2, mla_model)["token_ids"] == want["token_ids"]
            wait_stored(daemon, tp2)
            assert stats(daemon).used_bytes == ONE_COPY  # one section a row, not two
            # Both ranks of the TP=2 engine registered as rank 0 of the TP=1 engine's
            # namespace: a world of one.
            ranks = registered_ranks(daemon.admin_target)
            assert len({ns for ns, _ in ranks}) == 1 and [r for _, r in ranks] == [0, 0, 0]
        finally:
            tp2.close()
        loads(tp1, mla_model, want)
        assert stats(daemon).used_bytes == ONE_COPY
    finally:
        tp1.close()
