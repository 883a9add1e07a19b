"""An engine on a sharded daemon (`kvdepot serve --shards 2`, `kvdepot_shards: 2`), driven
by vLLM 0.33.0's real Scheduler and real WORKER-role connectors: rank r talks to shard
r, the scheduler reads both shards, and a block is a hit only while both shards
hold their sections (kvdepot.common.shards). A TP=8 engine, the node's case, runs on
1, 2, 4 and 8 shards, and a hybrid one on four.
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest

pytest.importorskip("vllm")

from kvdepot.common.shards import first_shard, shard_namespace_id, shard_socket
from kvdepot.testing.daemon import stats
from kvdepot.testing.environment import model_dir_for_tp
from kvdepot.testing.vllm_engine import GroupDef, SyntheticEngine, prompt_for
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.vllm.test_connector import (
    add_with_rank_1_behind,
    assert_expected,
    assert_same_bytes,
    pages,
    reload_hybrid,
)

pytestmark = pytest.mark.vllm

SHARDED = {"kvdepot_shards": 2, "kvdepot_pin_timeout_ms": 10_000}


def shard_admin(d, shard: int) -> str:
    """The operators' socket of `shard`: beside its data socket, as for one daemon."""
    return f"unix://{shard_socket(d.socket_path, shard)}.admin"


def shard_stats(d, shard: int) -> admin_pb2.GetStatsResponse:
    return stats(shard_admin(d, shard))


def assert_loads_back(engine: SyntheticEngine, prompt: list[int], ranks: tuple[int, ...]) -> None:
    """Stores `prompt`, empties vLLM's cache and generates it again: its 96 full-block
    tokens come from kvdepot, and every rank's pages are what the model expects."""
    engine.generate([prompt])
    engine.wait_ready(engine.offload_keys(prompt))
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([prompt])
    assert again.external_tokens == 96
    for r in ranks:
        assert_expected(engine, prompt, r, 0, again.block_ids[0][:6])


def wait_both_shards(d) -> None:
    """Until shard 1 answers too (shard 0 serves once the daemon has started)."""
    wait_shards(d, 2)


def wait_shards(d, count: int) -> None:
    """Until every one of `count` shards answers (shard 0 serves once the daemon has
    started)."""
    for shard in range(1, count):
        wait_for(lambda s=shard: _answers(d, s), 30, f"shard {shard} to serve", detail=d.log)


def _answers(d, shard: int) -> bool:
    d.check_alive()
    try:
        return shard_stats(d, shard).shard == shard
    except grpc.RpcError:
        return False


@pytest.fixture
def sharded(daemon_factory):
    """A daemon of two shards, 64 MiB of pool each, both serving."""
    d = daemon_factory("--pool-size", "128MiB", "--shards", "2")
    wait_both_shards(d)
    return d


