"""A declared layout checked against the namespace id it claims (sans-I/O).

An engine's namespace id is a digest of its inputs (kvdepot.common.namespace_digest),
so anyone with the same model can compute an unsalted one. The first declaration of
an id fixes its layout; were any layout accepted, a process could declare a known id
first with another layout, and the real engine's registration would be refused for
good. A layout declared under an id of the digest's form must therefore come with the
digest's inputs: the daemon recomputes the id from them and checks that the layout is
the one they describe (blocks per chunk, group ids, layers per group, each group's
pages, the ranks a row is made of: all of them, but in a shard's or a pipeline stage's
part a share). Ids of any other form are free text of the
client's own choosing (docs/security.md).

One thing the inputs state only in sum: vLLM's scheduler sees a group of layers with
pages of several sizes (UniformTypeKVCacheSpecs: MLA with a DSA indexer) flattened to
its first layer's page, and the digest is computed alike on both sides. Such a group
is declared with its real pages: the first must be the inputs' page, and the pages of
every group must add up to the inputs' bytes of one GPU block (`worker_bytes_per_block`:
vLLM allocates such a group's layers in one tensor). A model of equal pages has one
page's bytes there, so no declaration of several page sizes passes for it.

Pipeline stages: the inputs of an engine with stages leave out what each stage decides
(its layers, its bytes of one block) and keep one layer's page per group, so a stage's
declaration is checked for its first page alone. Such an id's layer counts are pinned
by nothing but its salt. A stage may hold no layer of a group (vLLM's hybrid models:
all full-attention layers on stage 0), so a stage's part (an id naming a `.pp` part)
may declare some of the inputs' groups alone, in their order; the whole id and a
shard's part may not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvdepot.common.chunks import LayoutError
from kvdepot.common.namespace_digest import digest_id, digest_of
from kvdepot.server.core.layout import NamespaceLayout

MAX_DIGEST_INPUTS = 64 << 10
# What names a namespace part (kvdepot.common.shards): a shard's or a pipeline stage's.
_PART = re.compile(r"\.(?:s\d+of\d+|pp\d+of\d+)(?:\.|$)")
_STAGE = re.compile(r"\.pp\d+of\d+(?:\.|$)")


def _stage_share(layout: NamespaceLayout, by_id: dict[int, Any], groups: list[Any]) -> bool:
    """Whether `layout`'s groups may be a share of the inputs' `groups`: a pipeline
    stage's part of an engine with stages (its inputs count no layers) may hold the
    groups it has layers of alone, some of them, in the inputs' order; no other id."""
    if _STAGE.search(layout.id) is None or len(by_id) != len(groups):
        return False
    if any(_field(g, "num_layers", int) != 0 for g in groups):
        return False
    order = list(by_id)
    held = [order.index(i) for i in layout.group_ids if i in by_id]
    return bool(held) and len(held) == len(layout.group_ids) and held == sorted(held)


def _refused(layout: NamespaceLayout, why: str) -> LayoutError:
    return LayoutError(
        f"namespace {layout.id[:80]!r} is a digest of its inputs and this declaration {why}: "
        f"declare a namespace with the layout its id was computed from (kvdepot's connector "
        f"does); to keep a namespace apart, give it a kvdepot_namespace_salt"
    )


def _field(fields: dict[str, Any], name: str, kind: type) -> Any:
    value = fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise LayoutError(f"digest_inputs: {name!r} missing or not a {kind.__name__}")
    return value


def check_declaration(layout: NamespaceLayout, digest_inputs: str) -> None:
    """LayoutError unless `layout` may be declared under its id: an id of the digest's
    form needs inputs that hash to it and describe this layout; any other id passes."""
    wanted = digest_of(layout.id)
    if wanted is None:
        return
    if not digest_inputs:
        raise _refused(layout, "carries no digest_inputs")
    if len(digest_inputs) > MAX_DIGEST_INPUTS:
        raise LayoutError(f"digest_inputs: more than {MAX_DIGEST_INPUTS} characters")
    try:
        fields = json.loads(digest_inputs)
    except ValueError:
        raise LayoutError("digest_inputs: not JSON") from None
    if not isinstance(fields, dict):
        raise LayoutError("digest_inputs: not a JSON object")
    if not digest_id(fields).endswith(wanted):
        raise _refused(layout, "carries inputs of another id")
    if _field(fields, "blocks_per_chunk", int) != layout.blocks_per_chunk:
        raise _refused(layout, "has another blocks_per_chunk")
    world = _field(fields, "world_size", int)
    if world < 1 or world % layout.world_size:  # a shard's row: a share of the world
        raise _refused(layout, f"has a world_size that does not divide {world}")
    if world != layout.world_size and _PART.search(layout.id) is None:
        # Only a part's rows (a shard's, a stage's) hold a share of the ranks; a
        # smaller world under the whole id would lock out every engine of it.
        raise _refused(layout, f"has a world_size of {layout.world_size}, not {world}")
    groups = _field(fields, "groups", list)
    if not all(isinstance(g, dict) for g in groups):
        raise LayoutError("digest_inputs: a group is not a JSON object")
    by_id = {_field(g, "group_id", int): g for g in groups}
    if tuple(by_id) != layout.group_ids:
        if not _stage_share(layout, by_id, groups):
            raise _refused(layout, "has other groups")
        groups = [by_id[group_id] for group_id in layout.group_ids]
    for g, declared in zip(groups, layout.groups, strict=True):
        layers = _field(g, "num_layers", int)
        pages = tuple(_field(g, "layer_page_bytes", list))
        if layers == 0:  # a pipeline stage's share: its layers and block bytes are its own
            if pages and (not declared or declared[0] != pages[0]):
                raise _refused(layout, "has other page sizes")
            continue
        if layers != len(declared):
            raise _refused(layout, "has another number of layers")
        if not pages or declared == pages:
            continue
        flattened = len(set(declared)) > 1 and declared[0] == pages[0]
        block_bytes = _field(fields, "worker_bytes_per_block", int)
        if not flattened or sum(map(sum, layout.groups)) != block_bytes:
            raise _refused(layout, "has other page sizes")
