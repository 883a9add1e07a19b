"""A full pool keeps loadable prefixes (docs/architecture.md §6): vLLM 0.33.0's
real Scheduler and worker connectors against a real `kvdepot serve` whose pool is smaller
than the prompts offered. What a lookup reaches is a prompt's leading chunks, so that is
what the pool must keep: no chunk behind a miss, and the prompts used again over those
that were not."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

pytest.importorskip("vllm")

from kvdepot.testing.vllm_engine import SyntheticEngine, prompt_for
from tests.support.prefixes import reach as prefix_reach

pytestmark = pytest.mark.vllm

CHUNK_TOKENS = 16
# The synthetic model's chunk (2 layers, 12 KV heads of 64, fp16, 16 tokens) is 96 KiB:
# an 8 MiB pool holds 85 of them.
POOL = "8MiB"
POOL_CHUNKS = 85
# Chunked prefill (vLLM's default for long prompts): 32 chunks a step, so a prompt is
# stored over several jobs, each within a session's writing quota (half the pool).
ENGINE = {"num_gpu_blocks": 160, "max_num_batched_tokens": 512}


def prompt(seed: int, chunks: int) -> list[int]:
    return prompt_for(seed, chunks * CHUNK_TOKENS)


def reach(engine: SyntheticEngine, keys: Sequence[bytes]) -> tuple[int, int]:
    """(the leading chunks the scheduler's lookups reach, the chunks held behind)."""
    return prefix_reach([engine.manager.is_ready(k) for k in keys])


@pytest.fixture
def small_pool(daemon_factory):
    return daemon_factory("--pool-size", POOL)


def test_a_full_pool_keeps_the_leading_chunks_of_the_prompt_it_evicts_from(
    small_pool, make_engine
) -> None:
    engine = make_engine(socket=small_pool.target, **ENGINE)
    engine.wait_registered()
    p1, p2 = prompt(1, 40), prompt(2, 60)
    k1, k2 = engine.offload_keys(p1), engine.offload_keys(p2)
    engine.generate([p1])
    engine.wait_ready(k1)
    engine.generate([p2])
    engine.wait_ready(k2)
    engine.wait_until(lambda: reach(engine, k1)[0] < 40, what="prompt 1 evicted from")
    lead, behind = reach(engine, k1)
    # 100 chunks in an 85-chunk pool: prompt 1 loses its tail (before: its head, 0 of 40
    # chunks reachable and 25 held behind the miss).
    assert lead >= POOL_CHUNKS - 60 - 5 and lead >= 20, (lead, behind)
    assert behind == 0

    # The prompt comes back from kvdepot, its leading chunks, byte for byte.
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([p1])
    assert again.external_tokens == lead * CHUNK_TOKENS
    for i, block in enumerate(again.block_ids[0][:lead]):
        for name in engine.group_layers(0):
            want = engine.expected_page(p1, 0, i, name, 0)
            assert bool((engine.page(0, name, block) == want).all()), (name, i)


@pytest.mark.parametrize("how", ["loaded", "offered"])
def test_a_prefix_used_again_survives_a_flood_that_evicts_one_that_was_not(
    small_pool, make_engine, how: str
) -> None:
    """A later request reaches prompt A's first 20 chunks again, by loading them from
    kvdepot or (its GPU cache still holding them) offering them again; prompt B is never
    used again. A flood then evicts 40 chunks: B's, and A's tail, never A's reused head."""
    engine = make_engine(socket=small_pool.target, **ENGINE)
    engine.wait_registered()
    a, b = prompt(1, 30), prompt(2, 30)
    ka, kb = engine.offload_keys(a), engine.offload_keys(b)
    engine.generate([a])
    engine.generate([b])
    engine.wait_ready(ka + kb)
    reuse = a[: 20 * CHUNK_TOKENS] + prompt(3, 10)
    if how == "loaded":
        engine.reset_gpu_prefix_cache()
    [again] = engine.generate([reuse])
    if how == "loaded":
        assert again.external_tokens == 20 * CHUNK_TOKENS
    else:
        assert again.local_tokens == 20 * CHUNK_TOKENS and again.external_tokens == 0
    engine.wait_ready(engine.offload_keys(reuse))
    # 70 chunks held; 55 more: 40 must go.
    flood = prompt(4, 55)
    engine.generate([flood])
    engine.wait_ready(engine.offload_keys(flood))
    engine.wait_until(lambda: reach(engine, kb)[0] == 0, what="prompt B evicted")
    assert reach(engine, ka) == (20, 0)
    assert reach(engine, kb) == (0, 0)
    assert reach(engine, engine.offload_keys(reuse)) == (30, 0)


def test_store_threshold_2_stores_a_chunk_on_its_second_offer(small_pool, make_engine) -> None:
    """vLLM's `store_threshold`, with vLLM's meaning: a prompt seen once is not stored."""
    engine = make_engine(socket=small_pool.target, extra_config={"store_threshold": 2}, **ENGINE)
    engine.wait_registered()
    p = prompt(1, 10)
    keys = engine.offload_keys(p)
    [first] = engine.generate([p])  # its stores done when this returns: none offered
    time.sleep(0.2)  # (a STORED event would have reached the mirror by now)
    assert not any(engine.manager.is_ready(k) for k in keys)
    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([p])  # offered again: stored now
    engine.wait_ready(keys)
    assert first.external_tokens == second.external_tokens == 0
    engine.reset_gpu_prefix_cache()
    [third] = engine.generate([p])
    assert third.external_tokens == 10 * CHUNK_TOKENS


def test_an_engines_eviction_policy_is_the_pools_or_it_says_so(
    daemon_factory, make_engine, caplog
) -> None:
    """vLLM's `eviction_policy` key: the pool is the node's, its policy the daemon's; an
    engine that expects another says so once (naming the daemon's setting), one that
    expects the daemon's or names none says nothing, and a name vLLM has not is refused."""
    caplog.set_level("WARNING", logger="kvdepot.vllm.manager")
    d = daemon_factory("--pool-size", POOL, "--eviction-policy", "arc")
    said = []
    for wanted in ("lru", "arc", ""):
        caplog.clear()
        engine = make_engine(socket=d.target, extra_config={"eviction_policy": wanted}, **ENGINE)
        engine.wait_registered()
        assert engine.manager._client.hello.eviction_policy == "arc"
        said.append([r.getMessage() for r in caplog.records if "eviction_policy" in r.getMessage()])
        engine.shutdown()
    assert len(said[0]) == 1 and "evicts by 'arc'" in said[0][0], said
    assert "--eviction-policy lru" in said[0][0]
    assert said[1:] == [[], []]
    with pytest.raises(ValueError, match=r"eviction_policy.*must be one of lru, arc"):
        make_engine(socket=d.target, extra_config={"eviction_policy": "fifo"})
