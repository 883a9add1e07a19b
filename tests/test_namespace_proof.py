"""check_declaration: a layout declared under a digest id must be the one its inputs
describe (server/core/namespace_proof.py; the attack: tests/security/test_squatting.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvdepot.common.chunks import LayoutError
from kvdepot.common.namespace_digest import digest_id
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.namespace_proof import MAX_DIGEST_INPUTS, check_declaration
from tests.support.engine import Geometry

GEO = Geometry(groups=[[4096, 4096], [1024]], world_size=4).digested("model")


def layout(geo: Geometry, namespace: str | None = None) -> NamespaceLayout:
    return NamespaceLayout(
        id=namespace or geo.namespace,
        world_size=geo.world_size,
        blocks_per_chunk=geo.blocks_per_chunk,
        groups=tuple(tuple(g) for g in geo.groups),
    )


def test_the_layout_its_inputs_describe_passes_under_the_id_and_ids_derived_from_it() -> None:
    for suffix in ("", ".r1-" + "f" * 32, ".s1of2", ".r2-" + "0" * 32 + ".s0of4"):
        check_declaration(layout(GEO, GEO.namespace + suffix), GEO.digest_inputs)
    half = replace(GEO, world_size=2)  # a shard's rows: half the world's ranks
    check_declaration(layout(half, GEO.namespace + ".s0of2"), GEO.digest_inputs)
    check_declaration(layout(half, GEO.namespace + ".pp1of2"), GEO.digest_inputs)  # a stage's


def test_an_id_of_another_form_is_the_clients_own() -> None:
    check_declaration(layout(GEO, "my-namespace"), "")
    check_declaration(layout(GEO, "kvd1-" + "a" * 39), "")  # not a digest's length


@pytest.mark.parametrize(
    "geo",
    [
        replace(GEO, groups=[[4096, 8192], [1024]]),
        replace(GEO, groups=[[4096, 4096], [2048]]),
        replace(GEO, groups=[[4096, 4096]]),
        replace(GEO, blocks_per_chunk=4),
        replace(GEO, world_size=3),
        # A share of the ranks passes in a part's id only: under the whole id it would
        # lock out the engines (a canonical namespace's units, a TP=4 engine's ranks).
        replace(GEO, world_size=2),
    ],
    ids=["several-sizes", "other-page", "fewer-groups", "blocks-per-chunk", "world-size", "share"],
)
def test_another_layout_under_the_id_is_refused(geo: Geometry) -> None:
    with pytest.raises(LayoutError, match="digest of its inputs"):
        check_declaration(layout(geo, GEO.namespace), GEO.digest_inputs)


def test_inputs_must_hash_to_the_id_and_be_a_json_object() -> None:
    other = replace(GEO, groups=[[8192, 8192], [1024]]).digested("model")
    with pytest.raises(LayoutError, match="inputs of another id"):
        check_declaration(layout(other, GEO.namespace), other.digest_inputs)
    with pytest.raises(LayoutError, match="no digest_inputs"):
        check_declaration(layout(GEO), "")
    for bad, why in [("{", "not JSON"), ("[1]", "not a JSON object")]:
        with pytest.raises(LayoutError, match=why):
            check_declaration(layout(GEO), bad)
    with pytest.raises(LayoutError, match="more than"):
        check_declaration(layout(GEO), " " * (MAX_DIGEST_INPUTS + 1))


def test_a_group_of_several_page_sizes_must_add_up_to_the_inputs_block_bytes() -> None:
    """vLLM's scheduler sees such a group (MLA with a DSA indexer) flattened to its first
    layer's page; the real pages then sum to one GPU block's bytes."""
    fields = json.loads(GEO.digest_inputs)
    fields["groups"] = [{"group_id": 0, "num_layers": 3, "layer_page_bytes": [4096] * 3}]
    fields["worker_bytes_per_block"] = 4096 + 2 * 512
    inputs = json.dumps(fields)
    real = NamespaceLayout(
        id=digest_id(fields), world_size=4, blocks_per_chunk=2, groups=((4096, 512, 512),)
    )
    check_declaration(real, inputs)
    for pages in [(4096, 1024, 0 + 1), (512, 4096, 512), (4096, 4096, 4096 + 1)]:
        with pytest.raises(LayoutError, match="other page sizes"):
            check_declaration(replace(real, groups=(pages,)), inputs)


def test_a_stage_part_may_declare_the_groups_it_has_layers_of_alone() -> None:
    """With pipeline stages the inputs count no layers (each stage's are its own), and a
    stage may hold no layer of a group (vLLM keeps the group there with no layers): its
    part declares the groups it holds. Under the whole id, a shard's part, in another
    order, with other pages or of inputs that count layers, a share is still refused."""
    fields = json.loads(GEO.digest_inputs)
    for g, page in zip(fields["groups"], (4096, 1024), strict=True):
        g.update(num_layers=0, layer_page_bytes=[page])
    fields["worker_bytes_per_block"] = 0
    inputs, staged = json.dumps(fields), digest_id(fields)

    def declared(suffix: str, groups: tuple, group_ids: tuple) -> NamespaceLayout:
        return NamespaceLayout(
            id=staged + suffix,
            world_size=2,
            blocks_per_chunk=2,
            groups=groups,
            group_ids=group_ids,
        )

    both = declared(".pp1of2", ((4096,), (1024, 1024)), (0, 1))
    check_declaration(both, inputs)
    check_declaration(declared(".pp0of2", ((4096, 4096, 4096),), (0,)), inputs)
    check_declaration(declared(".pp1of2", ((1024,),), (1,)), inputs)
    check_declaration(declared(".s1of2.pp0of2", ((1024,),), (1,)), inputs)  # and a shard's
    for refused in [
        declared("", ((4096,),), (0,)),  # the whole id
        declared(".s0of2", ((4096,),), (0,)),  # a shard's part, of no stage
        declared(".pp0of2", ((1024,), (4096,)), (1, 0)),  # another order
        declared(".pp0of2", ((1024,),), (2,)),  # a group the inputs do not have
        declared(".pp0of2", ((2048,),), (1,)),  # another page
    ]:
        with pytest.raises(LayoutError, match="digest of its inputs"):
            check_declaration(refused, inputs)
    # Inputs that count each group's layers (an engine without stages): all or nothing.
    unstaged = json.loads(GEO.digest_inputs)
    with pytest.raises(LayoutError, match="other groups"):
        check_declaration(
            NamespaceLayout(
                id=GEO.namespace + ".pp0of2",
                world_size=2,
                blocks_per_chunk=2,
                groups=((4096, 4096),),
                group_ids=(0,),
            ),
            json.dumps(unstaged),
        )
