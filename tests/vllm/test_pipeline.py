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
