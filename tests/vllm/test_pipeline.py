"""Pipeline parallelism with stages of unequal layer counts (docs/architecture.md §4),
driven by vLLM 0.33.0's real Scheduler and real WORKER-role connectors against a real
`kvdepot serve`.

Each stage's ranks hold that stage's layers only, split as vLLM splits a model (five
layers on two stages: three and two), so a stage-0 rank's section of a row is longer
than a stage-1 rank's. Each stage is a namespace part of its own (one per stage and
shard on a sharded daemon), and the scheduler counts a key ready only when every part
holds it: a row is a hit only once every rank of every stage wrote.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from kvdepot.common.shards import engine_parts, first_shard
from kvdepot.testing.vllm_engine import GroupDef, SyntheticEngine, prompt_for
from tests.vllm.test_connector import assert_expected, pages
from tests.vllm.test_groups import namespace_infos
from tests.vllm.test_shards import shard_admin, wait_shards

pytestmark = pytest.mark.vllm

FIVE_LAYERS = (GroupDef("full", block_size=16, num_layers=5),)
PROMPT = prompt_for(41, 100)  # 6 full blocks of 16 tokens


def behind_by_one_stage(engine: SyntheticEngine, prompt: list[int]) -> None:
    """Adds `prompt` with the last stage's ranks paused (their store jobs stay queued)
    and steps until every first-stage rank has stored its sections."""
    late = [r for r in engine.ranks if engine.stage(r.rank) == 1]
    for rank in late:
        rank.paused = True
    engine.add_request(prompt)
    early = [r.offloading_worker for r in engine.ranks if engine.stage(r.rank) == 0]
    engine.wait_until(
        lambda: (engine.step(), time.sleep(0.01), all(w.stats["stores"] >= 1 for w in early))[2],
        what="the first stage's stores",
    )
    for rank in late:
        rank.paused = False


@pytest.mark.parametrize(
    ("shards", "tp", "split"),
    [(1, 2, None), (4, 2, None), (2, 1, None), (1, 2, "1,4")],
    ids=["one-shard", "a-part-a-rank", "a-stage-a-shard", "VLLM_PP_LAYER_PARTITION"],
)
def test_unequal_stages_store_and_reload_byte_for_byte(
    daemon_factory,
    make_engine,
    monkeypatch: pytest.MonkeyPatch,
    shards: int,
    tp: int,
    split: str | None,
) -> None:
    """vLLM's even split of five layers is three and two; VLLM_PP_LAYER_PARTITION may
    make the last stage the larger one. On one shard each stage is a part; on four, each
    rank; on two, TP=1, each stage a shard."""
    if split is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", split)
    stage_layers = [3, 2] if split is None else [int(n) for n in split.split(",")]
    d = daemon_factory("--pool-size", "64MiB", *(("--shards", str(shards)) if shards > 1 else ()))
    wait_shards(d, shards)
    engine = make_engine(socket=d.target, groups=FIVE_LAYERS, tp=tp, pp=2, num_gpu_blocks=64)
    engine.wait_registered()
    world = 2 * tp
    layers = [len(engine.group_layers(0, r)) for r in range(world)]
    assert layers == [stage_layers[0]] * tp + [stage_layers[1]] * tp
    ns = engine.manager.namespace_id
    # Every rank, of either stage, computed the scheduler's namespace.
    assert {r.offloading_worker._namespace_id for r in engine.ranks} == {ns}

    keys = engine.offload_keys(PROMPT)
    behind_by_one_stage(engine, PROMPT)
    # The first stage's sections are written, the last stage's are not: no hit yet.
    assert not any(engine.manager.is_ready(k) for k in keys)
    engine.run()
    engine.wait_ready(keys)
    first = engine.records["req-0"]
    before = [pages(engine, r, 0, first.block_ids[0][:6]) for r in range(world)]

    engine.reset_gpu_prefix_cache()  # and scrub every block of every rank
    [second] = engine.generate([PROMPT])
    assert second.external_tokens == 96
    for r in range(world):  # each rank got its own stage's layers back, byte for byte
        after = pages(engine, r, 0, second.block_ids[0][:6])
        assert all(bool((a == b).all()) for a, b in zip(before[r], after, strict=True)), r
        assert_expected(engine, PROMPT, r, 0, second.block_ids[0][:6])
    assert not engine.load_errors and not engine.invalid_block_ids
    assert sum(r.offloading_worker.stats["failed_stores"] for r in engine.ranks) == 0

    # What the daemon holds: one namespace part per stage (and shard), whose rows are
    # that part's ranks' sections of that stage's layers.
    page = engine.ranks[0].u8[engine.group_layers(0)[0]][0].numel()
    parts = engine_parts(world, shards, first_shard(ns, shards, world), 2)
    for part in parts:
        target = shard_admin(d, part.shard) if shards > 1 else d.admin_target
        info = namespace_infos(target)[part.namespace_id(ns)]
        assert info.world_size == part.world_size
        assert list(info.slot_bytes) == [part.world_size * stage_layers[part.stage] * page]
        assert info.ready_blocks == 6


# A hybrid of two groups: layers 0-2 are group 0's, 3-4 group 1's. Split "2,3", stage
# 0 holds layers 0-1 (group 0 alone) and stage 1 layers 2-4 (both groups): vLLM keeps
# group 1 on stage 0's workers with no layers.
HYBRID = (
    GroupDef("full", block_size=16, num_layers=3),
    GroupDef("full", block_size=16, num_layers=2),
)


@pytest.mark.parametrize(("shards", "tp"), [(1, 2), (2, 1)], ids=["one-shard", "a-stage-a-shard"])
def test_a_stage_with_no_layer_of_a_group_stores_and_reloads_byte_for_byte(
    daemon_factory, make_engine, monkeypatch: pytest.MonkeyPatch, shards: int, tp: int
) -> None:
    """Stage 0's part holds group 0's keys alone, stage 1's both groups'; a key of group
    1 is a hit once stage 1 wrote it, a key of group 0 once both stages did."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,3")
    d = daemon_factory("--pool-size", "64MiB", *(("--shards", str(shards)) if shards > 1 else ()))
    wait_shards(d, shards)
    engine = make_engine(socket=d.target, groups=HYBRID, tp=tp, pp=2, num_gpu_blocks=64)
    engine.wait_registered()
    world = 2 * tp
    early = [r for r in range(world) if engine.stage(r) == 0]
    assert [len(engine.group_layers(1, r)) for r in range(world)] == [0] * tp + [2] * tp
    assert [len(engine.group_layers(0, r)) for r in range(world)] == [2] * tp + [1] * tp
    ns = engine.manager.namespace_id
    assert {r.offloading_worker._namespace_id for r in engine.ranks} == {ns}

    keys = {g: engine.offload_keys(PROMPT, g) for g in (0, 1)}
    behind_by_one_stage(engine, PROMPT)
    # Stage 0 wrote group 0's sections; stage 1 wrote nothing yet: no key is a hit.
    assert not any(engine.manager.is_ready(k) for g in (0, 1) for k in keys[g])
    engine.run()
    engine.wait_ready(keys[0] + keys[1])
    first = engine.records["req-0"]
    before = {
        (r, g): pages(engine, r, g, first.block_ids[g][:6]) for r in range(world) for g in (0, 1)
    }
    assert not before[(early[0], 1)]  # stage 0 holds no page of group 1

    engine.reset_gpu_prefix_cache()  # and scrub every block of every rank
    [second] = engine.generate([PROMPT])
    assert second.external_tokens == 96
    for r in range(world):
        for g in (0, 1):
            after = pages(engine, r, g, second.block_ids[g][:6])
            assert len(after) == len(before[(r, g)])
            assert all(bool((a == b).all()) for a, b in zip(before[(r, g)], after, strict=True))
            assert_expected(engine, PROMPT, r, g, second.block_ids[g][:6])
    assert not engine.load_errors and not engine.invalid_block_ids
    for counter in ("failed_stores", "failed_loads"):
        assert sum(r.offloading_worker.stats[counter] for r in engine.ranks) == 0

    # Stage 0's part declared group 0 alone and holds its 6 rows; stage 1's, both.
    parts = engine_parts(world, shards, first_shard(ns, shards, world), 2)
    for part in parts:
        target = shard_admin(d, part.shard) if shards > 1 else d.admin_target
        info = namespace_infos(target)[part.namespace_id(ns)]
        assert tuple(info.group_ids) == ((0,) if part.stage == 0 else (0, 1))
        assert info.ready_blocks == (6 if part.stage == 0 else 12)


def test_a_later_stage_with_no_layer_of_a_group_misses_but_never_loads_wrong_bytes(
    daemon, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split "4,1": stage 1 holds layer 4 alone, no layer of group 0. vLLM hands the
    scheduler stage 0's layers only, so it cannot tell; it waits for stage 1's part to
    hold group 0's keys, which it never does: every lookup misses, and both stages'
    stores succeed."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,1")
    engine = make_engine(socket=daemon.target, groups=HYBRID, tp=1, pp=2, num_gpu_blocks=64)
    engine.wait_registered()
    assert [len(engine.group_layers(0, r)) for r in range(2)] == [3, 0]
    engine.generate([PROMPT])
    keys = engine.offload_keys(PROMPT, 1)
    engine.wait_ready(keys)  # group 1's keys: both stages hold layers of it
    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([PROMPT])
    assert second.external_tokens == 0
    assert not any(engine.manager.is_ready(k) for k in engine.offload_keys(PROMPT, 0))
    assert not engine.load_errors
    assert sum(r.offloading_worker.stats["failed_stores"] for r in engine.ranks) == 0
    assert sum(r.offloading_worker.stats["stores"] for r in engine.ranks) >= 2
