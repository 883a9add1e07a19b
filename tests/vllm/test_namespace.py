"""The namespace digest and the connector settings (no daemon needed): the scheduler
and the workers compute one id from what each of them sees, with vLLM's real configs."""

from __future__ import annotations

import dataclasses
import logging

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvdepot.client.vllm.config import DEFAULT_SOCKET, DepotSettings
from kvdepot.client.vllm.namespace import hash_seed, namespace_inputs, namespace_layout
from kvdepot.client.vllm.spec import ConnectorContext, KVDepotOffloadingSpec, connector_context
from kvdepot.testing.environment import find_model_dir
from kvdepot.testing.vllm_config import (
    EngineConfig,
    GroupDef,
    make_kv_cache_config,
    make_vllm_config,
    stage_kv_cache_configs,
)

pytestmark = pytest.mark.vllm


def offloading_config(**changes) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=2,
        tp_size=2,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=2 * 65536,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="engine-a",
        model=OffloadingModelConfig(
            name="meta-llama/Llama-3-8B", dtype="bfloat16", max_model_len=8192
        ),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
        kv_cache_layout="LBHNC",
    )
    parallel_changes = {k: changes.pop(k) for k in list(changes) if hasattr(parallel, k)}
    if parallel_changes:
        changes["parallel"] = dataclasses.replace(parallel, **parallel_changes)
    for name, value in list(changes.items()):
        if name in ("dtype", "name", "max_model_len"):
            changes["model"] = dataclasses.replace(config.model, **{name: changes.pop(name)})
        elif name == "blocks_per_chunk":
            changes["cache"] = dataclasses.replace(config.cache, blocks_per_chunk=value)
            del changes[name]
    return dataclasses.replace(config, **changes)


def ns_id(config: OffloadingConfig, salt: str = "", hash_algo: str = "sha256") -> str:
    return namespace_inputs(config, None, hash_algo, salt).digest()


def test_same_configuration_same_namespace_across_engines_and_ranks() -> None:
    base = ns_id(offloading_config())
    assert base.startswith("kvd1-") and len(base) == 45
    # Engine id, DP rank, worker rank, max_model_len: the bytes are the same.
    assert ns_id(offloading_config(engine_id="engine-b")) == base
    assert ns_id(offloading_config(rank=1)) == base
    assert ns_id(offloading_config(data_parallel_index=3, data_parallel_size=4)) == base
    assert ns_id(offloading_config(max_model_len=4096)) == base


@pytest.mark.parametrize(
    "change",
    [
        {"name": "meta-llama/Llama-3-70B"},
        {"dtype": "float16"},
        {"kv_cache_layout": "BLHNC"},
        {"blocks_per_chunk": 2},
        {"world_size": 4, "tp_size": 4},
        {"pp_size": 2, "world_size": 4},
        {"dcp_size": 2},
        {"pcp_size": 2},
        {"worker_kv_bytes_per_block": 65536},
        {
            "groups": (
                OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),
            )
        },
    ],
    ids=lambda c: ",".join(c),
)
def test_anything_that_changes_the_bytes_changes_the_namespace(change: dict) -> None:
    assert ns_id(offloading_config(**change)) != ns_id(offloading_config())


def test_salt_and_hash_algorithm_separate_namespaces() -> None:
    config = offloading_config()
    assert ns_id(config, salt="weights-v2") != ns_id(config)
    assert ns_id(config, hash_algo="sha256_cbor") != ns_id(config)


def test_layout_carries_the_workers_pages() -> None:
    inputs = namespace_inputs(offloading_config(blocks_per_chunk=4), None, "sha256", "")
    layout = namespace_layout("ns", inputs, [[65536, 65536]])
    assert layout.world_size == 2 and layout.blocks_per_chunk == 4
    assert [list(g.layer_page_bytes) for g in layout.groups] == [[65536, 65536]]
    assert "Llama-3-8B" in layout.description


def test_settings_defaults_and_validation() -> None:
    s = DepotSettings.from_extra_config({})
    assert s.socket == DEFAULT_SOCKET and s.pin_timeout_s == pytest.approx(0.05)
    s = DepotSettings.from_extra_config(
        {
            "kvdepot_socket": "/tmp/x.sock",
            "kvdepot_pin_timeout_ms": "20",
            "kvdepot_memory_path": "INLINE",
            "kvdepot_namespace_salt": "v2",
        }
    )
    assert (s.socket, s.pin_timeout_s, s.memory_path, s.namespace_salt) == (
        "/tmp/x.sock",
        0.02,
        "inline",
        "v2",
    )
    with pytest.raises(ValueError, match="kvdepot_pin_timeout_ms"):
        DepotSettings.from_extra_config({"kvdepot_pin_timeout_ms": "soon"})
    with pytest.raises(ValueError, match="kvdepot_pin_timeout_ms"):
        DepotSettings.from_extra_config({"kvdepot_pin_timeout_ms": 0})
    with pytest.raises(ValueError, match="kvdepot_memory_path"):
        DepotSettings.from_extra_config({"kvdepot_memory_path": "rdma"})
    with pytest.raises(ValueError, match="kvdepot_socket"):
        DepotSettings.from_extra_config({"kvdepot_socket": " "})


