"""The disk tier's events under vLLM 0.33.0's real Scheduler and connector: a block the
daemon wrote to its disk tier shows in `take_events()` as a BlockStored of medium
STORAGE and locality LOCAL (the pool's stay CPU), for routers that weight by tier; a
block only on disk is not a hit (the scheduler asks Prefetch, RETRY), and comes back.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("blake3")

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvdepot.testing.vllm_engine import prompt_for
from kvdepot.v1 import admin_pb2

pytestmark = pytest.mark.vllm


def test_take_events_shows_blocks_on_disk_as_storage(
    daemon_factory, make_engine, tmp_path, monkeypatch
) -> None:
    d = daemon_factory(
        "--pool-size", "64MiB", "--disk", str(tmp_path / "disk"), "--disk-size", "64MiB"
    )  # fmt: skip
    engine = make_engine(socket=d.target, num_gpu_blocks=64, enable_kv_events=True)
    engine.wait_registered()
    m = engine.manager
    prompt = prompt_for(13, 160)
    keys = engine.offload_keys(prompt)
    hashes = {maybe_convert_block_hash(k[:-4]) for k in keys}
    # vLLM drains the connector's events at every step: record what every caller takes
    # (a disk write that ends while the engine still steps is taken by vLLM, not us).
    seen: list[BlockStored | BlockRemoved] = []
    take_events = engine.scheduler_connector.take_events

    def recorded() -> list:
        events = list(take_events())
        seen.extend(events)
        return events

    monkeypatch.setattr(engine.scheduler_connector, "take_events", recorded)
    [rec] = engine.generate([prompt])
    assert rec.external_tokens == 0
    engine.wait_ready(keys)

    def stored(medium: str) -> set:
        engine.scheduler_connector.take_events()
        return {
            h for e in seen if isinstance(e, BlockStored) and e.medium == medium
            for h in e.block_hashes
        }  # fmt: skip

    engine.wait_until(lambda: stored("STORAGE") >= hashes, what="STORAGE events for the prompt")
    assert stored("CPU") >= hashes  # the pool's, taken by vLLM's steps, recorded too
    assert {e.locality for e in seen if isinstance(e, BlockStored) and e.medium == "STORAGE"} == {
        "LOCAL"
    }

    # Out of RAM, still on disk: the pool's REMOVED arrives, the disk's does not.
    client = m._client
    res = client.admin.Evict(admin_pb2.EvictRequest(namespace_id=m.namespace_id, keys=keys))
    assert res.evicted_blocks == len(keys)
    engine.wait_until(lambda: not any(m.is_ready(k) for k in keys), what="RAM evicted")
    stored("CPU")
    removed = [e for e in seen if isinstance(e, BlockRemoved)]
    assert {h for e in removed if e.medium == "CPU" for h in e.block_hashes} >= hashes
    assert not [e for e in removed if e.medium == "STORAGE"]

    # A block on disk only is no hit: the scheduler asks the tiers below (RETRY) and
    # the disk brings it back into the pool.
    engine.reset_gpu_prefix_cache()
    asked = m.remote_asked
    engine.add_request(prompt)
    engine.step()
    assert m.remote_asked == asked + len(keys)
    engine.wait_ready(keys)
    engine.run()
    assert list(engine.records.values())[-1].external_tokens == 160
