"""Canonical namespaces: engines of one GQA model at different TP sizes share blocks
(docs/architecture.md §4). With `canonical_layout` and vLLM's certification a row holds
one section per KV head of the model (a unit), a TP=W rank registers as its H/W
consecutive units, and the namespace does not depend on the TP size: a TP=2 engine
loads, head for head, what a TP=4 engine stored, and the other way round. vLLM 0.33.0's
real Scheduler and worker connectors (which derive vLLM's canonical mappings from the
KV tensors), a Llama-shaped config of 4 KV heads, a real daemon; the synthetic model
writes each head's bytes by its model-wide index, so a head loaded into the wrong
place shows."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalPageMapping,
    CopyRun,
)

from kvdepot.client.vllm.canonical import Uncertified, unit_span
from kvdepot.testing.vllm_engine import GroupDef, SyntheticEngine, prompt_for
from tests.support.daemon import stats
from tests.vllm.test_connector import assert_expected

pytestmark = pytest.mark.vllm

MODEL = Path(__file__).resolve().parents[1] / "data" / "hf-config-llama-gqa-tiny"
HEADS = 4  # the model's KV heads: the namespace's units
FULL = (GroupDef(kind="full", num_layers=2),)
PROMPT = prompt_for(11, 8 * 16 + 5)  # 8 full blocks of 16 tokens
# One unit's section of one chunk: 2 layers x 16 tokens x (K + V of 64 bf16 values).
UNIT = 2 * 16 * 2 * 64 * 2
ROW = HEADS * UNIT  # one chunk of the whole model, whatever the TP size


def gqa_engine(make_engine, daemon, tp: int, canonical: bool = True) -> SyntheticEngine:
    engine = make_engine(
        socket=daemon.target,
        groups=FULL,
        model_dir=str(MODEL),
        dtype="bfloat16",
        tp=tp,
        extra_config={"canonical_layout": True} if canonical else {},
    )
    engine.wait_registered()
    return engine


def assert_every_rank_holds_the_prompt(engine: SyntheticEngine, block_ids: list[int]) -> None:
    """Every rank's page of every layer and block: what the model computes for PROMPT."""
    for rank in range(engine.cfg.tp):
        assert_expected(engine, PROMPT, rank, 0, block_ids)


def stores_the_prompt(make_engine, daemon, tp: int) -> tuple[SyntheticEngine, list[bytes]]:
    engine = gqa_engine(make_engine, daemon, tp)
    engine.generate([PROMPT])
    keys = engine.offload_keys(PROMPT)
    assert len(keys) == 8
    engine.wait_ready(keys)
    s = stats(daemon)
    # One row a chunk, a section per KV head: the model's bytes once, at any TP size.
    assert (s.ready_blocks, s.used_bytes) == (8, 8 * ROW), s
    return engine, keys


def loads_the_prompt(make_engine, daemon, tp: int, namespace: str, keys: list[bytes]) -> None:
    """A TP=`tp` engine of the model is in `namespace` and its ranks load the prompt's 8
    chunks from kvdepot (its KV scrubbed first), every rank's pages byte for byte."""
    engine = gqa_engine(make_engine, daemon, tp)
    assert engine.manager.namespace_id == namespace
    engine.wait_ready(keys)
    engine.scrub()
    [loaded] = engine.generate([PROMPT])
    assert loaded.external_tokens == 8 * 16
    assert_every_rank_holds_the_prompt(engine, loaded.block_ids[0][:8])
    assert engine.load_errors == 0 and not engine.invalid_block_ids
    engine.shutdown()


def test_a_tp2_engine_loads_what_a_tp4_engine_stored(daemon, make_engine) -> None:
    tp4, keys = stores_the_prompt(make_engine, daemon, 4)
    namespace = tp4.manager.namespace_id
    loads_the_prompt(make_engine, daemon, 2, namespace, keys)
    loads_the_prompt(make_engine, daemon, 1, namespace, keys)
    # TP=8 over 4 KV heads: two ranks hold each head, and each loads its unit.
    loads_the_prompt(make_engine, daemon, 8, namespace, keys)
    s = stats(daemon)
    assert (s.ready_blocks, s.used_bytes, s.pinned_blocks) == (8, 8 * ROW, 0)  # none stored twice


@pytest.mark.parametrize("stored_by", [2, 8], ids=["tp2", "tp8-heads-shared"])
def test_a_tp4_engine_loads_what_another_tp_size_stored(daemon, make_engine, stored_by) -> None:
    """The other way round; at TP=8 two ranks store each head: the first copies it."""
    engine, keys = stores_the_prompt(make_engine, daemon, stored_by)
    namespace = engine.manager.namespace_id
    engine.shutdown()
    loads_the_prompt(make_engine, daemon, 4, namespace, keys)
    s = stats(daemon)
    assert (s.ready_blocks, s.used_bytes, s.pinned_blocks) == (8, 8 * ROW, 0)


def test_without_canonical_layout_tp_sizes_stay_apart(
    daemon, make_engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset, nothing changes: each TP size is its own namespace of rank sections."""
    caplog.set_level(logging.WARNING, logger="kvdepot")
    tp2 = gqa_engine(make_engine, daemon, 2, canonical=False)
    tp4 = gqa_engine(make_engine, daemon, 4, canonical=False)
    canonical = gqa_engine(make_engine, daemon, 2)
    ids = {e.manager.namespace_id for e in (tp2, tp4, canonical)}
    assert len(ids) == 3
    [stored] = tp2.generate([PROMPT])
    tp2.wait_ready(tp2.offload_keys(PROMPT))
    [missed] = tp4.generate([PROMPT])
    assert missed.external_tokens == 0
    assert not [r for r in caplog.records if "canonical_layout" in r.getMessage()]


def _ref(page: int, runs: tuple[CopyRun, ...], canonical: int) -> CanonicalKVCacheRef:
    mapping = CanonicalPageMapping(
        canonical_page_size_bytes=canonical,
        local_page_size_bytes=page,
        runs=runs,
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=True,
    )
    return CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=page, mapping=mapping)


def test_a_rank_holds_the_units_its_page_covers() -> None:
    """Rank 1 of TP=2 over 4 heads of 512 bytes: its page is heads 2 and 3."""
    ref = _ref(1024, (CopyRun(0, 1024, 1024, 1, 1024, 1024),), 2048)
    span = unit_span(CanonicalKVCaches([], [[ref, ref]]), 4)
    assert (span.first, span.count, span.layer_pages) == (2, 2, [[512, 512]])


@pytest.mark.parametrize(
    "ref",
    [
        CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=1024, mapping=None),
        # NHD: a rank's heads are strided through the canonical page, not one slice.
        _ref(1024, (CopyRun(0, 0, 64, 16, 64, 128),), 2048),
    ],
    ids=["uncertified", "strided"],
)
def test_a_page_that_is_not_head_slices_is_refused(ref: CanonicalKVCacheRef) -> None:
    with pytest.raises(Uncertified):
        unit_span(CanonicalKVCaches([], [[ref]]), 4)