def test_tp2_ranks_each_use_their_shard_and_get_their_bytes_back(sharded, make_engine) -> None:
    engine: SyntheticEngine = make_engine(
        socket=sharded.target, tp=2, num_gpu_blocks=64, extra_config=SHARDED
    )
    engine.wait_registered()
    for r in (0, 1):  # rank r is rank 0 of a world of one on shard r
        client = engine.ranks[r].offloading_worker._client
        assert (client.hello.shard, client.hello.shard_count) == (r, 2)
    manager = engine.manager
    prompt = prompt_for(7, 100)  # 6 full blocks
    keys = engine.offload_keys(prompt)

    add_with_rank_1_behind(engine, prompt)  # rank 1 (shard 1) lags: its stores wait
    on_shard0 = shard_namespace_id(manager.namespace_id, 0, 2)
    engine.wait_until(
        lambda: all(manager._clients[0].lookup(on_shard0, keys)), what="shard 0's rows"
    )
    # Shard 0's rows are complete, shard 1 has nothing: the scheduler sees no hit.
    assert not any(manager.is_ready(k) for k in keys)

    engine.ranks[1].paused = False
    engine.run()
    engine.wait_ready(keys)
    # Each shard holds one rank's section of every block, and only that.
    held = [shard_stats(sharded, s) for s in (0, 1)]
    assert [s.shard for s in held] == [0, 1]
    assert held[0].used_bytes == held[1].used_bytes > 0
    first = engine.records["req-0"]
    before = [pages(engine, r, 0, first.block_ids[0][:6]) for r in (0, 1)]

    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    assert second.external_tokens == 96
    for r in (0, 1):  # each rank got its own section back, from its own shard
        assert_same_bytes(before[r], pages(engine, r, 0, second.block_ids[0][:6]))
        assert_expected(engine, prompt, r, 0, second.block_ids[0][:6])
    assert manager.pin_failures == 0
    # The load's pins were taken on both shards and handed back on both.
    engine.wait_until(
        lambda: all(shard_stats(sharded, s).pinned_blocks == 0 for s in (0, 1)),
        what="both shards unpinned",
    )


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_a_tp8_engine_on_every_shard_count_gets_each_ranks_bytes_back(
    shards, daemon_factory, make_engine, tmp_path
) -> None:
    """The node's case: a TP=8 engine left at the README's config (`kvdepot_shards`
    auto) on a daemon of 1, 2, 4 or 8 shards. Shard s serves the 8/N consecutive ranks
    8s/N.. as ranks 0..8/N-1 of a world of its own, its rows hold exactly their
    sections, and every rank's pages load back from its own shard."""
    per_shard = 8 // shards
    d = daemon_factory("--pool-size", f"{64 * shards}MiB", "--shards", str(shards))
    wait_shards(d, shards)
    engine: SyntheticEngine = make_engine(
        socket=d.target, tp=8, num_gpu_blocks=64, model_dir=str(model_dir_for_tp(8, tmp_path))
    )
    engine.wait_registered()
    namespace = engine.manager.namespace_id
    for shard in range(shards):
        with grpc.insecure_channel(shard_admin(d, shard)) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            engines = admin.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines
            spaces = admin.ListNamespaces(admin_pb2.ListNamespacesRequest(), timeout=5)
        on_shard = shard_namespace_id(namespace, shard, shards)
        ranks = sorted(
            reg.rank for e in engines for reg in e.registrations if reg.namespace_id == on_shard
        )
        assert ranks == list(range(per_shard)), f"shard {shard}"
        [space] = [n for n in spaces.namespaces if n.id == on_shard]
        assert space.world_size == per_shard
    for r in range(8):  # rank r talks to shard r // (8 / N) alone
        hello = engine.ranks[r].offloading_worker._client.hello
        assert hello.shard == r // per_shard

    prompt = prompt_for(11, 100)  # 6 full blocks
    [first] = engine.generate([prompt])
    engine.wait_ready(engine.offload_keys(prompt))
    before = [pages(engine, r, 0, first.block_ids[0][:6]) for r in range(8)]
    held = [shard_stats(d, s) for s in range(shards)]
    # Every shard holds its ranks' share of the six rows, the same bytes each.
    assert len({s.used_bytes for s in held}) == 1 and held[0].used_bytes > 0
    assert sum(s.ready_blocks for s in held) == 6 * shards

    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    assert second.external_tokens == 96
    for r in range(8):
        assert_same_bytes(before[r], pages(engine, r, 0, second.block_ids[0][:6]))
        assert_expected(engine, prompt, r, 0, second.block_ids[0][:6])
    assert engine.manager.pin_failures == 0
    engine.wait_until(
        lambda: all(shard_stats(d, s).pinned_blocks == 0 for s in range(shards)),
        what="every shard unpinned",
    )


