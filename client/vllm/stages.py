"""Which offloaded groups each pipeline stage holds a layer of (docs/architecture.md §4).

vLLM keeps every group of the model on every stage's workers, with no layers on a
stage that holds none of the group's (`_project_kv_cache_groups_to_worker`: a hybrid
model whose few full-attention layers all sit on stage 0). Such a stage's workers
declare the groups they hold alone, and their namespace part never holds a key of the
others; the scheduler must then count such a key as held there, or it would never be
a hit. `stage_groups` tells it which, from the layer names it sees and vLLM's own
split of the layers over the stages (`get_pp_indices`, which honours
VLLM_PP_LAYER_PARTITION).

vLLM 0.33 hands the scheduler the first stage's configuration, so its layer names are
stage 0's alone: a stage none of whose layers the names show is taken to hold every
group (its part is waited for, never skipped). A group stage 0 holds no layer of is
then known; a later stage that lacks a group is not, and such keys stay misses (safe:
never a hit that a part cannot serve). Given every stage's names (one global config),
every stage's share is known. Pure functions of their arguments.
"""

from __future__ import annotations

from collections.abc import Sequence


def stage_groups(
    group_layers: Sequence[Sequence[str]], num_layers: int, pp_size: int
) -> list[tuple[bool, ...]]:
    """Per stage of `pp_size`, per group of `group_layers` (each group's layer names
    as the scheduler sees them): whether the stage holds a layer of the group.
    `num_layers`: the model's decoder layers, which vLLM splits over the stages."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.utils import extract_layer_index

    every = [tuple(True for _ in group_layers)] * pp_size
    if pp_size == 1:
        return every
    try:
        starts = [get_pp_indices(num_layers, s, pp_size)[0] for s in range(1, pp_size)]
        stages_of_group = [
            {sum(extract_layer_index(name) >= start for start in starts) for name in names}
            for names in group_layers
        ]
    except (AssertionError, ValueError):  # a split or names vLLM cannot read: nothing known
        return every
    seen = set().union(*stages_of_group)
    return [
        tuple(stage not in seen or stage in stages for stages in stages_of_group)
        for stage in range(pp_size)
    ]


def lacked_groups(
    group_ids: Sequence[int], held: Sequence[Sequence[bool]], part_stages: Sequence[int]
) -> list[frozenset[int]]:
    """Per namespace part (each of `part_stages`' stage), the ids of the groups of
    `group_ids` its stage holds no layer of (`held`: `stage_groups`)."""
    return [
        frozenset(g for g, has in zip(group_ids, held[stage], strict=True) if not has)
        for stage in part_stages
    ]
