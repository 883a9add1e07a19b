"""What a `SyntheticEngine` is built from (`EngineConfig`, `GroupDef`), and the vLLM
configs built from it: the `VllmConfig` (model, cache, scheduler, KV connector) and the
`KVCacheConfig` (one KV tensor holding every layer, one page size for all groups, as
vLLM's hybrid allocator requires).
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
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvdepot.testing.environment import find_model_dir

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class GroupDef:
    """One KV-cache group of the synthetic model (per-rank geometry)."""

    kind: str = "full"  # "full", "sliding_window" or "mla" (one latent head)
    block_size: int = 16
    num_layers: int = 2
    sliding_window: int | None = None
    # Per rank; None: the model's KV heads divided by TP.
    num_kv_heads: int | None = None
    head_size: int | None = None


@dataclass
class EngineConfig:
    """What a SyntheticEngine is built from."""

    socket: str | None
    groups: Sequence[GroupDef] = (GroupDef(),)
    model_dir: str | None = None
    blocks_per_chunk: int = 1
    tp: int = 1
    num_gpu_blocks: int = 128
    dtype: str = "float16"
    salt: str = ""
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
    model = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
    )
    cache = CacheConfig(block_size=cfg.groups[0].block_size, enable_prefix_caching=True)
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
        parallel_config=ParallelConfig(tensor_parallel_size=cfg.tp),
        **kwargs,
    )


def worker_config(vllm_config: VllmConfig, rank: int) -> VllmConfig:
    """The config one worker rank sees: the engine's, with its own parallel rank."""
    if rank == 0 and vllm_config.parallel_config.tensor_parallel_size == 1:
        return vllm_config
    config = copy.copy(vllm_config)
    config.parallel_config = copy.copy(vllm_config.parallel_config)
    config.parallel_config.rank = rank
    return config


def make_kv_cache_config(
    cfg: EngineConfig, vllm_config: VllmConfig, num_blocks: int
) -> KVCacheConfig:
    """The per-rank KV cache: one group per `GroupDef`, every layer in one tensor.
    Also sets `vllm_config.cache_config.num_gpu_blocks` (vLLM's profiling would)."""
    model = vllm_config.model_config
    heads = model.get_total_num_kv_heads() // cfg.tp
    head_size = model.get_head_size()
    groups: list[KVCacheGroupSpec] = []
    names: list[str] = []
    pages: list[int] = []
    for g, gd in enumerate(cfg.groups):
        common = dict(
            block_size=gd.block_size,
            num_kv_heads=gd.num_kv_heads or heads,
            head_size=gd.head_size or head_size,
            dtype=DTYPES[cfg.dtype],
        )
        if gd.kind == "full":
            spec = FullAttentionSpec(**common)
        elif gd.kind == "mla":
            # One latent a token, the same on every rank (vLLM's kv_tp_replicas).
            spec = MLAAttentionSpec(**{**common, "num_kv_heads": 1})
        elif gd.kind == "sliding_window":
            assert gd.sliding_window is not None
            spec = SlidingWindowSpec(**common, sliding_window=gd.sliding_window)
        else:
            raise ValueError(f"unknown group kind {gd.kind!r}")
        layer_names = [f"model.layers.{len(names) + i}.g{g}.attn" for i in range(gd.num_layers)]
        names.extend(layer_names)
        pages.extend([spec.page_size_bytes] * gd.num_layers)
        groups.append(KVCacheGroupSpec(layer_names, spec))
    if len(set(pages)) != 1:
        raise ValueError(f"all layers need one page size (vLLM's hybrid allocator): {pages}")
    page = pages[0]
    total = page * num_blocks * len(names)
    tensors = [
        KVCacheTensor(size=total, layers=names, layer_stride=page * num_blocks, block_stride=page)
    ]
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
    )
    if all(gd.kind == "mla" for gd in cfg.groups):
        config.kv_tp_replicas = cfg.tp  # as vLLM's planner finds for a pure-MLA model
    return config
