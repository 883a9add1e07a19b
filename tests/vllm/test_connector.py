"""KVDepotConnector against a real `kvdepot serve` process, driven by vLLM 0.33.0's
real Scheduler and real WORKER-role connectors: what a user of the connector relies on.

Every scenario compares KV bytes: the worker tensors live in a memfd the daemon
maps, the model stand-in writes bytes that depend only on the token prefix,
layer, head and rank, and memory is scrubbed before a load so that only the
daemon can bring the bytes back.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvdepot.client.vllm.connector import KVDepotConnector
from kvdepot.testing.vllm_engine import (
    GroupDef,
    RequestRecord,
    SyntheticEngine,
    prompt_for,
)
from tests.vllm.engine_proc import run_engine_process

pytestmark = pytest.mark.vllm


def pages(engine: SyntheticEngine, rank: int, group: int, block_ids: list[int]) -> list:
    """The bytes of these blocks in every layer of a group, in order."""
    layers = engine.group_layers(group, rank)
    return [engine.page(rank, name, b) for name in layers for b in block_ids]


def assert_same_bytes(before: list, after: list) -> None:
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        assert a.shape == b.shape
        assert bool((a == b).all()), f"page {i} differs"


def assert_expected(
    engine: SyntheticEngine,
    prompt: list[int],
    rank: int,
    group: int,
    block_ids: list[int],
    first_logical: int = 0,
) -> None:
    """Every byte of these blocks is what the model computes for the prompt."""
    for name in engine.group_layers(group, rank):
        for i, b in enumerate(block_ids):
            want = engine.expected_page(prompt, group, first_logical + i, name, rank)
            got = engine.page(rank, name, b)
            assert bool((got == want).all()), f"{name} block {b} (logical {first_logical + i})"


def load_jobs(engine: SyntheticEngine) -> list:
    return [job for meta in engine.metadata_log for job in meta.load_jobs.values()]


# -- 1. one group: store, reset the GPU prefix cache, load, same bytes --------------------


@pytest.mark.parametrize(
    ("memory", "path", "sync"),
    [
        ("memfd", "shm", False),
        ("plain", "shm", False),
        ("plain", "pvm", False),
        ("plain", "inline", False),
        ("memfd", "shm", True),
    ],
    ids=["shm", "moved-to-memfd", "pvm", "inline", "shm-in-step"],
)
def test_store_reset_load_same_bytes(
    daemon, daemon_factory, make_engine, memory: str, path: str, sync: bool
) -> None:
    """`memory` is where the engine's KV cache lives: a memfd from the start, or plain
    process memory as in a real CPU engine (which "auto" moves into a memfd; "pvm" and
    "inline" are asked for by name)."""
    # in-step: vLLM loads within the step (expedited job, then wait()).
    extra: dict = {"sync_load_budget_bytes": 1 << 30} if sync else {}
    # This test counts the step's one pin call, not its latency: the 50 ms default deadline can
    # pass on a loaded 2-core CI machine (the load then goes unpinned, and pin_rpcs stays 0).
    extra["kvdepot_pin_timeout_ms"] = 10_000
    if path in ("pvm", "inline"):
        extra["kvdepot_memory_path"] = path
    if path == "pvm":  # off unless the operator enables it
        daemon = daemon_factory("--pool-size", "64MiB", "--pvm")
    engine = make_engine(
        socket=daemon.target, num_gpu_blocks=64, shm=memory == "memfd", extra_config=extra
    )
    engine.wait_registered()
    assert engine.ranks[0].offloading_worker.memory.path == path
    prompt = prompt_for(1, 150)  # 9 full blocks of 16 tokens + 6
    [first] = engine.generate([prompt])
    assert first.external_tokens == 0
    keys = engine.offload_keys(prompt)
    assert len(keys) == 9
    engine.wait_ready(keys)
    blocks = first.block_ids[0][:9]
    before = pages(engine, 0, 0, blocks)
    assert_expected(engine, prompt, 0, 0, blocks)

    engine.reset_gpu_prefix_cache()  # and scrub every block with 0xA5
    [second] = engine.generate([prompt])

    assert second.local_tokens == 0
    assert second.external_tokens == 9 * 16  # the scheduler reports the external hit
    [job] = load_jobs(engine)
    assert job.sync == sync
    assert list(job.dst_spec.block_ids) == second.block_ids[0][:9]
    assert_same_bytes(before, pages(engine, 0, 0, second.block_ids[0][:9]))
    worker = engine.ranks[0].offloading_worker
    assert worker.stats["loads"] == 1 and worker.stats["failed_loads"] == 0
    assert engine.manager.pin_rpcs == 1


# -- 2. hybrid: full attention + sliding window with different block sizes -------------


def reload_hybrid(engine: SyntheticEngine, prompt: list[int]) -> tuple[RequestRecord, Any, int]:
    """Runs `prompt` through a hybrid engine (group 0 full attention, group 1 a sliding
    window), waits until every full-attention chunk and two of the window's are stored,
    empties vLLM's cache and runs it again. Returns the second run's record, its one
    load job (vLLM's, as the scheduler handed it to the workers), and how many
    full-attention blocks that load moved (the hit)."""
    engine.generate([prompt])
    full_keys, swa_keys = engine.offload_keys(prompt, 0), engine.offload_keys(prompt, 1)
    engine.wait_ready(full_keys)
    engine.wait_until(
        lambda: sum(engine.manager.is_ready(k) for k in swa_keys) >= 2,
        what="the sliding-window chunks",
    )
    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    assert second.external_tokens and second.external_tokens >= 256
    [job] = load_jobs(engine)
    full_n = job.dst_spec.group_sizes[0]
    assert full_n == second.external_tokens // 16
    return second, job, full_n


def test_hybrid_sliding_window_loads_only_window(daemon, make_engine) -> None:
    # Equal page bytes (vLLM's hybrid allocator): 16 tok x 12 heads = 32 tok x 6 heads.
    groups = (
        GroupDef("full", block_size=16, num_layers=2),
        GroupDef("sliding_window", block_size=32, num_layers=2, sliding_window=64, num_kv_heads=6),
    )
    engine = make_engine(socket=daemon.target, groups=groups, num_gpu_blocks=96)
    engine.wait_registered()
    prompt = prompt_for(2, 300)
    assert len(engine.offload_keys(prompt, 0)) == 18 and len(engine.offload_keys(prompt, 1)) == 9
    second, job, full_n = reload_hybrid(engine, prompt)
    spec = job.dst_spec
    swa_n = spec.group_sizes[1]
    # Only the window (64 tokens = 2 blocks of 32, +1 for alignment) moves for the
    # sliding-window group, against 9 full blocks in the prompt.
    assert 1 <= swa_n <= 3 < 9
    assert len(job.src_spec.keys) == full_n + swa_n
    full_ids = [int(b) for b in spec.block_ids[:full_n]]
    swa_ids = [int(b) for b in spec.block_ids[full_n:]]
    assert_expected(engine, prompt, 0, 0, full_ids, first_logical=spec.block_indices[0])
    assert_expected(engine, prompt, 0, 1, swa_ids, first_logical=spec.block_indices[1])
    # And those are the blocks the request ended with (its window).
    table = second.block_ids[1]
    assert swa_ids == table[spec.block_indices[1] : spec.block_indices[1] + swa_n]


def test_hybrid_failed_load_is_recomputed(daemon, make_engine) -> None:
    """Several groups: vLLM refuses block-id load errors, so the failure goes back
    per request (failed_recving) and vLLM recomputes the whole request."""
    groups = (
        GroupDef("full", block_size=16, num_layers=1),
        GroupDef("sliding_window", block_size=32, num_layers=1, sliding_window=64, num_kv_heads=6),
    )
    engine = make_engine(socket=daemon.target, groups=groups, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(12, 200)
    engine.generate([prompt])
    engine.wait_ready(engine.offload_keys(prompt, 0))
    engine.reset_gpu_prefix_cache()
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    engine.after_start_load = lambda eng: (
        daemon.kill() if any(m.load_jobs for m in eng.metadata_log[-1:]) else None
    )
    [rec] = engine.generate([prompt], timeout=30)
    assert rec.finished and rec.external_tokens
    assert engine.failed_recving == {rec.req_id}
    assert not engine.invalid_block_ids
    assert_expected(engine, prompt, 0, 0, rec.block_ids[0][: 200 // 16])


# -- 3. blocks_per_chunk > 1, first loaded block not chunk-aligned ------------------------


def test_blocks_per_chunk_unaligned_first_block(daemon, make_engine) -> None:
    engine = make_engine(socket=daemon.target, blocks_per_chunk=2, num_gpu_blocks=96)
    engine.wait_registered()
    prompt = prompt_for(3, 170)  # 10 full blocks = 5 chunks of 32 tokens
    [first] = engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    assert len(keys) == 5
    engine.wait_ready(keys)
    engine.reset_gpu_prefix_cache()

    # Put exactly 3 blocks (48 tokens: one and a half chunks) in the GPU prefix cache:
    # a prompt that shares 48 tokens and then differs.
    other = prompt[:48] + prompt_for(33, 30)
    [warm] = engine.generate([other])
    assert warm.external_tokens == 32  # chunk 0 came from the daemon
    engine.scrub(keep_blocks=warm.block_ids[0][:3])

    [second] = engine.generate([prompt])
    assert second.local_tokens == 48
    assert second.external_tokens == 160 - 48
    job = load_jobs(engine)[-1]
    spec = job.dst_spec
    assert list(spec.block_indices) == [3]  # not chunk-aligned: skips half of chunk 1
    assert len(job.src_spec.keys) == 4 and job.src_spec.keys == keys[1:]
    assert len(spec.block_ids) == 7
    assert_expected(engine, prompt, 0, 0, [int(b) for b in spec.block_ids], first_logical=3)
    assert_same_bytes(
        pages(engine, 0, 0, [int(b) for b in spec.block_ids]),
        pages(engine, 0, 0, second.block_ids[0][3:10]),
    )


# -- 4. tensor parallelism: two ranks, a chunk is ready only when both stored -----------------


def add_with_rank_1_behind(engine: SyntheticEngine, prompt: list[int]) -> None:
    """Adds `prompt` with rank 1 paused (a slow rank: its store jobs stay queued) and
    steps until rank 0 has stored its sections."""
    engine.ranks[1].paused = True
    engine.add_request(prompt)
    for _ in range(6):
        engine.step()
        time.sleep(0.02)
    r0 = engine.ranks[0].offloading_worker
    engine.wait_until(lambda: (engine.step(), r0.stats["stores"])[1] >= 1, what="rank 0's store")


def test_tensor_parallel_two_ranks(daemon, make_engine) -> None:
    engine = make_engine(socket=daemon.target, tp=2, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(4, 100)  # 6 full blocks
    keys = engine.offload_keys(prompt)
    rank1 = engine.ranks[1]
    add_with_rank_1_behind(engine, prompt)
    # Rank 0's sections are written, rank 1's are not: nothing may be readable.
    client = engine.manager._client
    assert client.lookup(engine.manager.namespace_id, keys) == [False] * len(keys)
    assert not any(engine.manager.is_ready(k) for k in keys)

    rank1.paused = False
    engine.run()
    engine.wait_ready(keys)
    first = engine.records["req-0"]
    before = [pages(engine, r, 0, first.block_ids[0][:6]) for r in (0, 1)]
    # The two ranks hold different heads, so different bytes.
    assert not all(bool((a == b).all()) for a, b in zip(*before, strict=True))

    engine.reset_gpu_prefix_cache()
    [second] = engine.generate([prompt])
    assert second.external_tokens == 96
    for r in (0, 1):  # each rank got its own section back
        assert_same_bytes(before[r], pages(engine, r, 0, second.block_ids[0][:6]))
        assert_expected(engine, prompt, r, 0, second.block_ids[0][:6])


# -- 5. two engines in separate processes share; another layout does not ----------------------


def test_two_engine_processes_share_prefix(daemon, make_engine) -> None:
    engine_a = run_engine_process(daemon.target, prompt_seed=5)
    assert engine_a["pid"] != os.getpid()

    prompt = prompt_for(5, 160)
    engine_b = make_engine(socket=daemon.target, num_gpu_blocks=64, enable_kv_events=True)
    engine_b.wait_registered()
    assert engine_b.manager.namespace_id == engine_a["namespace"]
    keys = engine_b.offload_keys(prompt)
    assert [k.hex() for k in keys] == engine_a["keys"]
    engine_b.wait_ready(keys)  # B's mirror learnt A's blocks from the Watch stream
    # ...and B's KV events show them as the node's CPU tier.
    stored = [
        e for e in engine_b.scheduler_connector.take_events() if type(e).__name__ == "BlockStored"
    ]
    announced = {h for e in stored for h in e.block_hashes}
    assert announced >= {maybe_convert_block_hash(k[:-4]) for k in keys}
    assert all(e.medium == "CPU" for e in stored)

    [rec] = engine_b.generate([prompt])
    assert rec.external_tokens == 160  # the whole prompt (vLLM recomputes its last token)
    # Bytes engine B loaded equal the bytes engine A computed, and the model's.
    assert engine_b.kv_digest(0, 0, rec.block_ids[0][:10]) == engine_a["digest"]
    assert_expected(engine_b, prompt, 0, 0, rec.block_ids[0][:10])

    # A different layout (bf16 KV) is another namespace: no hit, no mixing.
    engine_c = make_engine(socket=daemon.target, num_gpu_blocks=64, dtype="bfloat16")
    engine_c.wait_registered()
    assert engine_c.manager.namespace_id != engine_a["namespace"]
    [rec_c] = engine_c.generate([prompt])
    assert rec_c.external_tokens == 0
    # And a salted engine of the same model does not share either.
    engine_d = make_engine(socket=daemon.target, num_gpu_blocks=64, salt="weights-v2")
    assert engine_d.manager.namespace_id != engine_a["namespace"]
    engine_d.wait_registered()
    [rec_d] = engine_d.generate([prompt])
    assert rec_d.external_tokens == 0


# -- 6. the daemon is SIGKILLed mid-run --------------------------------------------------------


def test_daemon_killed_mid_run(daemon, make_engine) -> None:
    engine = make_engine(
        socket=daemon.target, num_gpu_blocks=96, extra_config={"kvdepot_pin_timeout_ms": 50}
    )
    engine.wait_registered()
    prompt = prompt_for(6, 130)
    [first] = engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    engine.reset_gpu_prefix_cache()

    # Freeze the daemon so the load is surely in flight, then kill it.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    killed = []

    def kill_after_loads_started(eng: SyntheticEngine) -> None:
        if not killed and any(m.load_jobs for m in eng.metadata_log[-1:]):
            killed.append(time.monotonic())
            daemon.kill()

    engine.after_start_load = kill_after_loads_started
    req = engine.add_request(prompt)
    slowest = 0.0
    deadline = time.monotonic() + 30
    while engine.busy():
        assert time.monotonic() < deadline
        t = time.monotonic()
        engine.step()  # nothing raises into vLLM
        slowest = max(slowest, time.monotonic() - t)
        time.sleep(0.002)
    engine.after_start_load = None
    rec = engine.records[req]
    assert killed, "the load was never started"
    assert rec.finished and rec.external_tokens == 128
    # The in-flight load surfaced as a load error and vLLM recomputed the blocks.
    assert engine.ranks[0].connector.connector_worker.load_errors == 1
    assert set(engine.invalid_block_ids) == set(rec.block_ids[0][:8])
    assert_expected(engine, prompt, 0, 0, rec.block_ids[0][:8])
    # No step waited on the network beyond the pin deadline (plus slack for CI).
    assert slowest < 1.0, f"a step took {slowest:.3f}s"

    # Lookups miss while the daemon is gone; requests run without it.
    engine.wait_until(lambda: engine.manager.mirror_size == 0, what="the mirror to empty")
    assert not engine.manager.connected
    engine.reset_gpu_prefix_cache()
    [down] = engine.generate([prompt])
    assert down.external_tokens == 0
    assert_expected(engine, prompt, 0, 0, down.block_ids[0][:8])

    # The daemon comes back (empty): the client reconnects and re-registers by itself.
    daemon.start()
    engine.wait_until(lambda: engine.manager.connected, timeout=20, what="reconnect")
    engine.wait_registered()
    fresh = prompt_for(66, 130)
    [stored] = engine.generate([fresh])
    fresh_keys = engine.offload_keys(fresh)
    engine.wait_ready(fresh_keys)
    before = pages(engine, 0, 0, stored.block_ids[0][:8])
    engine.reset_gpu_prefix_cache()
    [hit] = engine.generate([fresh])
    assert hit.external_tokens == 128
    assert_same_bytes(before, pages(engine, 0, 0, hit.block_ids[0][:8]))


def test_frozen_daemon_cannot_hang_an_in_step_load(daemon, make_engine) -> None:
    """A daemon that stops answering: wait() gives up after kvdepot_job_timeout_s,
    the load becomes a load error and vLLM recomputes (never a hang)."""
    engine = make_engine(
        socket=daemon.target,
        num_gpu_blocks=64,
        extra_config={"sync_load_budget_bytes": 1 << 30, "kvdepot_job_timeout_s": 0.5},
    )
    engine.wait_registered()
    prompt = prompt_for(11, 100)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    engine.reset_gpu_prefix_cache()
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        req = engine.add_request(prompt)
        t = time.monotonic()
        engine.step()  # pin (deadline 50 ms) + in-step load (timeout 0.5 s)
        took = time.monotonic() - t
        # Later jobs fail at once while the daemon does not answer: no more waits.
        t = time.monotonic()
        engine.run(timeout=20)
        rest = time.monotonic() - t
    finally:
        daemon.kill()  # never SIGCONT: the abandoned copy must not land later
    assert rest < 1.0, f"the rest of the run took {rest:.2f}s"
    rec = engine.records[req]
    assert 0.5 <= took < 3.0
    assert rec.finished and rec.external_tokens == 96
    assert engine.ranks[0].offloading_worker.stats["abandoned"] >= 1
    assert set(engine.invalid_block_ids) == set(rec.block_ids[0][:6])
    assert_expected(engine, prompt, 0, 0, rec.block_ids[0][:6])


def test_daemon_absent_from_the_start(tmp_path, make_engine) -> None:
    """No daemon at all: vLLM runs, every lookup misses, nothing raises."""
    engine = make_engine(
        socket=f"unix://{tmp_path}/none.sock",
        num_gpu_blocks=32,
        extra_config={"kvdepot_startup_wait_s": 0},
    )
    prompt = prompt_for(8, 70)
    [a] = engine.generate([prompt])
    engine.reset_gpu_prefix_cache()
    [b] = engine.generate([prompt])
    assert a.external_tokens == 0 and b.external_tokens == 0
    assert_expected(engine, prompt, 0, 0, b.block_ids[0][:4])
    assert isinstance(engine.scheduler_connector, KVDepotConnector)


def test_reset_connector_cache_moves_to_a_private_namespace(daemon, make_engine) -> None:
    engine = make_engine(socket=daemon.target, num_gpu_blocks=64)
    engine.wait_registered()
    prompt = prompt_for(9, 100)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    base = engine.manager.namespace_id
    # vLLM's reset with the connector (e.g. after a weight update).
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert engine.manager.namespace_id.startswith(base + ".r1-")
    [after] = engine.generate([prompt])
    assert after.external_tokens == 0  # nothing from before the reset is loaded
    # The old blocks are still in the daemon for other engines.
    assert engine.manager._client.lookup(base, keys) == [True] * len(keys)
    # The engine offloads into its new namespace and hits there.
    engine.wait_registered()
    engine.generate([prompt_for(10, 100)])
    new_prompt = prompt_for(10, 100)
    engine.wait_ready(engine.offload_keys(new_prompt))
    engine.reset_gpu_prefix_cache()
    [again] = engine.generate([new_prompt])
    assert again.external_tokens == 96


# -- pins: per request, dropped by that request's completed load ------------------------


def test_requests_loading_the_same_keys_each_hold_their_own_pins(daemon, make_engine) -> None:
    """Two requests load the same stored keys in one step, as vLLM's scheduler calls
    the manager: one pin call pins every key once per request, each completed load
    drops only its own request's pins, and the daemon ends with nothing pinned."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvdepot.v1 import admin_pb2, admin_pb2_grpc

    engine = make_engine(
        socket=daemon.target,
        num_gpu_blocks=64,
        extra_config={"kvdepot_pin_timeout_ms": 10_000},
    )
    engine.wait_registered()
    prompt = prompt_for(21, 150)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)
    engine.wait_ready(keys)
    manager = engine.manager
    stub = admin_pb2_grpc.AdminStub(daemon.admin_channel())

    def pinned_blocks() -> int:
        return stub.GetStats(admin_pb2.GetStatsRequest()).pinned_blocks

    def wait_pinned(n: int) -> None:
        engine.wait_until(lambda: pinned_blocks() == n, what=f"{n} pinned block(s)")

    first, second = ReqContext(req_id="first"), ReqContext(req_id="second")
    manager.prepare_load(keys, first)
    manager.prepare_load(keys[:4], second)
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    assert manager.pin_rpcs == 1 and pinned_blocks() == len(keys)
    manager.complete_load(keys, first)
    wait_pinned(4)  # the second request's pins hold its keys still
    # A third request pins one more key: its unpin, queued after the repeated
    # completion below, is the unpin thread's sign that it has passed that point.
    third = ReqContext(req_id="third")
    manager.prepare_load(keys[-1:], third)
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    wait_pinned(5)
    manager.complete_load(keys[:4], first)  # already completed: nothing more to drop
    manager.complete_load(keys[-1:], third)
    # The unpins go in order: anything dropped for `first` again would show here (< 4).
    engine.wait_until(lambda: pinned_blocks() <= 4, what="the third request's unpin")
    assert pinned_blocks() == 4
    manager.complete_load(keys[:4], second)
    wait_pinned(0)
    # A key that is gone by the pin is not held, and its request unpins nothing.
    ghost = bytes(28) + keys[0][-4:]
    manager.prepare_load([ghost, keys[0]], first)
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    assert pinned_blocks() == 1
    manager.complete_load([ghost, keys[0]], first)
    wait_pinned(0)