def test_a_hybrid_tp8_engine_on_four_shards_loads_both_groups_on_every_rank(
    daemon_factory, make_engine, tmp_path
) -> None:
    """A hybrid model (full attention and a sliding window of another block size) at
    TP=8 on four shards, two ranks each: the load brings both groups' blocks back to
    all eight ranks, the sliding window's only as far as its window."""
    d = daemon_factory("--pool-size", "256MiB", "--shards", "4")
    wait_shards(d, 4)
    # Equal page bytes, as vLLM's hybrid allocator wants: 16 tokens x 2 heads = 32 x 1.
    groups = (
        GroupDef("full", block_size=16, num_layers=2, num_kv_heads=2),
        GroupDef("sliding_window", block_size=32, num_layers=2, sliding_window=64, num_kv_heads=1),
    )
    engine: SyntheticEngine = make_engine(
        socket=d.target,
        tp=8,
        groups=groups,
        num_gpu_blocks=96,
        model_dir=str(model_dir_for_tp(8, tmp_path)),
    )
    engine.wait_registered()
    prompt = prompt_for(2, 300)
    _, job, full_n = reload_hybrid(engine, prompt)
    spec = job.dst_spec
    assert 1 <= spec.group_sizes[1] <= 3  # the sliding window's blocks only
    full_ids = [int(b) for b in spec.block_ids[:full_n]]
    swa_ids = [int(b) for b in spec.block_ids[full_n:]]
    for r in range(8):  # each from its own shard, both groups
        assert_expected(engine, prompt, r, 0, full_ids, first_logical=spec.block_indices[0])
        assert_expected(engine, prompt, r, 1, swa_ids, first_logical=spec.block_indices[1])
    assert engine.manager.pin_failures == 0
    engine.wait_until(
        lambda: all(shard_stats(d, s).pinned_blocks == 0 for s in range(4)),
        what="every shard unpinned",
    )


def test_a_block_one_shard_lost_is_recomputed_not_loaded(sharded, make_engine) -> None:
    engine = make_engine(socket=sharded.target, tp=2, num_gpu_blocks=64, extra_config=SHARDED)
    engine.wait_registered()
    manager = engine.manager
    prompt = prompt_for(8, 100)
    keys = engine.offload_keys(prompt)
    engine.generate([prompt])
    engine.wait_ready(keys)

    # Shard 1 alone evicts the first block (its LRU, or an operator): shard 0 still
    # holds its section, so the block must read as a miss from now on.
    with grpc.insecure_channel(shard_admin(sharded, 1)) as ch:
        answer = admin_pb2_grpc.AdminStub(ch).Evict(
            admin_pb2.EvictRequest(
                namespace_id=shard_namespace_id(manager.namespace_id, 1, 2), keys=keys[:1]
            ),
            timeout=5,
        )
    assert answer.evicted_blocks == 1
    engine.wait_until(lambda: not manager.is_ready(keys[0]), what="the mirror to drop key 0")
    assert all(manager.is_ready(k) for k in keys[1:])
    on_shard0 = shard_namespace_id(manager.namespace_id, 0, 2)
    assert manager._clients[0].lookup(on_shard0, keys[:1]) == [True]

    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    assert second.external_tokens == 0  # the prefix's first block missed: nothing after it
    for r in (0, 1):
        assert_expected(engine, prompt, r, 0, second.block_ids[0][:6])
    worker_failures = [engine.ranks[r].offloading_worker.stats["failed_loads"] for r in (0, 1)]
    assert worker_failures == [0, 0]


def test_an_engine_set_for_shards_refuses_an_unsharded_daemon(daemon, make_engine) -> None:
    """kvdepot_shards: 2 against a daemon of one shard: rank 0 is refused with the fix
    in its words (rank 1's shard socket does not exist), and the engine runs on, missing."""
    # Shard 1's socket never appears: wait for it briefly (the scheduler and rank 1 start
    # without it either way).
    start_fast = {**SHARDED, "kvdepot_startup_wait_s": 0.2}
    engine = make_engine(socket=daemon.target, tp=2, num_gpu_blocks=64, extra_config=start_fast)
    worker = engine.ranks[0].offloading_worker
    namespace = shard_namespace_id(engine.manager.namespace_id, 0, 2)
    engine.wait_until(lambda: worker._registrar.refused(namespace) is not None, what="a refusal")
    reason = worker._registrar.refused(namespace)
    assert "shard 0 of 1" in reason and "kvdepot_shards must equal" in reason
    started = time.monotonic()
    assert not worker.wait_registered(5.0)  # refused: no use waiting out the timeout
    assert time.monotonic() - started < 1.0
    prompt = prompt_for(9, 100)
    [first] = engine.generate([prompt])
    assert first.external_tokens == 0
    assert_expected(engine, prompt, 0, 0, first.block_ids[0][:6])
    assert stats(daemon.admin_target).used_bytes == 0  # nothing stored in a wrong layout


