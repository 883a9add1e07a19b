"""Jobs for a namespace that is still registering are held, not failed.

After a connector `reset_cache()` the scheduler moves to a new namespace; the worker
learns it from the first job that names it and registers in the background. That
job waits for the registration (bounded by kvdepot_job_timeout_s) instead of being
dropped. Driven by vLLM 0.33.0's real Scheduler against a real `kvdepot serve`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm")

from kvdepot.testing.vllm_engine import (
    prompt_for,
)

pytestmark = pytest.mark.vllm


def test_first_store_after_a_connector_reset_is_stored(daemon, make_engine) -> None:
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    engine.generate([prompt_for(9, 100)])
    engine.wait_ready(engine.offload_keys(prompt_for(9, 100)))
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    new_ns = engine.manager.namespace_id
    worker = engine.ranks[0].offloading_worker

    # No wait_registered(): the very first store job names the new namespace.
    prompt = prompt_for(12, 100)
    [first] = engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)  # stored in the new namespace, not dropped
    assert engine.manager._client.lookup(new_ns, keys) == [True] * 6
    assert worker.stats["held"] >= 1 and worker.stats["failed_stores"] == 0

    # And it loads back, byte for byte.
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([prompt])
    assert again.external_tokens == 96
    for name in engine.group_layers(0):
        for i, b in enumerate(again.block_ids[0][:6]):
            want = engine.expected_page(prompt, 0, i, name, 0)
            assert bool((engine.page(0, name, b) == want).all()), f"{name} block {i}"


def test_held_job_fails_after_the_job_timeout(daemon, make_engine) -> None:
    """A registration that cannot finish (a frozen daemon) fails the held job after
    kvdepot_job_timeout_s; the engine goes on."""
    engine = make_engine(
        socket=daemon.target, num_gpu_blocks=64, extra_config={"kvdepot_job_timeout_s": 0.5}
    )
    engine.wait_registered()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    worker = engine.ranks[0].offloading_worker
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        [rec] = engine.generate([prompt_for(13, 100)], timeout=20)
        took = time.monotonic() - t
    finally:
        daemon.kill()
    assert rec.finished
    assert worker.stats["held"] >= 1 and worker.stats["failed_stores"] >= 1
    assert 0.5 <= took < 5.0, took
