"""The namespace digest (docs/architecture.md §4): engines share blocks exactly when
their bytes are interchangeable.

The digest covers everything that decides what the bytes of one offloaded chunk
are and where they sit: the model, the KV dtype and layout, each offloaded group's
id, kind, tokens per block and per-layer page bytes, the bytes of one GPU block,
blocks per chunk, the parallel layout (world size, TP, PP, PCP, DCP: a rank's
section depends on all of them), the prefix-hash algorithm and its seed (they make
the keys), and an optional user salt. Where every rank holds the same bytes (MLA at
TP > 1), a row is one section and the parallel layout is that of one rank. Anything
else (engine id, data-parallel rank, pool size, max_model_len) is left out on
purpose, so that every engine with the same model and layout on a node shares.

The scheduler and the workers compute it apart and must agree, so it is read only
from what both see alike: the groups as vLLM's scheduler sees them. vLLM hands its
scheduler the workers' KVCacheConfig with each UniformTypeKVCacheSpecs group (MLA
with a DSA indexer, layers of one type with pages of several sizes) flattened to
its first layer's spec (`generate_scheduler_kv_cache_config`), so the workers
flatten theirs the same way here; the pages that flattening hides are in the
block bytes, read from the KV cache tensors both configs share. The workers'
layout (`namespace_layout`) carries their real per-layer pages, which the daemon
compares between registrations.

Canonical namespaces (`canonical_layout`, where vLLM certifies the model statically:
`canonical_units`): a row is one section per KV head of the model (a *unit*), each
section every layer's page of that head, so the row and the digest do not depend on
the TP size: `world_size` is the number of units, `tp_size` 1, each group's pages one
head's, no block bytes, and vLLM's canonical format id is in the digest. A TP=W
rank registers as its H/W consecutive units (client/vllm/canonical.py).

Pipeline stages (pp > 1): each stage's workers hold that stage's layers only, and the
scheduler is handed stage 0's config; stages may differ in layers (61 on two: 31 and
30). So the digest takes nothing a stage decides: per group one layer's page (every
layer of a group has the scheduler's spec), no layer count, no block bytes; instead
the layer partition (VLLM_PP_LAYER_PARTITION, or vLLM's even split of the model's
layers, which the model identity fixes). Each stage is a namespace part of its own
(kvdepot.common.shards), whose workers declare their real pages.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.client.vllm.model_identity import model_identity
from kvdepot.common.namespace_digest import canonical, digest_id
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.config import OffloadingConfig


@dataclass(frozen=True)
class GroupGeometry:
    """One offloaded KV-cache group as the daemon sees it (one rank)."""

    group_id: int
    tokens_per_block: int
    # The KV cache spec class as the scheduler sees it ("FullAttentionSpec",
    # "MLAAttentionSpec", ...; a UniformTypeKVCacheSpecs group: its first layer's).
    kind: str
    # Page bytes of each layer for one block on one rank (un-padded), as the
    # scheduler sees them (a UniformTypeKVCacheSpecs group: its first layer's page
    # for every layer). Empty when the KV cache config is not known; one layer's
    # with pipeline stages (their layer counts are theirs).
    layer_page_bytes: tuple[int, ...]
    num_layers: int  # 0 with pipeline stages


@dataclass(frozen=True)
class NamespaceInputs:
    """What the namespace digest is computed from."""

    # The model's identity (client/vllm/model_identity.py), not its path.
    model: str
    kv_dtype: str
    kv_layout: str
    groups: tuple[GroupGeometry, ...]
    blocks_per_chunk: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    hash_algo: str
    salt: str
    # Bytes of one GPU block on one rank (the KV cache tensors' size over their
    # blocks: the same in the scheduler's config and the workers'); 0 when unknown.
    worker_bytes_per_block: int = 0
    # What seeds the prefix hash's first block (vLLM's NONE_HASH; `hash_seed`).
    hash_seed: str = "default"
    # The name the engine was started with: shown, never part of the digest.
    model_name: str = ""
    # Ranks that hold the same bytes (MLA at TP > 1): they share one section, so
    # `world_size` and `tp_size` above are 1. Shown, never part of the digest: a TP=1
    # engine of the same model makes the same namespace.
    replicated_ranks: int = 1
    # With pp_size > 1: how the model's layers are split over the stages
    # (VLLM_PP_LAYER_PARTITION; "" for vLLM's even split). In the digest only then.
    pp_partition: str = ""
    # A canonical namespace: vLLM's canonical_format_id ("v1-hnd"); `world_size` is
    # then the model's KV heads (the units) and each page one head's. In the digest
    # only when set, so the ids of other namespaces stay what they were.
    canonical_format: str = ""
    # The engine's own TP size in a canonical namespace: shown, never in the digest
    # (engines of every TP size share it).
    engine_tp: int = 0

    @property
    def canonical(self) -> bool:
        return bool(self.canonical_format)

    def digest_fields(self) -> dict[str, Any]:
        """What the digest is taken over: every field but the display ones."""
        fields: dict[str, Any] = asdict(self)
        fields.pop("model_name")
        fields.pop("replicated_ranks")
        fields.pop("engine_tp")
        if not self.canonical:
            fields.pop("canonical_format")
        if self.pp_size == 1:  # the ids of engines without stages stay what they were
            fields.pop("pp_partition")
        return fields

    def digest(self) -> str:
        """The namespace id: 'kvd1-' + 40 hex digits of a SHA-256 over the inputs."""
        return digest_id(self.digest_fields())

    def description(self) -> str:
        """A human-readable summary, shown by Admin/ListNamespaces."""
        groups = ",".join(
            f"{g.kind}/{g.tokens_per_block}tok/{f'{g.num_layers}L' if g.num_layers else 'staged'}"
            for g in self.groups
        )
        salt = " salted" if self.salt else ""
        if self.replicated_ranks > 1:
            salt += f" replicated-over={self.replicated_ranks}"
        if self.canonical:
            salt += (
                f" canonical={self.canonical_format} (world: KV heads; engine tp={self.engine_tp})"
            )
        if self.pp_partition:
            salt += f" pp-layers={self.pp_partition}"
        if self.hash_seed != "default":
            salt += " seed=" + self.hash_seed.partition(":")[0]
        return (
            f"{self.model_name or self.model} {self.kv_dtype} {self.kv_layout} groups=[{groups}] "
            f"bpc={self.blocks_per_chunk} world={self.world_size} tp={self.tp_size} "
            f"pp={self.pp_size} pcp={self.pcp_size} dcp={self.dcp_size} "
            f"hash={self.hash_algo}{salt}"
        )[:1000]


def _scheduler_spec(spec: Any) -> Any:
    """A group's spec as vLLM's scheduler sees it: a UniformTypeKVCacheSpecs is
    flattened to its first layer's spec (vLLM's generate_scheduler_kv_cache_config)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def _layer_page_bytes(kv_cache_config: KVCacheConfig, group_id: int) -> tuple[int, ...]:
    """Un-padded page bytes of each layer of a group as the scheduler sees them (as
    vLLM's offloading worker registers them, CanonicalKVCacheRef.page_size_bytes,
    except in a UniformTypeKVCacheSpecs group, whose first layer's page stands for all)."""
    group = kv_cache_config.kv_cache_groups[group_id]
    return (_page_bytes(group.kv_cache_spec),) * len(group.layer_names)