def test_a_connector_reset_moves_every_shard_to_the_new_namespace(sharded, make_engine) -> None:
    engine = make_engine(socket=sharded.target, tp=2, num_gpu_blocks=64, extra_config=SHARDED)
    engine.wait_registered()
    prompt = prompt_for(11, 100)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    manager = engine.manager
    base = manager.namespace_id
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    [after] = engine.generate([prompt])
    assert after.external_tokens == 0  # nothing from before the reset, on either shard
    for shard in (0, 1):  # the old rows stay on both shards for other engines
        old = shard_namespace_id(base, shard, 2)
        assert manager._clients[shard].lookup(old, keys) == [True] * len(keys)
    engine.wait_registered()
    assert_loads_back(engine, prompt_for(12, 100), (0, 1))


def test_a_block_on_both_shards_disks_is_fetched_from_both(
    daemon_factory, make_engine, tmp_path
) -> None:
    """With `--disk`, each shard writes its ranks' sections to its own directory. A prompt
    RAM no longer holds on either shard is asked of both (one Prefetch each), comes back
    into both pools, and loads each rank's own bytes."""
    pytest.importorskip("blake3")
    d = daemon_factory(
        "--pool-size", "128MiB", "--shards", "2",
        "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB",
    )  # fmt: skip
    engine = make_engine(socket=d.target, tp=2, num_gpu_blocks=64, extra_config=SHARDED)
    engine.wait_registered()
    m = engine.manager
    prompt = prompt_for(13, 100)
    keys = engine.offload_keys(prompt)
    [first] = engine.generate([prompt])
    assert first.external_tokens == 0
    engine.wait_ready(keys)
    engine.wait_until(
        lambda: all(shard_stats(d, s).disk_writes >= len(keys) for s in (0, 1)),
        what="both shards' sections on disk",
    )
    before = [pages(engine, r, 0, first.block_ids[0][:6]) for r in (0, 1)]
    for shard in (0, 1):  # RAM lets go of them on both shards; the disks keep them
        with grpc.insecure_channel(shard_admin(d, shard)) as ch:
            namespace = shard_namespace_id(m.namespace_id, shard, 2)
            admin_pb2_grpc.AdminStub(ch).Evict(
                admin_pb2.EvictRequest(namespace_id=namespace), timeout=5
            )
    engine.wait_until(lambda: not any(m.is_ready(k) for k in keys), what="the mirror to drop them")

    engine.reset_gpu_prefix_cache()
    asked, rpcs = m.remote_asked, m.prefetch_rpcs  # the first run asked too (absent then)
    engine.add_request(prompt)
    engine.step()  # RETRY for every key: asked of both shards
    assert m.remote_asked == asked + len(keys)
    engine.wait_ready(keys)
    engine.run()
    second = next(r for r in engine.records.values() if r is not first)
    assert second.external_tokens == 96
    assert m.prefetch_rpcs == rpcs + 2  # one per shard
    for r in (0, 1):
        assert_same_bytes(before[r], pages(engine, r, 0, second.block_ids[0][:6]))
    assert [shard_stats(d, s).disk_hits for s in (0, 1)] == [len(keys)] * 2


def test_an_engine_told_one_shard_works_on_shard_0_and_says_so(
    sharded, make_engine, caplog
) -> None:
    """The daemon runs two shards, the engine sets kvdepot_shards to 1: every rank uses
    shard 0 as one daemon (correct, one core), and the scheduler's log names the fix."""
    caplog.set_level("WARNING", logger="kvdepot.vllm.manager")
    engine = make_engine(
        socket=sharded.target, tp=2, num_gpu_blocks=64, extra_config={"kvdepot_shards": 1}
    )
    engine.wait_registered()
    assert_loads_back(engine, prompt_for(14, 100), (0, 1))
    assert shard_stats(sharded, 1).used_bytes == 0  # shard 1 was never used
    said = [r.getMessage() for r in caplog.records if "kvdepot_shards" in r.getMessage()]
    assert said and "runs 2 shard(s) but kvdepot_shards is 1; set it to 2" in said[0]


