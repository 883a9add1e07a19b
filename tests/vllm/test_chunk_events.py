"""Complete KV events from every engine (vLLM 0.33.0's real Scheduler, a real daemon).

With vLLM's `self_describing_kv_events` on, the engine that stores a chunk publishes a
complete BlockStored (hashes, parent, token ids, block size, group); every other
engine on the node used to publish a placeholder for the same chunk. Engines A and B
(running together) and C (started after A stored) share a namespace: for A's chunks,
B's and C's `take_events()` must equal A's own, at 1 and 4 blocks per chunk, and the
removals must name the same block hashes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvdepot.testing.vllm_engine import SyntheticEngine, prompt_for
from kvdepot.v1 import admin_pb2

pytestmark = pytest.mark.vllm

SELF_DESCRIBING = {"self_describing_kv_events": True}


def recorder(engine) -> list:
    """Every event the engine's connector yields from now on, whoever drains it."""
    seen: list = []
    take_events = engine.scheduler_connector.take_events

    def recorded() -> list:
        events = list(take_events())
        seen.extend(events)
        return events

    engine.scheduler_connector.take_events = recorded
    return seen


@pytest.fixture
def engines(make_engine) -> Callable[..., Callable[[], SyntheticEngine]]:
    """engines(daemon, blocks_per_chunk) -> new(): each call a registered engine of one
    namespace on `daemon`, with vLLM's self-describing KV events on."""

    def on(daemon, blocks_per_chunk: int) -> Callable[[], SyntheticEngine]:
        def new() -> SyntheticEngine:
            engine = make_engine(
                socket=daemon.target,
                num_gpu_blocks=64,
                enable_kv_events=True,
                blocks_per_chunk=blocks_per_chunk,
                extra_config=SELF_DESCRIBING,
            )
            engine.wait_registered()
            return engine

        return new

    return on


def stored_on(engine, seen: list, medium: str = "CPU") -> dict:
    """The BlockStored events of `medium` seen so far, by their block hashes."""
    engine.scheduler_connector.take_events()
    return {
        tuple(e.block_hashes): e for e in seen if isinstance(e, BlockStored) and e.medium == medium
    }


def removed_hashes(engine, seen: list) -> set:
    """The block hashes of the CPU BlockRemoved events seen so far."""
    engine.scheduler_connector.take_events()
    return {
        h for e in seen if isinstance(e, BlockRemoved) and e.medium == "CPU"
        for h in e.block_hashes
    }  # fmt: skip


def payload(e: BlockStored) -> tuple:
    return (
        tuple(e.block_hashes),
        e.parent_block_hash,
        tuple(e.token_ids),
        e.block_size,
        e.group_idx,
        e.lora_id,
        e.lora_name,
        e.kv_cache_spec_kind,
    )


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_every_engine_publishes_the_storing_engines_events(
    daemon_factory, engines, blocks_per_chunk
) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    new_engine = engines(d, blocks_per_chunk)
    a, b = new_engine(), new_engine()
    seen_a, seen_b = recorder(a), recorder(b)
    prompt = prompt_for(7, 200)
    keys = a.offload_keys(prompt)
    assert a.manager.namespace_id == b.manager.namespace_id
    [rec] = a.generate([prompt])
    assert rec.external_tokens == 0
    a.wait_ready(keys)
    b.wait_ready(keys)

    chunks = len(keys)
    a.wait_until(lambda: len(stored_on(a, seen_a)) >= chunks, what="A's events")
    b.wait_until(lambda: len(stored_on(b, seen_b)) >= chunks, what="B's events")
    own = stored_on(a, seen_a)
    # A's own events are vLLM's: complete, blocks_per_chunk hashes each.
    assert {(e.block_size, len(e.token_ids)) for e in own.values()} == {(16, 16 * blocks_per_chunk)}
    assert {len(h) for h in own} == {blocks_per_chunk}
    expected = sorted(map(payload, own.values()))
    assert sorted(map(payload, stored_on(b, seen_b).values())) == expected

    # C starts after the store: its snapshot carries the same.
    c = new_engine()
    seen_c = recorder(c)
    c.wait_ready(keys)
    c.wait_until(lambda: len(stored_on(c, seen_c)) >= chunks, what="C's events")
    assert sorted(map(payload, stored_on(c, seen_c).values())) == expected

    # Evicted: every engine's BlockRemoved names every block hash A's stores named.
    all_hashes = {h for hashes in own for h in hashes}
    res = a.manager._client.admin.Evict(
        admin_pb2.EvictRequest(namespace_id=a.manager.namespace_id, keys=keys)
    )
    assert res.evicted_blocks == len(keys)

    for engine, seen in ((a, seen_a), (b, seen_b), (c, seen_c)):
        engine.wait_until(
            lambda e=engine, s=seen: removed_hashes(e, s) >= all_hashes, what="removals"
        )

    # The daemon counted the chunk events it held, and holds none once the rows are gone.
    st = d.stats()
    assert st.chunk_event_rows == 0 and st.chunk_event_bytes == 0


def test_chunk_event_bytes_are_counted(daemon_factory, engines) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    a = engines(d, 4)()
    prompt = prompt_for(9, 256)
    keys = a.offload_keys(prompt)
    a.generate([prompt])
    a.wait_ready(keys)
    st = d.stats()
    assert st.chunk_event_rows == len(keys)
    per_row = st.chunk_event_bytes / st.chunk_event_rows
    # 4 blocks of 16 tokens: 4 hashes, a parent, 64 token ids and the small fields.
    assert 200 < per_row < 600, per_row


