"""What a `SyntheticEngine` is built from (`EngineConfig`, `GroupDef`), and the vLLM
configs built from it: the `VllmConfig` (model, cache, scheduler, KV connector) and the
`KVCacheConfig` (one backing allocation holding every layer, layer after layer; one page
size for all groups, as vLLM's hybrid allocator requires, except inside the one group of
an MLA model whose DSA indexer layers have pages of their own size).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)

from kvdepot.testing.environment import find_model_dir

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class GroupDef:
    """One KV-cache group of the synthetic model (per-rank geometry)."""

    # "full", "sliding_window", "mla" or "ring". "mla": MLA layers (one latent
    # "head" of `head_size`), each followed by a DSA indexer layer when
    # `indexer_head_size` is set (DeepSeek-V3.2's k cache: uint8, pages of another
    # size), the two kinds in one UniformTypeKVCacheSpecs group as vLLM's workers see
    # it. "ring": a CircularBufferSpec group (DeepSeek-V4's compressor ring, one
    # block per request), which is not prefix-cacheable, so vLLM does not offload it
    # and the offloaded groups' ids are not 0..n-1 when one comes first.
    kind: str = "full"
    block_size: int = 16
    num_layers: int = 2
    sliding_window: int | None = None
    # Per rank; None: the model's KV heads divided by TP.
    num_kv_heads: int | None = None
    head_size: int | None = None
    indexer_head_size: int | None = None


@dataclass
class EngineConfig:
    """What a SyntheticEngine is built from."""

    socket: str | None
    groups: Sequence[GroupDef] = (GroupDef(),)
    model_dir: str | None = None
    blocks_per_chunk: int = 1
    tp: int = 1
    # Pipeline stages: each stage's `tp` ranks hold its share of the layers only, split
    # as vLLM splits a model's layers (get_pp_indices: VLLM_PP_LAYER_PARTITION, or even
    # with the remainder on the stages before the last).
    pp: int = 1
    num_gpu_blocks: int = 128
    dtype: str = "float16"
    salt: str = ""
    # vLLM's prefix_caching_hash_algo (it makes the offload keys).
    hash_algo: str = "sha256"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    # None: no KV connector at all (a baseline).
    connector: str | None = "KVDepotConnector"
    connector_module: str | None = "kvdepot.client.vllm"
    extra_config: dict[str, Any] = field(default_factory=dict)
    # False: plain process memory, as in a real CPU engine ("auto" moves it into a memfd).
    shm: bool = True
    enable_kv_events: bool = False
    # False: scheduler only; transfer jobs complete at once (benchmarks of the
    # scheduler side, and connectors whose workers need a GPU).
    workers: bool = True


def make_vllm_config(cfg: EngineConfig) -> VllmConfig:
    """The engine's `VllmConfig`: the model config, prefix caching on, synchronous
    scheduling, and the connector (with kvdepot's settings) unless `cfg.connector` is None."""
    model_dir = cfg.model_dir or str(find_model_dir())
    extra = {
        "kvdepot_socket": cfg.socket or "",
        "kvdepot_namespace_salt": cfg.salt,
        "kvdepot_startup_wait_s": 5.0,
        **({"blocks_per_chunk": cfg.blocks_per_chunk} if cfg.blocks_per_chunk > 1 else {}),
        **cfg.extra_config,
    }
    # With stages, the model's layers are the synthetic ones (one per layer of each
    # group, numbered in group order): vLLM splits those over the stages, and the
    # scheduler reads their count from the model config.
    staged = {"num_hidden_layers": sum(gd.num_layers for gd in cfg.groups)}
    model = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
        **({"hf_overrides": staged} if cfg.pp > 1 else {}),
    )
    cache = CacheConfig(
        block_size=cfg.groups[0].block_size,
        enable_prefix_caching=True,
        prefix_caching_hash_algo=cfg.hash_algo,
    )
    # What vLLM's engine core resolves before it builds the connector
    # (resolve_kv_cache_layout), and the layout `_plan` gives the KV cache.
    cache.kv_cache_layout = "LBHNC"
    sched = SchedulerConfig(
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=cfg.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    transfer = None
    if cfg.connector is not None:
        transfer = KVTransferConfig(
            kv_connector=cfg.connector,
            kv_connector_module_path=cfg.connector_module,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    kwargs: dict[str, Any] = {}
    if cfg.enable_kv_events:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=sched,
        kv_transfer_config=transfer,
        parallel_config=ParallelConfig(tensor_parallel_size=cfg.tp, pipeline_parallel_size=cfg.pp),
        **kwargs,
    )


def worker_config(vllm_config: VllmConfig, rank: int) -> VllmConfig:
    """The config one worker rank sees: the engine's, with its own parallel rank."""
    if rank == 0 and vllm_config.parallel_config.world_size == 1:
        return vllm_config
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.rank = rank
    return config


def _group_specs(
    cfg: EngineConfig, gd: GroupDef, g: int, first_layer: int, heads: int, head_size: int
) -> tuple[KVCacheSpec, dict[str, KVCacheSpec]]:
    """A group's spec as vLLM's workers see it, and each of its layers' spec, in order."""
    common = dict(
        block_size=gd.block_size,
        num_kv_heads=gd.num_kv_heads or heads,
        head_size=gd.head_size or head_size,
        dtype=DTYPES[cfg.dtype],
    )
    if gd.kind == "mla":
        latent = MLAAttentionSpec(**{**common, "num_kv_heads": 1})
        layers: dict[str, KVCacheSpec] = {}
        for i in range(gd.num_layers):
            layers[f"model.layers.{first_layer + i}.g{g}.attn"] = latent
            if gd.indexer_head_size is not None:
                layers[f"model.layers.{first_layer + i}.g{g}.indexer.k_cache"] = MLAAttentionSpec(
                    block_size=gd.block_size,
                    num_kv_heads=1,
                    head_size=gd.indexer_head_size,
                    dtype=torch.uint8,
                    cache_role=SparseCacheRole.INDEXER,
                )
        if gd.indexer_head_size is None:
            return latent, layers
        return UniformTypeKVCacheSpecs(block_size=gd.block_size, kv_cache_specs=layers), layers
    if gd.kind == "full":
        spec: KVCacheSpec = FullAttentionSpec(**common)
    elif gd.kind == "sliding_window":
        assert gd.sliding_window is not None
        spec = SlidingWindowSpec(**common, sliding_window=gd.sliding_window)
    elif gd.kind == "ring":
        spec = CircularBufferSpec(**common)
    else:
        raise ValueError(f"unknown group kind {gd.kind!r}")
    return spec, {f"model.layers.{first_layer + i}.g{g}.attn": spec for i in range(gd.num_layers)}


def layer_specs(kv_cache_config: KVCacheConfig) -> dict[str, KVCacheSpec]:
    """Each layer's own spec (a UniformTypeKVCacheSpecs group holds one per layer)."""
    out: dict[str, KVCacheSpec] = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = spec.kv_cache_specs if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        for name in group.layer_names:
            out[name] = per_layer.get(name, spec)
    return out


def make_kv_cache_config(
    cfg: EngineConfig, vllm_config: VllmConfig, num_blocks: int
) -> KVCacheConfig:
    """The per-rank KV cache, as vLLM's workers get it: one group per `GroupDef`, every
    layer a region of one backing allocation, layer after layer (one KVCacheTensor per
    run of layers of one spec, as vLLM plans them). Also sets
    `vllm_config.cache_config.num_gpu_blocks` (vLLM's profiling would)."""
    groups, specs = _model_groups(cfg, vllm_config)
    return _plan(cfg, vllm_config, groups, specs, num_blocks)


def stage_kv_cache_configs(
    cfg: EngineConfig, vllm_config: VllmConfig, num_blocks: int
) -> list[KVCacheConfig]:
    """Each pipeline stage's KV cache (one config with `cfg.pp` 1): the model's groups
    projected onto the stage's layers by vLLM's own planner function, each stage's
    layers planned as `make_kv_cache_config` plans a whole model's, with one block count."""
    groups, specs = _model_groups(cfg, vllm_config)
    if cfg.pp == 1:
        return [_plan(cfg, vllm_config, groups, specs, num_blocks)]
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.core.kv_cache_planning import _project_kv_cache_groups_to_worker

    decoder_layer = {name: int(name.split(".")[2]) for name in specs}
    n = vllm_config.model_config.get_total_num_hidden_layers()
    configs = []
    for stage in range(cfg.pp):
        start, end = get_pp_indices(n, stage, cfg.pp)
        mine = {name: s for name, s in specs.items() if start <= decoder_layer[name] < end}
        projected = _project_kv_cache_groups_to_worker(groups, mine)
        configs.append(_plan(cfg, vllm_config, projected, mine, num_blocks))
    return configs


def _model_groups(
    cfg: EngineConfig, vllm_config: VllmConfig
) -> tuple[list[KVCacheGroupSpec], dict[str, KVCacheSpec]]:
    """The whole model's groups and each of its layers' spec, in order."""
    model = vllm_config.model_config
    # At TP larger than the KV heads, vLLM gives each rank one head (ranks share heads).
    heads = max(1, model.get_total_num_kv_heads() // cfg.tp)
    head_size = model.get_head_size()
    groups: list[KVCacheGroupSpec] = []
    specs: dict[str, KVCacheSpec] = {}
    for g, gd in enumerate(cfg.groups):
        spec, layers = _group_specs(cfg, gd, g, len(specs), heads, head_size)
        specs.update(layers)
        groups.append(KVCacheGroupSpec(list(layers), spec))
    pages = {s.page_size_bytes for s in specs.values()}
    if len(groups) > 1 and len(pages) != 1:
        raise ValueError(f"all layers need one page size (vLLM's hybrid allocator): {pages}")
    return groups, specs


def _plan(
    cfg: EngineConfig,
    vllm_config: VllmConfig,
    groups: list[KVCacheGroupSpec],
    specs: dict[str, KVCacheSpec],
    num_blocks: int,
) -> KVCacheConfig:
    """One rank's KVCacheConfig holding `specs`' layers in `groups`."""
    size = sum(s.page_size_bytes for s in specs.values()) * num_blocks
    tensors: list[KVCacheTensor] = []
    offset = 0
    for name, spec in specs.items():
        page = spec.page_size_bytes
        last = tensors[-1] if tensors else None
        if last is not None and last.block_stride == page:
            last.layers.append(name)
        else:
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=[name],
                    layer_stride=page * num_blocks,
                    block_stride=page,
                    offset=offset,
                )
            )
        offset += page * num_blocks
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
    )
    if all(gd.kind == "mla" for gd in cfg.groups):
        config.kv_tp_replicas = cfg.tp  # as vLLM's planner finds for a pure-MLA model
    else:  # GQA at TP larger than the KV heads: consecutive ranks hold one head
        config.kv_tp_replicas = max(1, cfg.tp // vllm_config.model_config.get_total_num_kv_heads())
    return config
