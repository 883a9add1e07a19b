"""Two nodes (two daemons with their own pools) sharing KV through a real Redis,
driven by vLLM 0.33.0's real Scheduler and worker connectors.

Engine A (another process, node A) computes a prompt; engine B on node B finds
nothing locally, answers RETRY, asks for the step's keys in one Prefetch RPC from
a background thread, and gets an external hit on the next steps with A's bytes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis")

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvdepot.testing.vllm_engine import (
    GroupDef,
    SyntheticEngine,
    prompt_for,
)
from kvdepot.v1 import admin_pb2
from tests.support.fleet_key import shared_key_args
from tests.support.redis_servers import RedisServer, free_ports, require_redis
from tests.vllm.engine_proc import run_engine_process

pytestmark = pytest.mark.vllm


@pytest.fixture
def redis_server(tmp_path):
    require_redis()
    server = RedisServer(tmp_path / "redis", free_ports(1)[0]).start()
    yield server
    server.kill()


@pytest.fixture
def two_nodes(redis_server, daemon_factory):
    a = daemon_factory("--pool-size", "64MiB", "--remote", redis_server.url, *shared_key_args())
    b = daemon_factory("--pool-size", "64MiB", "--remote", redis_server.url, *shared_key_args())
    return a, b


def remote_writes(engine: SyntheticEngine) -> int:
    return engine.manager._client.admin.GetStats(admin_pb2.GetStatsRequest()).remote_writes


def remote_healthy(engine: SyntheticEngine) -> bool:
    return engine.manager._client.admin.GetStats(admin_pb2.GetStatsRequest()).remote_healthy


def test_request_on_node_b_loads_what_node_a_computed(two_nodes, make_engine) -> None:
    a, b = two_nodes
    engine_a = run_engine_process(a.target, prompt_seed=9)

    prompt = prompt_for(9, 160)
    engine_b = make_engine(socket=b.target, num_gpu_blocks=64, enable_kv_events=True)
    engine_b.wait_registered()
    m = engine_b.manager
    assert m.namespace_id == engine_a["namespace"]
    keys = engine_b.offload_keys(prompt)
    engine_b.wait_until(lambda: remote_writes(engine_b) == 0, what="B up")
    assert not any(m.is_ready(k) for k in keys)  # nothing on node B

    engine_b.add_request(prompt)
    engine_b.step()  # RETRY for every key: nothing scheduled, nothing waited for
    assert m.remote_asked == len(keys)
    engine_b.wait_ready(keys)  # fetched into B's pool, announced on Watch
    # Fetched blocks reach vLLM's KV events like stored ones (medium "CPU").
    stored = [
        e for e in engine_b.scheduler_connector.take_events() if type(e).__name__ == "BlockStored"
    ]
    assert {h for e in stored for h in e.block_hashes} >= {
        maybe_convert_block_hash(k[:-4]) for k in keys
    }
    assert all(e.medium == "CPU" for e in stored)
    engine_b.run()
    rec = next(iter(engine_b.records.values()))
    assert rec.external_tokens == 160
    assert m.prefetch_rpcs == 1  # the step's keys in one call
    assert m.remote_gave_up == 0
    assert engine_b.kv_digest(0, 0, rec.block_ids[0][:10]) == engine_a["digest"]


@pytest.mark.parametrize("shape", ["tp2", "hybrid"])
def test_tensor_parallel_and_hybrid_rows_travel_whole(two_nodes, make_engine, shape) -> None:
    a, b = two_nodes
    if shape == "tp2":
        kwargs: dict = {"tp": 2, "num_gpu_blocks": 64}
    else:
        kwargs = {
            "num_gpu_blocks": 96,
            "groups": (
                GroupDef("full", block_size=16, num_layers=2),
                GroupDef(
                    "sliding_window", block_size=32, num_layers=2, sliding_window=64, num_kv_heads=6
                ),
            ),
        }
    engine_a = make_engine(socket=a.target, **kwargs)
    engine_a.wait_registered()
    prompt = prompt_for(11, 300)
    [first] = engine_a.generate([prompt])
    keys = engine_a.offload_keys(prompt)
    engine_a.wait_ready(keys)
    engine_a.wait_until(lambda: remote_writes(engine_a) >= len(keys), what="A's writes")
    want = {
        r: engine_a.kv_digest(r, 0, first.block_ids[0][: len(keys)]) for r in range(engine_a.cfg.tp)
    }

    engine_b = make_engine(socket=b.target, **kwargs)
    engine_b.wait_registered()
    [rec] = engine_b.generate([prompt])
    assert rec.external_tokens >= 256
    n = len(keys) if shape == "tp2" else rec.external_tokens // 16
    for r in range(engine_b.cfg.tp):
        got = engine_b.kv_digest(r, 0, rec.block_ids[0][:n])
        assert got == engine_a.kv_digest(r, 0, first.block_ids[0][:n])
    assert want


def test_a_prompt_no_node_has_is_computed_without_waiting_out_the_deadline(
    two_nodes, make_engine
) -> None:
    _, b = two_nodes
    engine = make_engine(
        socket=b.target, num_gpu_blocks=64, extra_config={"kvdepot_remote_wait_ms": 60000}
    )
    engine.wait_registered()
    [rec] = engine.generate([prompt_for(12, 100)])  # the tier says ABSENT at once
    assert rec.external_tokens == 0
    assert engine.manager.remote_gave_up == 0


def test_a_stalled_store_costs_a_recompute_and_the_tier_comes_back(
    two_nodes, redis_server, make_engine
) -> None:
    """The store frozen (SIGSTOP): requests on node B are computed, none waits past
    the deadline; thawed, node B gets node A's blocks again without restarting."""
    import signal

    a, b = two_nodes
    engine_a = make_engine(socket=a.target, num_gpu_blocks=64)
    engine_b = make_engine(socket=b.target, num_gpu_blocks=64)
    engine_a.wait_registered()
    engine_b.wait_registered()
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        [rec] = engine_b.generate([prompt_for(21, 100)], timeout=60)
        assert rec.external_tokens == 0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    prompt = prompt_for(22, 100)
    [first] = engine_a.generate([prompt])
    keys = engine_a.offload_keys(prompt)
    engine_a.wait_ready(keys)
    engine_a.wait_until(
        lambda: remote_writes(engine_a) >= len(keys), timeout=30, what="A's writes after the thaw"
    )
    # Node B's daemon found the tier down during the stall; it probes it again with
    # a back-off (up to seconds), and asks it for nothing meanwhile.
    engine_b.wait_until(lambda: remote_healthy(engine_b), timeout=30, what="B's tier back up")
    [rec] = engine_b.generate([prompt])
    assert rec.external_tokens == 96
    n = len(keys)
    assert engine_b.kv_digest(0, 0, rec.block_ids[0][:n]) == engine_a.kv_digest(
        0, 0, first.block_ids[0][:n]
    )


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_blocks_from_the_fleet_publish_the_storing_engines_events(
    two_nodes, make_engine, monkeypatch, blocks_per_chunk
) -> None:
    """Engine A on node A stores; its rows reach the fleet with their chunk events.
    Engine B on node B (nothing local) fetches them; engine C beside it, which never
    saw the prompt, knows the rows only from node B's pool: C's BlockStored events
    equal A's (hashes, parent, token ids, block size, group), never placeholders.
    B's `vllm:prompt_tokens_cached_by_source` counts the load as `external_unspecified`
    (vLLM has no source for a shared store)."""
    from collections import Counter

    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from tests.vllm.test_chunk_events import SELF_DESCRIBING, payload, recorder, stored_on

    a, b = two_nodes
    opts = dict(
        num_gpu_blocks=64,
        enable_kv_events=True,
        blocks_per_chunk=blocks_per_chunk,
        extra_config=SELF_DESCRIBING,
    )
    engine_a = make_engine(socket=a.target, **opts)
    engine_a.wait_registered()
    seen_a = recorder(engine_a)
    prompt = prompt_for(41, 192)
    keys = engine_a.offload_keys(prompt)
    engine_a.generate([prompt])
    engine_a.wait_ready(keys)
    engine_a.wait_until(lambda: remote_writes(engine_a) >= len(keys), what="A's writes")
    engine_a.wait_until(lambda: len(stored_on(engine_a, seen_a)) >= len(keys), what="A's events")
    own = stored_on(engine_a, seen_a)
    assert {len(h) for h in own} == {blocks_per_chunk}

    engine_b = make_engine(socket=b.target, **opts)
    engine_c = make_engine(socket=b.target, **opts)
    engine_b.wait_registered()
    engine_c.wait_registered()
    seen_c = recorder(engine_c)
    assert not any(engine_b.manager.is_ready(k) for k in keys)  # nothing on node B
    by_source: Counter = Counter()  # what vLLM's stats loggers read each step, summed
    make_stats = engine_b.scheduler.make_stats

    def recorded(*args, **kwargs):
        stats = make_stats(*args, **kwargs)
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            by_source.update(stats.connector_prefix_cache_stats.hits_by_source)
        return stats

    monkeypatch.setattr(engine_b.scheduler, "make_stats", recorded)
    [rec] = engine_b.generate([prompt])
    tokens = 16 * blocks_per_chunk * len(keys)
    assert rec.external_tokens == tokens
    assert dict(by_source) == {CacheHitSource.EXTERNAL_UNSPECIFIED: tokens}
    engine_c.wait_until(
        lambda: len(stored_on(engine_c, seen_c)) >= len(keys), what="C's events of A's chunks"
    )
    assert sorted(map(payload, stored_on(engine_c, seen_c).values())) == sorted(
        map(payload, own.values())
    )
    # Node B's daemon holds them as node A's does: one per fetched row.
    st = b.stats()
    assert st.chunk_event_rows >= len(keys) and st.remote_hits >= len(keys)