def _page_bytes(group_spec: Any) -> int:
    """The un-padded page bytes of one layer of a group of spec `group_spec`, as the
    scheduler sees it (a UniformTypeKVCacheSpecs group flattened to its first layer)."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    spec = _scheduler_spec(group_spec)
    if isinstance(spec, AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return int(replace(spec, page_size_padded=None).page_size_bytes)
    return int(spec.page_size_bytes)


def _bytes_per_block(config: OffloadingConfig, kv_cache_config: KVCacheConfig | None) -> int:
    """One GPU block's bytes on one rank, every layer's real page included. Read from
    the KV cache tensors, which the scheduler's config copies from the workers'; vLLM's
    own figure sums flattened pages under HiSparse, which differs between the two, and
    HiSparse's tensors are not sized by `num_blocks`: 0 there."""
    if kv_cache_config is None:
        return config.worker_kv_bytes_per_block
    tensors, blocks = kv_cache_config.kv_cache_tensors, kv_cache_config.num_blocks
    if kv_cache_config.hisparse_host_num_blocks is None and tensors and blocks > 0:
        return tensors[0].size // blocks
    return 0


def seeded_randomly(hash_algo: str) -> bool:
    """Whether vLLM seeds this prefix-hash algorithm with random bytes per process
    when PYTHONHASHSEED is not set (its non-cryptographic ones, xxhash)."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        return get_hash_fn_by_name(hash_algo) in kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS
    except (ImportError, AttributeError, ValueError):  # another vLLM: its names then
        return hash_algo.startswith("xxhash")


def hash_seed(hash_algo: str, environ: Mapping[str, str] | None = None) -> str:
    """What seeds the prefix hash (vLLM's resolve_none_hash_seed): "env:" and a digest
    of PYTHONHASHSEED when it is set (it wins in every process of the engine, which
    inherit it); "random" when vLLM draws the seed per process (nothing shareable, the
    engine's blocks are its own until it restarts); else vLLM's fixed "default"."""
    seed = (os.environ if environ is None else environ).get("PYTHONHASHSEED")
    if seed is not None:
        return "env:" + hashlib.sha256(seed.encode()).hexdigest()[:16]
    return "random" if seeded_randomly(hash_algo) else "default"


def canonical_units(
    config: OffloadingConfig, kv_cache_config: KVCacheConfig | None, total_kv_heads: int
) -> tuple[int, str] | str:
    """(units, vLLM's canonical format id) when this engine's offloaded bytes go into a
    canonical namespace (docs/architecture.md §4): `canonical_layout` is set and vLLM
    certifies the model statically (`parallel.is_parallelism_agnostic`), the KV cache
    layout is LBHNC (each head's page of a block one contiguous run, so a rank's heads
    are consecutive slices of its page), and every offloaded group is full or
    sliding-window GQA attention whose page splits into one page per KV head. Else why
    not, in words. Read alike by the scheduler and the workers; each worker checks
    vLLM's per-layer certification besides (client/vllm/canonical.py)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    p = config.parallel
    if not getattr(config, "canonical_layout", False):
        return "canonical_layout is not set"
    if not p.is_parallelism_agnostic or getattr(config, "replicated_layout", False):
        return "vLLM does not certify this model's pages as independent of the TP size"
    if p.world_size != p.tp_size or p.pp_size != 1 or p.pcp_size != 1 or p.dcp_size != 1:
        return "only tensor parallelism is supported (no pipeline or context parallelism)"
    layout = getattr(config, "kv_cache_layout", None)
    if layout != "LBHNC":
        return f"the KV cache layout is {layout}; kvdepot splits pages by head under LBHNC only"
    if kv_cache_config is None or total_kv_heads < 1:
        return "the KV cache config is not known (use KVDepotConnector)"
    for g in config.groups:
        spec = _scheduler_spec(kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec)
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)) or isinstance(
            spec, MLAAttentionSpec
        ):
            return f"group {g.group_id} is {type(spec).__name__}, not GQA attention"
        if spec.num_kv_heads != max(1, total_kv_heads // p.tp_size) or (
            spec.unpadded_page_size_bytes % spec.num_kv_heads
        ):
            return f"group {g.group_id}'s page does not split into one page per KV head"
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
            canonical_format_id,
        )
    except ImportError:
        return "this vLLM has no canonical format id"
    return total_kv_heads, canonical_format_id(layout)


