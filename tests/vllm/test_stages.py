"""stage_groups: which offloaded groups each pipeline stage holds a layer of, by vLLM's
own split of the layers (client/vllm/stages.py; driven end to end by
tests/vllm/test_pipeline.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvdepot.client.vllm.stages import lacked_groups, stage_groups

pytestmark = pytest.mark.vllm


def names(*layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in layers]


# A hybrid of twelve layers: full attention at 0 and 1, linear attention at 2..11.
GLOBAL = [names(0, 1), names(*range(2, 12))]


@pytest.mark.parametrize(
    ("partition", "held"),
    [
        (None, [(True, True), (False, True)]),  # vLLM's even split: 0-5 and 6-11
        ("1,11", [(True, False), (True, True)]),
        ("2,10", [(True, False), (False, True)]),
    ],
)
def test_every_stage_of_a_global_config(
    monkeypatch: pytest.MonkeyPatch, partition: str | None, held: list
) -> None:
    if partition is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    assert stage_groups(GLOBAL, 12, 2) == held


def test_stage_zeros_names_alone_tell_only_what_stage_zero_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What vLLM 0.33 hands the scheduler: stage 0's projection. A stage none of whose
    layers the names show holds every group, as far as the scheduler can tell."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,5,5")
    assert stage_groups([names(0, 1), []], 12, 3) == [(True, False), (True, True), (True, True)]
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert stage_groups([names(0, 1), names(2, 3, 4, 5)], 12, 2) == [(True, True)] * 2


def test_a_split_or_names_vllm_cannot_read_say_every_stage_holds_every_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,5")  # not 12 layers
    assert stage_groups(GLOBAL, 12, 2) == [(True, True)] * 2
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    assert stage_groups([["embed.attn"], names(7)], 12, 2) == [(True, True)] * 2
    assert stage_groups(GLOBAL, 12, 1) == [(True, True)]


def test_lacked_groups_by_part_names_the_vllm_group_ids() -> None:
    held = [(True, False), (True, True)]
    # Two parts per stage (a sharded daemon), offloaded groups 0 and 2.
    assert lacked_groups([0, 2], held, [0, 0, 1, 1]) == [
        frozenset({2}),
        frozenset({2}),
        frozenset(),
        frozenset(),
    ]


def test_a_ranks_job_keeps_the_keys_and_blocks_of_the_groups_it_holds() -> None:
    """Group-major, as vLLM's specs are: group 0 (3 blocks from logical block 1: two
    chunks of 2 blocks) is left out, group 1 (4 blocks: two chunks) kept, events too."""
    from kvdepot.client.vllm.worker import held_groups_only
    from kvdepot.common.jobs import Job

    keys = [b"k0" + bytes(4), b"k1" + bytes(4), b"k2" + (1).to_bytes(4, "big")]
    keys.append(b"k3" + (1).to_bytes(4, "big"))
    job = Job(
        7,
        1,
        keys,
        [10, 11, 12, 20, 21, 22, 23],
        [3, 4],
        [1, 0],
        key_events=[b"a", b"b", b"c", b"d"],
    )
    kept = held_groups_only(job, [False, True], 2)
    assert (kept.keys, kept.block_ids, kept.group_sizes, kept.block_indices) == (
        keys[2:],
        [20, 21, 22, 23],
        [4],
        [0],
    )
    assert list(kept.key_events) == [b"c", b"d"] and kept.job_id == 7
    assert held_groups_only(job, [True, True], 2).keys == keys