# -- the scheduler and the workers compute one id -----------------------------------------

MLA_DSA = (GroupDef("mla", block_size=16, num_layers=2, head_size=576, indexer_head_size=132),)


def vllm_configs(groups=MLA_DSA, hash_algo: str = "sha256", tp: int = 1):
    """An engine's VllmConfig, a worker's KVCacheConfig, and the scheduler's, built from
    the workers' by vLLM's own `generate_scheduler_kv_cache_config`."""
    cfg = EngineConfig(
        socket="/nonexistent/kvdepot.sock",
        groups=groups,
        model_dir=str(find_model_dir()),
        tp=tp,
        hash_algo=hash_algo,
    )
    vllm_config = make_vllm_config(cfg)
    worker = make_kv_cache_config(cfg, vllm_config, 64)
    return vllm_config, worker, generate_scheduler_kv_cache_config([worker] * tp)


def spec_for(vllm_config, kv_cache_config) -> KVDepotOffloadingSpec:
    """The spec vLLM builds in a process that holds `kv_cache_config`, as
    KVDepotConnector builds it (it connects to nothing until asked for a manager or a
    worker)."""
    token = connector_context.set(ConnectorContext(vllm_config, kv_cache_config))
    try:
        return KVDepotOffloadingSpec(build_offloading_config(vllm_config, kv_cache_config))
    finally:
        connector_context.reset(token)