def test_disk_tier_events_and_a_promotion_are_complete_too(
    daemon_factory, engines, tmp_path
) -> None:
    pytest.importorskip("blake3")
    d = daemon_factory(
        "--pool-size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )  # fmt: skip
    new_engine = engines(d, 4)
    a, b = new_engine(), new_engine()
    seen_a, seen_b = recorder(a), recorder(b)
    prompt = prompt_for(17, 192)
    keys = a.offload_keys(prompt)
    a.generate([prompt])
    a.wait_ready(keys)
    a.wait_until(lambda: len(stored_on(a, seen_a, "CPU")) >= len(keys), what="A's events")
    expected = sorted(map(payload, stored_on(a, seen_a, "CPU").values()))
    # Written to disk: B's STORAGE events are A's chunks, complete.
    b.wait_until(lambda: len(stored_on(b, seen_b, "STORAGE")) >= len(keys), what="B's disk events")
    assert sorted(map(payload, stored_on(b, seen_b, "STORAGE").values())) == expected

    # Out of the pool, on disk only: C, started now, hears the records complete.
    # (A row still being written to disk is skipped by Evict: ask until all are out.)
    evicted = [0]

    def evict_rest() -> bool:
        res = a.manager._client.admin.Evict(
            admin_pb2.EvictRequest(namespace_id=a.manager.namespace_id, keys=keys)
        )
        evicted[0] += res.evicted_blocks
        return evicted[0] == len(keys)

    a.wait_until(evict_rest, what="every row evicted from RAM")
    a.wait_until(lambda: not any(a.manager.is_ready(k) for k in keys), what="RAM evicted")
    c = new_engine()
    seen_c = recorder(c)
    c.wait_until(lambda: len(stored_on(c, seen_c, "STORAGE")) >= len(keys), what="C's disk events")
    assert sorted(map(payload, stored_on(c, seen_c, "STORAGE").values())) == expected
    assert not stored_on(c, seen_c, "CPU")

    # Promoted back into the pool (C asks for the prompt): every engine's CPU events
    # are complete again, a later engine's snapshot too.
    c.add_request(prompt)
    c.step()
    c.wait_ready(keys)
    c.run()
    for engine, seen in ((b, seen_b), (c, seen_c)):
        engine.wait_ready(keys)
        engine.wait_until(
            lambda e=engine, s=seen: len(stored_on(e, s, "CPU")) >= len(keys), what="promoted"
        )
        assert sorted(map(payload, stored_on(engine, seen, "CPU").values())) == expected
    late = new_engine()
    seen_late = recorder(late)
    late.wait_ready(keys)
    late.wait_until(lambda: len(stored_on(late, seen_late, "CPU")) >= len(keys), what="late")
    assert sorted(map(payload, stored_on(late, seen_late, "CPU").values())) == expected


def test_other_engines_chunks_cost_one_steps_memory(daemon_factory, engines) -> None:
    """B lends its tracker A's chunk events for the step that translates them, then
    takes them back: B holds at most one step's (not the N chunks A stored), while
    its published events, removals included, still equal A's."""
    d = daemon_factory("--pool-size", "64MiB")
    new_engine = engines(d, 1)
    a, b = new_engine(), new_engine()
    seen_a = recorder(a)
    table = b.scheduler_connector._chunk_tracker._pending_event_metadata
    seen_b: list = []
    held_after_drain: list[tuple[int, int]] = []  # (tracker entries, events in the drain)
    take_events = b.scheduler_connector.take_events

    def drained() -> list:
        events = list(take_events())
        seen_b.extend(events)
        held_after_drain.append((len(table), len(events)))
        return events

    b.scheduler_connector.take_events = drained

    # A stores N chunks over three requests; B drains its events between them.
    all_keys: list[bytes] = []
    for seed in (31, 32, 33):
        prompt = prompt_for(seed, 96)
        keys = a.offload_keys(prompt)
        a.generate([prompt])
        a.wait_ready(keys)
        all_keys += keys
        want = len(all_keys)
        b.wait_until(lambda w=want: len(stored_on(b, seen_b)) >= w, what="B's events")
    n = len(all_keys)
    assert n >= 15
    a.wait_until(lambda: len(stored_on(a, seen_a)) >= n, what="A's events")
    own = stored_on(a, seen_a)
    assert sorted(map(payload, stored_on(b, seen_b).values())) == sorted(map(payload, own.values()))
    # Each drain left at most what its own events named, never the N chunks; one
    # drain later, nothing (B stored and looked up nothing itself).
    assert all(held <= named for held, named in held_after_drain), held_after_drain
    assert max(held for held, _ in held_after_drain) < n
    b.scheduler_connector.take_events()
    assert len(table) == 0

    # Removed: B's BlockRemoved name every hash A's stores named, from the REMOVED
    # events' chunk events, and B's tracker is empty again.
    res = a.manager._client.admin.Evict(
        admin_pb2.EvictRequest(namespace_id=a.manager.namespace_id, keys=all_keys)
    )
    assert res.evicted_blocks == n
    all_hashes = {h for hashes in own for h in hashes}

    b.wait_until(lambda: removed_hashes(b, seen_b) >= all_hashes, what="B's removals")
    assert removed_hashes(b, seen_b) == all_hashes
    b.scheduler_connector.take_events()
    assert len(table) == 0