def test_an_engine_left_at_auto_finds_the_shards_by_itself(sharded, make_engine, caplog) -> None:
    """No kvdepot_shards (the README's config): the scheduler and each rank read the
    shard count from the daemon's hello and route as if told, and nothing is logged
    as a mismatch."""
    caplog.set_level("INFO", logger="kvdepot")
    engine = make_engine(socket=sharded.target, tp=2, num_gpu_blocks=64)
    engine.wait_registered()
    for r in (0, 1):
        hello = engine.ranks[r].offloading_worker._client.hello
        assert (hello.shard, hello.shard_count) == (r, 2)
    assert [c.hello.shard for c in engine.manager._clients] == [0, 1]
    assert_loads_back(engine, prompt_for(15, 100), (0, 1))
    assert all(shard_stats(sharded, s).used_bytes > 0 for s in (0, 1))
    said = [r.getMessage() for r in caplog.records]
    assert any("runs 2 shards (kvdepot_shards auto)" in m for m in said)
    assert not any("but kvdepot_shards" in m or "restart the engine" in m for m in said)
    # Only the engine's sessions are left: the one that asked was reused or closed.
    engine.wait_until(
        lambda: [shard_stats(sharded, s).sessions for s in (0, 1)] == [2, 2],
        what="two sessions a shard: the scheduler's and its rank's",
    )


def test_an_engine_started_before_the_daemon_uses_shard_0_and_says_restart(
    daemon_factory, make_engine, caplog
) -> None:
    """kvdepot_shards auto, and the daemon not up yet: the engine starts anyway and
    counts one shard; the daemon then comes up with two, and the engine works on shard
    0 alone (correct, one core) while the scheduler's log says to restart it."""
    caplog.set_level("INFO", logger="kvdepot.vllm")
    d = daemon_factory("--pool-size", "128MiB", "--shards", "2", start=False)
    engine = make_engine(
        socket=d.target, tp=2, num_gpu_blocks=64, extra_config={"kvdepot_startup_wait_s": 0.2}
    )
    d.start()
    engine.wait_registered()
    # The scheduler reconnects by itself, with backoff; it offers stores once back.
    engine.wait_until(lambda: engine.manager.connected, what="the scheduler back")
    assert_loads_back(engine, prompt_for(16, 100), (0, 1))
    assert shard_stats(d, 0).used_bytes > 0 and shard_stats(d, 1).used_bytes == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("kvdepot_shards is auto and the daemon" in m for m in said), said
    assert any(
        "runs 2 shard(s) but this engine found 1 when it started (kvdepot_shards auto); "
        "restart the engine" in m
        for m in said
    ), said


def test_tp1_engines_of_other_models_spread_over_the_shards(sharded, make_engine) -> None:
    """TP=1 engines use one shard of the two, the one their namespace picks
    (kvdepot.common.shards.first_shard): engines of two salts (two models) land on
    both shards and each gets its bytes back there; an engine of the same salt as
    another meets it on its shard and loads the blocks it stored."""
    on_shard: dict[int, tuple[str, SyntheticEngine]] = {}
    for salt in [f"model-{c}" for c in "abcdefgh"]:
        config = {**SHARDED, "kvdepot_namespace_salt": salt}
        engine = make_engine(socket=sharded.target, tp=1, num_gpu_blocks=64, extra_config=config)
        engine.wait_registered()
        hello = engine.ranks[0].offloading_worker._client.hello
        assert hello.shard_count == 2
        assert engine.manager._clients[0].hello.shard == hello.shard  # scheduler agrees
        on_shard.setdefault(hello.shard, (salt, engine))
        if len(on_shard) == 2:
            break
    assert sorted(on_shard) == [0, 1]
    for shard, (_, engine) in on_shard.items():
        assert_loads_back(engine, prompt_for(30 + shard, 100), (0,))
    assert all(shard_stats(sharded, s).used_bytes > 0 for s in (0, 1))
    salt, _ = on_shard[1]
    twin = make_engine(
        socket=sharded.target,
        tp=1,
        num_gpu_blocks=64,
        extra_config={**SHARDED, "kvdepot_namespace_salt": salt},
    )
    twin.wait_registered()
    assert twin.ranks[0].offloading_worker._client.hello.shard == 1
    prompt = prompt_for(31, 100)
    twin.wait_ready(twin.offload_keys(prompt))  # the mirror has the other engine's rows
    [shared] = twin.generate([prompt])
    assert shared.external_tokens == 96
    assert_expected(twin, prompt, 0, 0, shared.block_ids[0][:6])