def test_a_uniform_type_group_is_one_namespace_for_the_scheduler_and_the_workers() -> None:
    """MLA with a DSA indexer: the workers' group is a UniformTypeKVCacheSpecs of two page
    sizes, the scheduler's that group flattened to its first layer's spec."""
    vllm_config, worker, scheduler = vllm_configs()
    assert type(worker.kv_cache_groups[0].kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
    assert type(scheduler.kv_cache_groups[0].kv_cache_spec).__name__ == "MLAAttentionSpec"
    on_worker = spec_for(vllm_config, worker)
    assert spec_for(vllm_config, scheduler).namespace_id == on_worker.namespace_id
    # The pages the flattening hides still count: another indexer is another namespace.
    other = (dataclasses.replace(MLA_DSA[0], indexer_head_size=136),)
    vllm_config2, worker2, scheduler2 = vllm_configs(other)
    assert spec_for(vllm_config2, scheduler2).namespace_id != on_worker.namespace_id
    assert (
        spec_for(vllm_config2, worker2).namespace_id
        == spec_for(vllm_config2, scheduler2).namespace_id
    )


def test_offloaded_group_ids_are_part_of_the_namespace() -> None:
    """Groups (0, 2) and groups (0, 1) of one model are different keys and layouts (a
    compressor ring is not prefix-cacheable: vLLM does not offload it)."""
    full, ring = GroupDef("full", block_size=16, num_layers=2), GroupDef("ring", 16, 2)
    vllm_config, worker, scheduler = vllm_configs((full, ring, full))
    assert [g.group_id for g in build_offloading_config(vllm_config, worker).groups] == [0, 2]
    ns = spec_for(vllm_config, scheduler).namespace_id
    assert spec_for(vllm_config, worker).namespace_id == ns
    vllm_config2, _, scheduler2 = vllm_configs((full, full, ring))
    assert spec_for(vllm_config2, scheduler2).namespace_id != ns


def stage_ids(tp: int = 1) -> tuple[str, list[str]]:
    """A five-layer model on two pipeline stages: the scheduler's namespace (its config
    is the first stage's, flattened by vLLM), and each stage's workers'."""
    cfg = EngineConfig(
        socket="/nonexistent/kvdepot.sock",
        groups=(GroupDef("full", block_size=16, num_layers=5),),
        model_dir=str(find_model_dir()),
        tp=tp,
        pp=2,
    )
    vllm_config = make_vllm_config(cfg)
    stages = stage_kv_cache_configs(cfg, vllm_config, 64)
    scheduler = generate_scheduler_kv_cache_config([s for s in stages for _ in range(tp)])
    workers = [spec_for(vllm_config, stage).namespace_id for stage in stages]
    return spec_for(vllm_config, scheduler).namespace_id, workers


def test_pipeline_stages_of_unequal_layers_are_one_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three layers on the first stage, two on the second: each stage's workers see
    their own layers and block bytes, the scheduler the first stage's; all of them
    compute one id, and another split of the layers is another namespace."""
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    scheduler, workers = stage_ids(tp=2)
    assert workers == [scheduler, scheduler]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,3")
    other, workers = stage_ids(tp=2)
    assert workers == [other, other] and other != scheduler


# -- the prefix hash's seed ---------------------------------------------------------------


def test_the_prefix_hash_seed_separates_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    config = offloading_config()
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = ns_id(config)
    assert hash_seed("sha256") == hash_seed("sha256_cbor") == "default"
    assert hash_seed("xxhash") == hash_seed("xxhash_cbor") == "random"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert hash_seed("xxhash") == hash_seed("sha256") != "random"
    seven = ns_id(config)
    assert seven != default  # vLLM's NONE_HASH, and so every key, depends on it
    assert ns_id(config) == seven  # every engine, scheduler and rank with the seed
    monkeypatch.setenv("PYTHONHASHSEED", "8")
    assert ns_id(config) != seven
    # An xxhash seed must stay secret: only a digest of it goes anywhere.
    monkeypatch.setenv("PYTHONHASHSEED", "s3cret-seed")
    inputs = namespace_inputs(config, None, "xxhash", "")
    assert "s3cret" not in inputs.hash_seed and "s3cret" not in inputs.description()


@pytest.mark.parametrize(
    ("algo", "seed", "warns"),
    [
        ("xxhash", None, True),
        ("xxhash_cbor", None, True),
        ("xxhash", "0", False),
        ("sha256", None, False),
        ("sha256", "0", False),
    ],
)
def test_the_xxhash_warning_only_when_no_engine_can_share(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    algo: str,
    seed: str | None,
    warns: bool,
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    vllm_config, worker, scheduler = vllm_configs(hash_algo=algo)
    caplog.set_level(logging.WARNING, logger="kvdepot")
    ids = {spec_for(vllm_config, kv).namespace_id for kv in (scheduler, worker)}
    assert len(ids) == 1
    warned = [r for r in caplog.records if "cannot share offloaded blocks" in r.getMessage()]
    assert len(warned) == (2 if warns else 0)


def test_canonical_layout_makes_one_namespace_of_every_tp_size(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM certifies a GQA model's pages as portable across TP sizes; with
    `canonical_layout` the scheduler and the workers of TP=1, 2 and 4 engines compute one
    namespace, of a section per KV head (docs/architecture.md §4), and nobody warns."""
    full = (GroupDef("full", block_size=16, num_layers=2),)
    caplog.set_level(logging.WARNING, logger="kvdepot")
    ids = set()
    for tp in (1, 2, 4):
        vllm_config, worker, scheduler = vllm_configs(full, tp=tp)
        vllm_config.kv_transfer_config.kv_connector_extra_config["canonical_layout"] = True
        config = build_offloading_config(vllm_config, worker)
        assert config.canonical_layout and config.parallel.is_parallelism_agnostic
        for kv in (worker, scheduler):
            spec = spec_for(vllm_config, kv)
            ids.add(spec.namespace_id)
            heads = vllm_config.model_config.get_total_num_kv_heads()
            assert spec.namespace.world_size == heads and spec.namespace.canonical_format
    assert len(ids) == 1
    assert not [r for r in caplog.records if "canonical_layout" in r.getMessage()]


def test_a_worker_whose_pages_vllm_did_not_certify_refuses_the_canonical_namespace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fail closed: a rank whose layer has no certified mapping must not write into a
    canonical namespace; its worker refuses to start and says what to change."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches

    full = (GroupDef("full", block_size=16, num_layers=2),)
    vllm_config, worker, _ = vllm_configs(full, tp=2)
    vllm_config.kv_transfer_config.kv_connector_extra_config["canonical_layout"] = True
    spec = spec_for(vllm_config, worker)
    assert spec.namespace.canonical
    uncertified = CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=4096, mapping=None)
    caplog.set_level(logging.ERROR, logger="kvdepot")
    with pytest.raises(ValueError, match="remove canonical_layout"):
        spec.get_worker(CanonicalKVCaches([], [[uncertified]]))
    assert any("did not certify" in r.getMessage() for r in caplog.records)


def test_canonical_layout_is_said_to_be_ignored_where_pages_are_not_head_slices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under LBNHC (NHD) a rank's heads are strided through its page: kvdepot keeps rank
    sections, a namespace per TP size, and says why canonical_layout is ignored."""
    full = (GroupDef("full", block_size=16, num_layers=2),)
    caplog.set_level(logging.WARNING, logger="kvdepot")
    ids = []
    for tp in (2, 4):
        vllm_config, worker, _ = vllm_configs(full, tp=tp)
        vllm_config.kv_transfer_config.kv_connector_extra_config["canonical_layout"] = True
        vllm_config.cache_config.kv_cache_layout = "LBNHC"
        ids.append(spec_for(vllm_config, worker).namespace_id)
    assert ids[0] != ids[1]
    warned = [r for r in caplog.records if "canonical_layout is ignored" in r.getMessage()]
    assert len(warned) == 2 and "LBNHC" in warned[0].getMessage()