def _unit_pages(kv_cache_config: KVCacheConfig, group_id: int) -> tuple[int, ...]:
    """One KV head's page of each layer of a group (its un-padded page over its heads)."""
    group = kv_cache_config.kv_cache_groups[group_id]
    spec = _scheduler_spec(group.kv_cache_spec)
    page = int(spec.unpadded_page_size_bytes) // int(spec.num_kv_heads)
    return (page,) * len(group.layer_names)


def namespace_inputs(
    config: OffloadingConfig,
    kv_cache_config: KVCacheConfig | None,
    hash_algo: str,
    salt: str,
    seed: str | None = None,
    canonical: tuple[int, str] | None = None,
) -> NamespaceInputs:
    """Collects the digest inputs from vLLM's OffloadingConfig (and, when the
    connector passes it, the KVCacheConfig: the scheduler's, or a worker's of any
    pipeline stage, alike); `seed`: `hash_seed(hash_algo)` unless given; `canonical`:
    what `canonical_units` found, for a canonical namespace."""
    p = config.parallel
    # A canonical namespace: a section per KV head (`canonical_units`), one head's pages.
    units, canonical_format = canonical if canonical is not None else (0, "")
    staged = p.pp_size > 1  # a stage's layers and block bytes are its own: left out
    groups = []
    for g in config.groups:
        kind = "unknown"
        pages: tuple[int, ...] = ()
        if kv_cache_config is not None:
            spec = _scheduler_spec(kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec)
            kind = type(spec).__name__
            if staged:
                # One layer's page, from the spec: a stage's worker may hold no layer
                # of the group (vLLM keeps the group there with no layers).
                pages = (_page_bytes(kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec),)
            else:
                pages = (_unit_pages if units else _layer_page_bytes)(kv_cache_config, g.group_id)
        elif (window := getattr(g, "sliding_window_size_in_chunks", None)) is not None:
            # vLLM 0.33 only; 0.32 does not tell the scheduler about windows here.
            kind = f"windowed/{window}"
        groups.append(
            GroupGeometry(
                group_id=g.group_id,
                tokens_per_block=g.tokens_per_block,
                kind=kind,
                layer_page_bytes=pages,
                num_layers=0 if staged else len(g.layer_names),
            )
        )
    # MLA at TP > 1 (vLLM's replicated_layout): every rank holds the same latent KV, so
    # a row is one section and the namespace does not depend on the TP size: engines
    # of one MLA model at TP=1, 2, 4 and 8 share every block.
    replicated = bool(getattr(config, "replicated_layout", False))
    world, tp = (1, 1) if replicated else (units, 1) if units else (p.world_size, p.tp_size)
    return NamespaceInputs(
        model=model_identity(config.model.name),
        model_name=config.model.name,
        kv_dtype=config.model.dtype,
        kv_layout=config.kv_cache_layout or "",
        groups=tuple(groups),
        blocks_per_chunk=config.cache.blocks_per_chunk,
        world_size=world,
        tp_size=tp,
        pp_size=p.pp_size,
        pcp_size=p.pcp_size,
        dcp_size=p.dcp_size,
        hash_algo=hash_algo,
        salt=salt,
        # A rank's block bytes depend on the TP size: not in a canonical namespace's.
        worker_bytes_per_block=(
            0 if staged or units else _bytes_per_block(config, kv_cache_config)
        ),
        hash_seed=hash_seed(hash_algo) if seed is None else seed,
        replicated_ranks=p.world_size if replicated else 1,
        pp_partition=os.environ.get("VLLM_PP_LAYER_PARTITION", "") if staged else "",
        canonical_format=canonical_format,
        engine_tp=p.tp_size if units else 0,
    )