def test_kvdepot_first_shard_places_an_engine(sharded, make_engine, caplog) -> None:
    """kvdepot_first_shard puts a TP=1 engine on the shard it names, whatever its
    namespace would pick (two engines of one namespace, told 1 and 0, land on 1 and 0);
    a shard the node does not have is said in the log, and the namespace's pick used."""
    caplog.set_level("WARNING", logger="kvdepot.vllm")
    placed = {}
    for shard in (1, 0, 5):
        config = {"kvdepot_namespace_salt": "placed", "kvdepot_first_shard": shard}
        engine = make_engine(socket=sharded.target, tp=1, num_gpu_blocks=64, extra_config=config)
        engine.wait_registered()
        on = engine.ranks[0].offloading_worker._client.hello.shard
        assert engine.manager._clients[0].hello.shard == on  # the scheduler agrees
        placed[shard] = (on, engine)
    assert placed[1][0] == 1 and placed[0][0] == 0
    assert placed[5][0] == first_shard(placed[5][1].manager.namespace_id, 2, 1)
    said = [r.getMessage() for r in caplog.records if "kvdepot_first_shard" in r.getMessage()]
    assert said and "kvdepot_first_shard is 5" in said[0] and "picks" in said[0]
    assert_loads_back(placed[1][1], prompt_for(40, 100), (0,))
    assert shard_stats(sharded, 1).used_bytes > 0


