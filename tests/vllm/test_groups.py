"""KV-cache groups as vLLM 0.33.0 really hands them over, against a real `kvdepot serve`,
driven by vLLM's real Scheduler and worker-role connectors (docs/architecture.md §4).

- A group of one attention type whose layers differ in page size (MLA with a DSA
  indexer, DeepSeek-V3.2): vLLM's workers see a UniformTypeKVCacheSpecs, its scheduler
  one layer's spec (`generate_scheduler_kv_cache_config` flattens it). Both must land in
  one namespace, on one shard, or every lookup misses without an error.
- Offloaded groups whose ids are not 0..n-1 (a group vLLM does not offload before an
  offloaded one, or HiSparse's single group 1): the keys carry vLLM's group id, the
  namespace's layout lists the offloaded groups in order, and the daemon maps one to
  the other.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import grpc

from kvdepot.common.shards import engine_shards, first_shard, shard_namespace_id
from kvdepot.testing.vllm_engine import GroupDef, SyntheticEngine, prompt_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.vllm.test_connector import assert_expected, load_jobs, pages
from tests.vllm.test_shards import shard_admin, wait_shards

pytestmark = pytest.mark.vllm

# DeepSeek-V3.2's shapes scaled down: a 576-wide latent per token (fp16 here), and
# the indexer's k cache of 132 bytes per token (fp8 keys and their scales).
MLA_DSA = (GroupDef("mla", block_size=16, num_layers=2, head_size=576, indexer_head_size=132),)


def store_and_reload(engine: SyntheticEngine, prompt: list[int], groups: tuple[int, ...]):
    """Runs `prompt`, waits until every offloaded group's chunks are in the scheduler's
    mirror, empties vLLM's cache (scrubbing every block) and runs it again: the second
    run's record."""
    engine.generate([prompt])
    for g in groups:
        engine.wait_ready(engine.offload_keys(prompt, g))
    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    return second


def namespace_infos(admin_target: str) -> dict[str, admin_pb2.NamespaceInfo]:
    """The namespaces a daemon (or one shard) knows: Admin/ListNamespaces."""
    with grpc.insecure_channel(admin_target) as ch:
        answer = admin_pb2_grpc.AdminStub(ch).ListNamespaces(
            admin_pb2.ListNamespacesRequest(), timeout=5
        )
    return {ns.id: ns for ns in answer.namespaces}


def namespaces_on(admin_target: str) -> set[str]:
    return set(namespace_infos(admin_target))


@pytest.mark.parametrize(("shards", "tp"), [(1, 1), (4, 1), (4, 2)])
def test_mla_with_a_dsa_indexer_scheduler_and_workers_share_one_namespace(
    daemon_factory, make_engine, caplog: pytest.LogCaptureFixture, shards: int, tp: int
) -> None:
    """On 4 shards the scheduler and each rank pick their shards from the namespace id:
    two ids put them on different shards (3 times in 4 at TP=1), and every lookup
    misses."""
    args = ("--pool-size", "128MiB") + (("--shards", str(shards)) if shards > 1 else ())
    d = daemon_factory(*args)
    wait_shards(d, shards)
    engine = make_engine(socket=d.target, groups=MLA_DSA, tp=tp, num_gpu_blocks=64)
    engine.wait_registered()
    scheduler_view = engine.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups[0]
    assert type(scheduler_view.kv_cache_spec).__name__ == "MLAAttentionSpec"  # flattened
    worker_view = engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert type(worker_view).__name__ == "UniformTypeKVCacheSpecs"
    layers = engine.group_layers(0)
    assert len({engine.ranks[0].u8[n].shape for n in layers}) == 2  # two page sizes

    prompt = prompt_for(21, 100)  # 6 full blocks of 16 tokens
    second = store_and_reload(engine, prompt, (0,))
    assert second.external_tokens == 96
    [job] = load_jobs(engine)
    assert list(job.dst_spec.group_sizes) == [6]
    for r in range(tp):  # every layer, the indexer's too, from the daemon
        assert_expected(engine, prompt, r, 0, second.block_ids[0][:6])
    assert not [r for r in caplog.records if "scheduler's namespace" in r.getMessage()]
    # The ranks registered in the scheduler's namespace only, on the scheduler's shards:
    # no namespace of their own that nobody reads.
    ns = engine.manager.namespace_id
    used = engine_shards(shards, tp)
    first = first_shard(ns, shards, tp)
    for s in range(shards):
        want = {shard_namespace_id(ns, s - first, used)} if first <= s < first + used else set()
        target = shard_admin(d, s) if shards > 1 else d.admin_target
        assert namespaces_on(target) == want, f"shard {s}"


def test_a_rank_says_when_the_scheduler_computed_another_namespace(
    daemon, make_engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Should the two sides ever read a model differently again, the rank says so, once,
    naming both ids, instead of the engine missing every block in silence."""
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    worker = engine.ranks[0].offloading_worker
    worker._namespace_id = "kvd1-" + "0" * 40  # what a worker that read it otherwise has
    engine.generate([prompt_for(23, 40), prompt_for(24, 40)])
    said = [r.getMessage() for r in caplog.records if "scheduler's namespace" in r.getMessage()]
    assert len(said) == 1 and engine.manager.namespace_id in said[0]
    assert worker.stats["failed_stores"] == 0  # its stores go where the jobs say


@pytest.mark.parametrize(
    "kinds", [("full", "ring", "full"), ("ring", "full")], ids=["groups-0-and-2", "only-group-1"]
)
def test_offloaded_groups_of_any_ids_store_and_reload_byte_for_byte(
    daemon, make_engine, kinds: tuple[str, ...]
) -> None:
    """A compressor ring (DeepSeek-V4's, one block per request) is not prefix-cacheable:
    vLLM offloads the groups around it under their own ids."""
    groups = tuple(GroupDef(kind, block_size=16, num_layers=2) for kind in kinds)
    offloaded = tuple(g for g, kind in enumerate(kinds) if kind != "ring")
    engine = make_engine(socket=daemon.target, groups=groups, num_gpu_blocks=96)
    engine.wait_registered()
    assert engine.manager.namespace_id == engine.ranks[0].offloading_worker._registrar.current
    prompt = prompt_for(22, 120)  # 7 full blocks of 16 tokens
    keys = {g: engine.offload_keys(prompt, g) for g in offloaded}
    assert {k[-4:] for g in offloaded for k in keys[g]} == {g.to_bytes(4, "big") for g in offloaded}
    engine.generate([prompt])
    first = engine.records["req-0"]
    before = {g: pages(engine, 0, g, first.block_ids[g][:7]) for g in offloaded}
    for g in offloaded:
        engine.wait_ready(keys[g])
    worker = engine.ranks[0].offloading_worker
    assert worker.stats["failed_stores"] == 0

    engine.reset_gpu_prefix_cache()  # and scrub every block
    [second] = engine.generate([prompt])
    assert second.external_tokens == 7 * 16
    [job] = load_jobs(engine)
    assert list(job.dst_spec.group_sizes) == [7] * len(offloaded)
    for g in offloaded:
        after = pages(engine, 0, g, second.block_ids[g][:7])
        assert all(bool((a == b).all()) for a, b in zip(before[g], after, strict=True))
        assert_expected(engine, prompt, 0, g, second.block_ids[g][:7])
    assert worker.stats["failed_loads"] == 0
    info = namespace_infos(daemon.admin_target)[engine.manager.namespace_id]
    assert tuple(info.group_ids) == offloaded  # what the operator sees
