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
from tests.vllm.test_connector import assert_expected

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
    """Every rank's page of every layer and block: what the model computes for PROMPT."""
    for rank in range(engine.cfg.tp):
        assert_expected(engine, PROMPT, rank, 0, block_ids)


def loads_the_one_section(
    make_engine, daemon, tp: int, namespace: str, keys: list[bytes]
) -> SyntheticEngine:
    """A TP=`tp` engine of the model: in `namespace`, and its ranks load the prompt's 8
    chunks from kvdepot (its KV scrubbed first), every rank's pages byte for byte."""
    engine = mla_engine(make_engine, daemon, tp)
    assert engine.manager.namespace_id == namespace
    engine.wait_ready(keys)
    engine.scrub()
    [loaded] = engine.generate([PROMPT])
    assert loaded.external_tokens == 8 * 16
    assert_every_rank_holds_the_prompt(engine, loaded.block_ids[0][:8])
    return engine


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

    # TP=4 and TP=1 engines of the same model: the same namespace, every rank loads the
    # rows. Then TP=8, once the others closed (one process may hold 16 sessions; a real
    # engine's ranks are processes of their own).
    tp4 = loads_the_one_section(make_engine, daemon, 4, namespace, keys)
    tp1 = loads_the_one_section(make_engine, daemon, 1, namespace, keys)
    for engine in (tp1, tp2, tp4):
        engine.shutdown()
    loads_the_one_section(make_engine, daemon, 8, namespace, keys)
    s = stats(daemon)
    assert (s.ready_blocks, s.used_bytes) == (8, 8 * ROW)  # nothing stored twice
    assert s.pinned_blocks == 0