def test_a_step_whose_pins_all_went_early_keeps_every_shards_pin_lane(
    sharded, make_engine, monkeypatch
) -> None:
    """With shards, a step's end sends each shard the keys not yet sent before it reads
    any answer. When every key already went early, nothing is left to send, and no
    empty call may go: its answer (an empty datagram) reads as the daemon closing the
    lane, so every shard's lane was dropped and reopened at every such step."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvdepot.client.vllm import pins as pins_module

    monkeypatch.setattr(pins_module, "EARLY_PIN_KEYS", 4)
    engine: SyntheticEngine = make_engine(
        socket=sharded.target, tp=2, num_gpu_blocks=64, extra_config=SHARDED
    )
    engine.wait_registered()
    prompt = prompt_for(31, 100)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)[:4]  # exactly one early part
    engine.wait_ready(keys)
    manager = engine.manager
    engine.wait_until(lambda: manager.lanes_open, what="both shards' lanes")
    before = [shard_stats(sharded, s) for s in (0, 1)]

    manager.prepare_load(keys, ReqContext(req_id="r"))  # the part goes to both shards
    manager.on_schedule_end(None)  # type: ignore[arg-type]

    assert manager.lanes_open  # neither shard's lane was dropped
    after = [shard_stats(sharded, s) for s in (0, 1)]
    for b, a in zip(before, after, strict=True):
        assert a.pinned_blocks == 4
        assert (a.pin_calls - b.pin_calls, a.lane_pins - b.lane_pins) == (1, 1)  # on the lane
    assert manager.pin_failures == 0
    manager.complete_load(keys, ReqContext(req_id="r"))
    engine.wait_until(
        lambda: all(shard_stats(sharded, s).pinned_blocks == 0 for s in (0, 1)),
        what="both shards unpinned",
    )


def test_a_shard_killed_mid_load_costs_a_recompute_and_the_service_comes_back_warm(
    daemon_factory, make_engine, tmp_path
) -> None:
    """Shard 1 of a service on pool files dies (SIGKILL) while a TP=2 engine's load is in
    flight on it: the service goes down whole (exit non-zero, for systemd's
    Restart=on-failure), no step of the engine waits past its deadlines, and the load is
    recomputed with the right bytes. Started again as systemd would, each shard recovers
    its own pool file (shard 1 from its journal, after the crash), the engine reconnects
    to both by itself, and a prompt stored before the crash loads back from both shards
    with the bytes it had."""
    d = daemon_factory(
        "--pool-size", "128MiB", "--shards", "2", "--pool-file", str(tmp_path / "pool")
    )
    wait_both_shards(d)
    engine = make_engine(
        socket=d.target,
        tp=2,
        num_gpu_blocks=96,
        extra_config={"kvdepot_shards": 2, "kvdepot_pin_timeout_ms": 50},
    )
    engine.wait_registered()
    kept = prompt_for(21, 100)  # stored before the crash, loaded back after it
    [stored] = engine.generate([kept])
    engine.wait_ready(engine.offload_keys(kept))
    before = [pages(engine, r, 0, stored.block_ids[0][:6]) for r in (0, 1)]
    prompt = prompt_for(22, 100)
    engine.generate([prompt])
    engine.wait_ready(engine.offload_keys(prompt))
    engine.reset_gpu_prefix_cache()

    # Shard 1 frozen, so that rank 1's load is surely in flight on it; then killed.
    pids = [int(d.wait_log(rf"shard {i}/2 started \(pid (\d+)\)").group(1)) for i in (0, 1)]
    os.kill(pids[1], signal.SIGSTOP)
    killed: list[float] = []

    def kill_after_loads_started(eng: SyntheticEngine) -> None:
        if not killed and any(m.load_jobs for m in eng.metadata_log[-1:]):
            killed.append(time.monotonic())
            os.kill(pids[1], signal.SIGKILL)

    engine.after_start_load = kill_after_loads_started
    req = engine.add_request(prompt)
    slowest = 0.0
    deadline = time.monotonic() + 30
    while engine.busy():
        assert time.monotonic() < deadline, "the request never finished"
        t = time.monotonic()
        engine.step()
        slowest = max(slowest, time.monotonic() - t)
        time.sleep(0.002)
    engine.after_start_load = None
    assert killed, "the load was never started"
    rec = engine.records[req]
    assert rec.finished and rec.external_tokens == 96
    # Rank 1's load died with its shard: vLLM recomputed those blocks, with the right bytes.
    assert engine.ranks[1].connector.connector_worker.load_errors == 1
    assert set(rec.block_ids[0][:6]) <= set(engine.invalid_block_ids)
    for r in (0, 1):
        assert_expected(engine, prompt, r, 0, rec.block_ids[0][:6])
    assert slowest < 1.0, f"a step took {slowest:.3f}s"

    # The service went down whole, as systemd's Restart=on-failure expects.
    assert d.proc is not None
    assert d.proc.wait(timeout=15) not in (0, None), d.log()
    assert "shard 1 was killed by SIGKILL; stopping the other shards" in d.log()
    engine.wait_until(lambda: not engine.manager.connected, what="the scheduler to see it")
    engine.reset_gpu_prefix_cache()
    [down] = engine.generate([kept])
    assert down.external_tokens == 0  # lookups miss while it is down; nothing hangs
    for r in (0, 1):
        assert_expected(engine, kept, r, 0, down.block_ids[0][:6])

    # Started again over the same pool files: both shards warm, the engine back on both.
    d.start()
    wait_both_shards(d)
    engine.wait_until(lambda: engine.manager.connected, timeout=20, what="both shards back")
    engine.wait_registered()
    engine.wait_ready(engine.offload_keys(kept), timeout=20)
    # Shard 0 was stopped cleanly by the supervisor (a snapshot), shard 1 was killed (its
    # journal, verified): each came back by its own path.
    assert re.search(r"shard 0/2 kvdepot\.snapshot: warm restart: re-attached [1-9]", d.log())
    d.wait_log(  # its summary follows the last row it serves
        r"shard 1/2 kvdepot\.journal: crash recovery: (\d+) of \1 block\(s\) "
        r"checked, \1 served, 0 rejected"
    )
    failed = [engine.ranks[r].offloading_worker.stats["failed_loads"] for r in (0, 1)]
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([kept])
    assert again.external_tokens == 96
    for r in (0, 1):
        assert_same_bytes(before[r], pages(engine, r, 0, again.block_ids[0][:6]))
    assert [engine.ranks[r].offloading_worker.stats["failed_loads"] for r in (0, 1)] == failed
