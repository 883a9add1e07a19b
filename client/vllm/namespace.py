"""The namespace digest (docs/architecture.md §4): engines share blocks exactly when
their bytes are interchangeable.

The digest covers everything that decides what the bytes of one offloaded chunk
are and where they sit: the model, the KV dtype and layout, each offloaded group's
tokens per block and per-layer page bytes, blocks per chunk, the parallel layout
(world size, TP, PP, PCP, DCP: a rank's section depends on all of them), the
prefix-hash algorithm (it makes the keys), and an optional user salt. Where every
rank holds the same bytes (MLA at TP > 1), a row is one section and the parallel
layout is that of one rank. Anything else (engine id, data-parallel rank, pool size,
max_model_len) is left out on purpose, so that every engine with the same model and
layout on a node shares.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.client.vllm.model_identity import model_identity
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.config import OffloadingConfig

#: Bump when the meaning of the digest inputs or the section byte layout changes.
NAMESPACE_FORMAT = 1
_ID_PREFIX = f"kvd{NAMESPACE_FORMAT}-"


@dataclass(frozen=True)
class GroupGeometry:
    """One offloaded KV-cache group as the daemon sees it (one rank)."""

    group_id: int
    tokens_per_block: int
    # The KV cache spec class ("FullAttentionSpec", "SlidingWindowSpec", ...).
    kind: str
    # Page bytes of each layer for one block on one rank (un-padded). Empty when
    # the scheduler could not see the KV cache config (then `group_bytes` stands in).
    layer_page_bytes: tuple[int, ...]
    num_layers: int


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
    # Bytes of one block on one rank across all offloaded layers, as vLLM reports
    # it; only part of the digest when per-layer page bytes are unknown.
    worker_bytes_per_block: int = 0
    # The name the engine was started with: shown, never part of the digest.
    model_name: str = ""
    # Ranks that hold the same bytes (MLA at TP > 1): they share one section, so
    # `world_size` and `tp_size` above are 1. Shown, never part of the digest: a TP=1
    # engine of the same model makes the same namespace.
    replicated_ranks: int = 1

    def digest(self) -> str:
        """The namespace id: 'kvd1-' + 40 hex digits of a SHA-256 over the inputs."""
        fields: dict[str, Any] = asdict(self)
        fields.pop("model_name")
        fields.pop("replicated_ranks")
        if all(g.layer_page_bytes for g in self.groups):
            fields.pop("worker_bytes_per_block")
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return _ID_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:40]

    def description(self) -> str:
        """A human-readable summary, shown by Admin/ListNamespaces."""
        groups = ",".join(f"{g.kind}/{g.tokens_per_block}tok/{g.num_layers}L" for g in self.groups)
        salt = " salted" if self.salt else ""
        if self.replicated_ranks > 1:
            salt += f" replicated-over={self.replicated_ranks}"
        return (
            f"{self.model_name or self.model} {self.kv_dtype} {self.kv_layout} groups=[{groups}] "
            f"bpc={self.blocks_per_chunk} world={self.world_size} tp={self.tp_size} "
            f"pp={self.pp_size} pcp={self.pcp_size} dcp={self.dcp_size} "
            f"hash={self.hash_algo}{salt}"
        )[:1000]


def _layer_page_bytes(kv_cache_config: KVCacheConfig, group_id: int) -> tuple[int, ...]:
    """Un-padded page bytes of each layer of a group, exactly as vLLM's offloading
    worker registers them (CanonicalKVCacheRef.page_size_bytes)."""
    from dataclasses import replace

    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    group = kv_cache_config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
    pages: list[int] = []
    for layer_name in group.layer_names:
        layer_spec = per_layer.get(layer_name, spec)
        if isinstance(layer_spec, AttentionSpec):
            pages.append(int(layer_spec.unpadded_page_size_bytes))
        elif isinstance(layer_spec, MambaSpec):
            pages.append(int(replace(layer_spec, page_size_padded=None).page_size_bytes))
        else:
            pages.append(int(layer_spec.page_size_bytes))
    return tuple(pages)


def namespace_inputs(
    config: OffloadingConfig,
    kv_cache_config: KVCacheConfig | None,
    hash_algo: str,
    salt: str,
) -> NamespaceInputs:
    """Collects the digest inputs from vLLM's OffloadingConfig (and, when the
    connector passes it, the KVCacheConfig for exact per-layer page bytes)."""
    groups = []
    for g in config.groups:
        kind = "unknown"
        pages: tuple[int, ...] = ()
        if kv_cache_config is not None:
            kind = type(kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec).__name__
            pages = _layer_page_bytes(kv_cache_config, g.group_id)
        elif (window := getattr(g, "sliding_window_size_in_chunks", None)) is not None:
            # vLLM 0.33 only; 0.32 does not tell the scheduler about windows here.
            kind = f"windowed/{window}"
        groups.append(
            GroupGeometry(
                group_id=g.group_id,
                tokens_per_block=g.tokens_per_block,
                kind=kind,
                layer_page_bytes=pages,
                num_layers=len(g.layer_names),
            )
        )
    p = config.parallel
    # MLA at TP > 1 (vLLM's replicated_layout): every rank holds the same latent KV, so
    # a row is one section and the namespace does not depend on the TP size: engines
    # of one MLA model at TP=1, 2, 4 and 8 share every block.
    replicated = bool(getattr(config, "replicated_layout", False))
    return NamespaceInputs(
        model=model_identity(config.model.name),
        model_name=config.model.name,
        kv_dtype=config.model.dtype,
        kv_layout=config.kv_cache_layout or "",
        groups=tuple(groups),
        blocks_per_chunk=config.cache.blocks_per_chunk,
        world_size=1 if replicated else p.world_size,
        tp_size=1 if replicated else p.tp_size,
        pp_size=p.pp_size,
        pcp_size=p.pcp_size,
        dcp_size=p.dcp_size,
        hash_algo=hash_algo,
        salt=salt,
        worker_bytes_per_block=config.worker_kv_bytes_per_block,
        replicated_ranks=p.world_size if replicated else 1,
    )


def namespace_layout(
    namespace_id: str,
    inputs: NamespaceInputs,
    layer_page_bytes: list[list[int]],
    world_size: int | None = None,
) -> depot_pb2.NamespaceLayout:
    """The NamespaceLayout a worker declares: the id plus its real per-layer pages;
    `world_size`: the ranks whose sections make a row there (a shard's share of the
    engine's world; default the whole world)."""
    return depot_pb2.NamespaceLayout(
        id=namespace_id,
        world_size=inputs.world_size if world_size is None else world_size,
        blocks_per_chunk=inputs.blocks_per_chunk,
        groups=[depot_pb2.GroupLayout(layer_page_bytes=pages) for pages in layer_page_bytes],
        description=inputs.description(),
    )


def reset_namespace_id(base_id: str, generation: int, nonce: str) -> str:
    """The namespace an engine moves to after `reset_cache()`: private to the engine
    (the nonce), so a reset never destroys blocks other engines rely on and this
    engine never reads a block from before the reset."""
    return f"{base_id}.r{generation}-{nonce}"
