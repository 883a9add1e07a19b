"""MLA: one copy a row (docs/architecture.md §5). Every rank of an MLA model holds the
same latent KV; vLLM 0.33 says so (`OffloadingConfig.replicated_layout`, from
`kv_tp_replicas`). A row is then one section: the first rank to store it copies it,
the others' stores find it present, every rank loads it, and the namespace does not
depend on the TP size, so MLA engines at TP=1, 2, 4 and 8 share every block. vLLM 0.33.0's
real Scheduler and worker connectors, a DeepSeek-V2-shaped config (576 values a
token), a real daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvdepot.testing.vllm_engine import GroupDef, SyntheticEngine, prompt_for
from tests.support.daemon import stats

pytestmark = pytest.mark.vllm

MODEL = Path(__file__).resolve().parents[1] / "data" / "hf-config-deepseek-v2-tiny"
MLA = (GroupDef(kind="mla", num_layers=2),)
PROMPT = prompt_for(7, 8 * 16 + 5)  # 8 full blocks of 16 tokens
ROW = 2 * 16 * 576 * 2  # one chunk of one rank: 2 layers x 16 tokens x 576 bf16 values


def mla_engine(make_engine, daemon, tp: int) -> SyntheticEngine:
    engine = make_engine(
        socket=daemon.target, groups=MLA, model_dir=str(MODEL), dtype="bfloat16", tp=tp
    )
    engine.wait_registered()
    return engine


def assert_every_rank_holds_the_prompt(engine: SyntheticEngine, block_ids: list[int]) -> None:
    for rank in range(engine.cfg.tp):
        for i, block in enumerate(block_ids):
            for name in engine.group_layers(0):
                want = engine.expected_page(PROMPT, 0, i, name, rank)
                assert bool((engine.page(rank, name, block) == want).all()), (rank, name, i)


def test_an_mla_row_is_one_copy_shared_by_every_tp_size(daemon, make_engine) -> None:
    tp2 = mla_engine(make_engine, daemon, 2)
    assert tp2.scheduler_connector is not None
    [first] = tp2.generate([PROMPT])
    keys = tp2.offload_keys(PROMPT)
    assert len(keys) == 8
    tp2.wait_ready(keys)
    s = stats(daemon)
    # One section a row: the bytes of ONE rank's chunk, not two.
    assert (s.ready_blocks, s.used_bytes) == (8, 8 * ROW), s
    namespace = tp2.manager.namespace_id

    # A TP=4 engine of the same model: the same namespace; its four ranks load the rows.
    tp4 = mla_engine(make_engine, daemon, 4)
    assert tp4.manager.namespace_id == namespace
    tp4.wait_ready(keys)
    tp4.scrub()
    [loaded] = tp4.generate([PROMPT])
    assert loaded.external_tokens == 8 * 16
    assert_every_rank_holds_the_prompt(tp4, loaded.block_ids[0][:8])
    # And TP=1 too (no replication to say: the same one-rank layout).
    tp1 = mla_engine(make_engine, daemon, 1)
    assert tp1.manager.namespace_id == namespace
    tp1.wait_ready(keys)
    tp1.scrub()
    [one] = tp1.generate([PROMPT])
    assert one.external_tokens == 8 * 16
    assert_every_rank_holds_the_prompt(tp1, one.block_ids[0][:8])
    # And TP=8: eight ranks load the one section; still one copy in the pool. (The
    # engines before it close first: one process may hold 16 sessions, and a real
    # engine's ranks are processes of their own.)
    for engine in (tp1, tp2, tp4):
        engine.shutdown()
    tp8 = mla_engine(make_engine, daemon, 8)
    assert tp8.manager.namespace_id == namespace
    tp8.wait_ready(keys)
    tp8.scrub()
    [eight] = tp8.generate([PROMPT])
    assert eight.external_tokens == 8 * 16
    assert_every_rank_holds_the_prompt(tp8, eight.block_ids[0][:8])
    s = stats(daemon)
    assert (s.ready_blocks, s.used_bytes) == (8, 8 * ROW)  # nothing stored twice
    assert s.pinned_blocks == 0
