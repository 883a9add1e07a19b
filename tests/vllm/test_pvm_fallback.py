"""A CPU engine whose daemon may not read its memory: the worker falls back to
inline transfers, says why in the log, and offloading still works."""

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


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a daemon as another uid (needs root)")
def test_refused_pvm_falls_back_to_inline_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvdepot")
    with unprivileged_daemon() as daemon:
        engine = SyntheticEngine(
            EngineConfig(
                socket=daemon.target,
                model_dir=str(MODEL_DIR),
                num_gpu_blocks=64,
                shm=False,
            )
        )
        try:
            engine.wait_registered()
            worker = engine.ranks[0].offloading_worker
            assert worker.memory.path == "inline"
            text = caplog.text
            assert "refused the pvm path" in text and "CAP_SYS_PTRACE" in text, text[-3000:]
            assert "moves KV pages inline" in text
            prompt = prompt_for(21, 100)
            engine.generate([prompt])
            engine.wait_ready(engine.offload_keys(prompt))
            engine.reset_gpu_prefix_cache()
            [again] = engine.generate([prompt])
            assert again.external_tokens == 96
            assert worker.stats["failed_stores"] == 0 and worker.stats["failed_loads"] == 0
        finally:
            engine.shutdown()
