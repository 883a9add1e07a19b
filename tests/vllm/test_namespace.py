"""The namespace digest and the connector settings (no daemon needed)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvdepot.client.vllm.config import DEFAULT_SOCKET, DepotSettings
from kvdepot.client.vllm.namespace import namespace_inputs, namespace_layout

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
