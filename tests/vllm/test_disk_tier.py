"""The disk tier (`kvdepot serve --disk`) under vLLM 0.33.0's real Scheduler and worker
connectors: a prompt computed before the daemon restarted (its pool empty since, the
blocks only on disk) is an external hit, through the same RETRY/Prefetch path as the
remote tier, with the bytes the first engine computed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("blake3")

from kvdepot.testing.vllm_engine import prompt_for
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2
from tests.disk.helpers import forget_records
from tests.vllm.engine_proc import run_engine_process

pytestmark = pytest.mark.vllm


def test_a_prompt_only_on_disk_is_an_external_hit(daemon_factory, make_engine, tmp_path) -> None:
    d = daemon_factory(
        "--pool-size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )
    first = run_engine_process(d.target, prompt_seed=11)
    d.stop()  # a clean stop: the disk's index is written, the pool (memfd) is gone
    d.start()

    prompt = prompt_for(11, 160)
    engine = make_engine(socket=d.target, num_gpu_blocks=64)
    engine.wait_registered()
    m = engine.manager
    assert m.namespace_id == first["namespace"]
    keys = engine.offload_keys(prompt)
    assert not any(m.is_ready(k) for k in keys)  # nothing in RAM

    engine.add_request(prompt)
    engine.step()  # RETRY for every key: nothing scheduled, nothing waited for
    assert m.remote_asked == len(keys)
    engine.wait_ready(keys)  # read from disk into the pool, announced on Watch
    engine.run()
    rec = next(iter(engine.records.values()))
    assert rec.external_tokens == 160
    assert m.prefetch_rpcs == 1 and m.remote_gave_up == 0
    assert engine.kv_digest(0, 0, rec.block_ids[0][:10]) == first["digest"]
    s = m._client.admin.GetStats(admin_pb2.GetStatsRequest())
    assert s.disk_hits == len(keys) and s.disk_rejected == 0


def test_a_prefetch_promotes_the_chunks_before_one_no_tier_holds_and_none_after(
    daemon_factory, make_engine, tmp_path
) -> None:
    """Prompt A is on disk but for its chunk 8 (its record lost), prompt B whole. Both
    requests miss in one step: one Prefetch each, so A's hole cuts A only. A's brings
    chunks 0-7 into the pool and nothing after chunk 8 (rows no lookup could reach;
    before, all 19 on disk were promoted); A loads its 8 chunks byte for byte and
    computes the rest, B loads all 20."""
    chunks, hole = 20, 8
    disk = tmp_path / "disk"
    d = daemon_factory("--pool-size", "64MiB", "--disk", str(disk), "--disk-size", "64MiB")
    first = run_engine_process(d.target, prompt_seed=15, length=chunks * 16)
    run_engine_process(d.target, prompt_seed=16, length=chunks * 16)
    keys = [bytes.fromhex(k) for k in first["keys"]]
    wait_for(lambda: d.stats().disk_writes >= 2 * chunks, what="the prompts on disk")
    d.stop()  # a clean stop: the disk's index checkpoint is written
    assert forget_records(disk, [keys[hole]]) == 1  # no tier holds A's chunk 8 now
    d.start()

    engine = make_engine(socket=d.target, num_gpu_blocks=128)
    engine.wait_registered()
    m = engine.manager
    a, b = prompt_for(15, chunks * 16), prompt_for(16, chunks * 16)
    assert engine.offload_keys(a) == keys
    admin = m._client.admin
    engine.add_request(a)
    engine.add_request(b)
    engine.step()  # RETRY for every key, asked of the disk in one Prefetch a request
    assert m.remote_asked == 2 * chunks
    engine.wait_until(lambda: m.prefetch_rpcs == 2, what="the Prefetch answers")
    engine.wait_ready(keys[:hole] + engine.offload_keys(b))
    listed = admin.ListBlocks(admin_pb2.ListBlocksRequest(namespace_id=m.namespace_id))
    # Every row a Prefetch claimed was claimed before it answered: the pool holds A's 8
    # leading chunks and B's 20, ready, and nothing else.
    held = {row.key for row in listed.blocks if row.state == "ready"}
    assert len(listed.blocks) == len(held) == hole + chunks
    assert set(keys[:hole]) <= held and not held & set(keys[hole:])
    assert admin.GetStats(admin_pb2.GetStatsRequest()).disk_hits == hole + chunks

    engine.run()
    rec_a, rec_b = engine.records.values()
    assert (rec_a.external_tokens, rec_b.external_tokens) == (hole * 16, chunks * 16)
    for prompt, rec, n in ((a, rec_a, hole), (b, rec_b, chunks)):
        for i, block in enumerate(rec.block_ids[0][:n]):
            for name in engine.group_layers(0):
                want = engine.expected_page(prompt, 0, i, name, 0)
                assert bool((engine.page(0, name, block) == want).all()), (name, i)
    assert m.remote_gave_up == 0


def test_a_request_that_asks_for_ram_only_never_waits_on_the_disk(
    daemon_factory, make_engine, tmp_path
) -> None:
    """vLLM's per-request `kv_load_tiers`: {"medium": "CPU"} loads from the pool only, so
    a prompt only on disk is a miss for it at once (no RETRY, no Prefetch); a request
    that allows storage loads another prompt from disk."""
    d = daemon_factory(
        "--pool-size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )
    run_engine_process(d.target, prompt_seed=12)
    run_engine_process(d.target, prompt_seed=13)
    d.stop()
    d.start()  # the pool empty, the blocks on disk
    engine = make_engine(socket=d.target, num_gpu_blocks=64)
    engine.wait_registered()
    m = engine.manager
    ram_only = {"kv_load_tiers": [{"medium": "CPU", "locality": "LOCAL"}]}
    engine.add_request(prompt_for(12, 160), kv_transfer_params=ram_only)
    engine.run()
    assert m.remote_asked == 0 and m.prefetch_rpcs == 0
    storage = {"kv_load_tiers": [{"medium": "STORAGE"}, {"medium": "CPU"}]}
    engine.add_request(prompt_for(13, 160), kv_transfer_params=storage)
    engine.run()
    assert [r.external_tokens for r in engine.records.values()] == [0, 160]
    assert m.prefetch_rpcs == 1


def test_a_prompt_stored_after_the_disk_lacked_it_comes_back_from_disk(
    daemon_factory, make_engine, tmp_path
) -> None:
    """The first time, the tiers below the pool lack the prompt (ABSENT: computed, and
    not asked for again for a while); the engine then stores it and RAM evicts it to
    disk. Asked again seconds later, it is asked of the disk again (the store made the
    "absent" stale) and is an external hit."""
    d = daemon_factory(
        "--pool-size", "4MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )  # fmt: skip
    engine = make_engine(socket=d.target, num_gpu_blocks=64)
    engine.wait_registered()
    m = engine.manager
    prompt = prompt_for(12, 160)
    keys = engine.offload_keys(prompt)
    [rec] = engine.generate([prompt])
    assert rec.external_tokens == 0 and m.remote_asked == len(keys)  # absent below: computed
    engine.wait_ready(keys)

    def admin() -> admin_pb2.GetStatsResponse:
        return m._client.admin.GetStats(admin_pb2.GetStatsRequest())

    engine.wait_until(lambda: admin().disk_writes >= len(keys), what="the prompt on disk")
    # Other prompts push it out of the 4 MiB pool (the mirror follows the evictions).
    for seed in range(100, 140):
        engine.generate([prompt_for(seed, 160)])
        if not any(m.is_ready(k) for k in keys):
            break
    assert not any(m.is_ready(k) for k in keys), "the prompt was not evicted from RAM"

    engine.reset_gpu_prefix_cache()
    asked = m.remote_asked
    engine.add_request(prompt)
    engine.step()
    assert m.remote_asked == asked + len(keys)  # asked of the disk again, not missed
    engine.wait_ready(keys)
    engine.run()
    rec = list(engine.records.values())[-1]
    assert rec.external_tokens == 160
    assert admin().disk_hits >= len(keys)


def test_a_prompt_loaded_from_disk_and_evicted_again_is_asked_of_the_disk_again(
    daemon_factory, make_engine, tmp_path
) -> None:
    """A key fetched from disk and loaded is no longer "being fetched": RAM evicting it
    again and a request asking for it again sends a new Prefetch at once (before, it
    answered RETRY without asking until `kvdepot_remote_wait_ms` ran out, then was
    recomputed and not asked for again for 10 s)."""
    d = daemon_factory(
        "--pool-size", "4MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )  # fmt: skip
    engine = make_engine(
        socket=d.target, num_gpu_blocks=64, extra_config={"kvdepot_remote_wait_ms": 60_000}
    )
    engine.wait_registered()
    m = engine.manager
    # The once-a-second prune would forget keys it saw ready: the test must not
    # depend on when it runs.
    m._remote._next_prune = float("inf")
    prompt = prompt_for(13, 160)
    keys = engine.offload_keys(prompt)
    engine.generate([prompt])
    engine.wait_ready(keys)
    admin = m._client.admin

    def evict_from_ram() -> None:
        admin.Evict(admin_pb2.EvictRequest(namespace_id=m.namespace_id, keys=keys))
        engine.wait_until(lambda: not any(m.is_ready(k) for k in keys), what="RAM evicted")

    engine.wait_until(
        lambda: admin.GetStats(admin_pb2.GetStatsRequest()).disk_writes >= len(keys),
        what="the prompt on disk",
    )
    for round_ in range(2):  # fetched from disk and loaded, twice
        evict_from_ram()
        engine.reset_gpu_prefix_cache()
        asked = m.remote_asked
        engine.add_request(prompt)
        engine.step()
        assert m.remote_asked == asked + len(keys), round_  # asked of the disk at once
        engine.run(timeout=20)
        rec = list(engine.records.values())[-1]
        assert rec.external_tokens == 160, round_
    assert m.remote_gave_up == 0


def test_prompt_tokens_cached_by_source_says_disk_then_host(
    daemon_factory, make_engine, tmp_path, monkeypatch
) -> None:
    """vLLM's `vllm:prompt_tokens_cached_by_source`: tokens a load brought from the
    daemon's disk count as `disk`, the same tokens loaded again from the pool as `host`."""
    from collections import Counter

    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    d = daemon_factory(
        "--pool-size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )
    run_engine_process(d.target, prompt_seed=14)
    d.stop()
    d.start()  # the pool empty, the blocks on disk
    engine = make_engine(socket=d.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(14, 160)
    keys = engine.offload_keys(prompt)
    # What vLLM's stats loggers read each step (SchedulerStats), summed.
    by_source: Counter = Counter()
    make_stats = engine.scheduler.make_stats

    def recorded(*args, **kwargs):
        stats = make_stats(*args, **kwargs)
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            by_source.update(stats.connector_prefix_cache_stats.hits_by_source)
        return stats

    monkeypatch.setattr(engine.scheduler, "make_stats", recorded)
    engine.add_request(prompt)
    engine.step()  # RETRY: the disk promotes the keys
    engine.wait_ready(keys)
    engine.run()
    assert dict(by_source) == {CacheHitSource.DISK: 160}
    engine.reset_gpu_prefix_cache()
    engine.add_request(prompt)
    engine.run()
    assert dict(by_source) == {CacheHitSource.DISK: 160, CacheHitSource.HOST: 160}
