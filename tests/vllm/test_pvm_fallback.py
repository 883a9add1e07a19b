"""A CPU engine whose daemon may not read its memory (another uid, no CAP_SYS_PTRACE):
by default its plain KV memory moves into a memfd and the shm path serves it; with
`kvdepot_memory_path: "pvm"` the daemon refuses the pvm path, the worker falls back
to inline transfers and says why. Offloading works either way."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvdepot.testing.vllm_engine import EngineConfig, SyntheticEngine, find_model_dir, prompt_for
from tests.support.unprivileged import unprivileged_daemon

pytestmark = pytest.mark.vllm

MODEL_DIR = find_model_dir(Path(__file__).resolve().parents[2] / "tests")


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="starts a daemon as another uid (needs root)"
)


def offload_round_trip(engine: SyntheticEngine) -> None:
    """Stores a prompt, empties vLLM's cache, and loads it back from the daemon (the
    synthetic model checks the loaded KV: wrong bytes would change its output)."""
    worker = engine.ranks[0].offloading_worker
    prompt = prompt_for(21, 100)
    [first] = engine.generate([prompt])
    engine.wait_ready(engine.offload_keys(prompt))
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([prompt])
    assert again.external_tokens == 96
    assert again.output == first.output
    assert worker.stats["failed_stores"] == 0 and worker.stats["failed_loads"] == 0


@needs_root
def test_plain_memory_moves_into_a_memfd_where_pvm_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvdepot")
    with unprivileged_daemon() as daemon:
        engine = SyntheticEngine(
            EngineConfig(
                socket=daemon.target, model_dir=str(MODEL_DIR), num_gpu_blocks=64, shm=False
            )
        )
        try:
            engine.wait_registered()
            assert engine.ranks[0].offloading_worker.memory.path == "shm"
            assert "plain CPU memory moved into a memfd in place" in caplog.text
            offload_round_trip(engine)
        finally:
            engine.shutdown()


@needs_root
def test_refused_pvm_falls_back_to_inline_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvdepot")
    with unprivileged_daemon() as daemon:
        engine = SyntheticEngine(
            EngineConfig(
                socket=daemon.target,
                model_dir=str(MODEL_DIR),
                num_gpu_blocks=64,
                shm=False,
                extra_config={"kvdepot_memory_path": "pvm"},
            )
        )
        try:
            engine.wait_registered()
            worker = engine.ranks[0].offloading_worker
            assert worker.memory.path == "inline"
            text = caplog.text
            assert "refused the pvm path" in text and "CAP_SYS_PTRACE" in text, text[-3000:]
            assert "moves KV pages inline" in text
            offload_round_trip(engine)
        finally:
            engine.shutdown()