def namespace_layout(
    namespace_id: str,
    inputs: NamespaceInputs,
    layer_page_bytes: list[list[int]],
    world_size: int | None = None,
) -> depot_pb2.NamespaceLayout:
    """The NamespaceLayout a worker declares: the id plus its real per-layer pages and
    the digest's inputs (the daemon checks the two agree with the id); `world_size`:
    the ranks whose sections make a row there (a namespace part's: a shard's or a
    pipeline stage's share of the engine's world; default the whole world). Its group
    ids are vLLM's, which its keys end with: the offloaded groups need not be 0..n-1 (a
    group vLLM does not offload comes before one it does, or HiSparse offloads group 1
    alone). A group of no layers here (a pipeline stage that holds none of its layers)
    is left out: the stage's part holds no key of it (the scheduler knows,
    `stage_groups`)."""
    held = [
        (g.group_id, pages)
        for g, pages in zip(inputs.groups, layer_page_bytes, strict=True)
        if pages
    ]
    return depot_pb2.NamespaceLayout(
        id=namespace_id,
        world_size=inputs.world_size if world_size is None else world_size,
        blocks_per_chunk=inputs.blocks_per_chunk,
        groups=[depot_pb2.GroupLayout(layer_page_bytes=pages) for _, pages in held],
        description=inputs.description(),
        group_ids=[group_id for group_id, _ in held],
        digest_inputs=canonical(inputs.digest_fields()),
    )


def reset_namespace_id(base_id: str, generation: int, nonce: str) -> str:
    """The namespace an engine moves to after `reset_cache()`: private to the engine
    (the nonce), so a reset never destroys blocks other engines rely on and this
    engine never reads a block from before the reset."""
    return f"{base_id}.r{generation}-{nonce}"