def test_a_steps_pins_go_early_in_parts_and_end_the_step_pinned(
    daemon, make_engine, monkeypatch
) -> None:
    """A step with many loads sends them to the pin lane in parts while vLLM prepares
    them: the daemon has pinned the first parts before the step ends, the step's end
    collects every answer (one pin per step still), each request holds its own keys,
    and completed loads leave nothing pinned."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvdepot.client.vllm import pins as pins_module
    from kvdepot.v1 import admin_pb2, admin_pb2_grpc

    monkeypatch.setattr(pins_module, "EARLY_PIN_KEYS", 4)
    engine = make_engine(
        socket=daemon.target, num_gpu_blocks=64, extra_config={"kvdepot_pin_timeout_ms": 10_000}
    )
    engine.wait_registered()
    prompt = prompt_for(23, 150)
    engine.generate([prompt])
    keys = engine.offload_keys(prompt)  # 9
    engine.wait_ready(keys)
    manager = engine.manager
    lane = manager.pin_lane
    engine.wait_until(lambda: lane.open, what="the pin lane")
    stub = admin_pb2_grpc.AdminStub(daemon.admin_channel())

    def pinned_blocks() -> int:
        return stub.GetStats(admin_pb2.GetStatsRequest()).pinned_blocks

    sent_before, rpcs_before = lane.lane_pins, manager.pin_rpcs
    parts = {"a": keys[:3], "b": keys[3:6], "c": keys[6:8], "d": keys[8:]}
    for req_id, request_keys in parts.items():
        manager.prepare_load(request_keys, ReqContext(req_id=req_id))
    # "a"+"b" went as one part (6 >= 4), "c"+"d" (3) wait for the step's end; the
    # daemon pins the first part meanwhile.
    engine.wait_until(lambda: pinned_blocks() == 6, what="the first part pinned early")
    manager.on_schedule_end(None)  # type: ignore[arg-type]
    assert pinned_blocks() == 9
    assert lane.lane_pins - sent_before == 2  # two datagrams answered
    assert manager.pin_rpcs - rpcs_before == 1  # still one pin per step
    for req_id, request_keys in parts.items():
        manager.complete_load(request_keys, ReqContext(req_id=req_id))
    engine.wait_until(lambda: pinned_blocks() == 0, what="every pin dropped")
