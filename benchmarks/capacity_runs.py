"""The capacity bench's replays: one trace through kvdepot and through vLLM's CPU tier.

Both run vLLM 0.33's real `Scheduler` (kvdepot.testing.vllm_engine.SyntheticEngine),
one request at a time: its prompt is added, the engine steps until the request is
finished and every transfer reported, then vLLM's own prefix cache (the GPU's) is
emptied, so that what a request finds comes from the offload tier alone. A request's
hit is vLLM's count of its external cached tokens (`num_external_cached_tokens`):
leading chunks only, as vLLM's lookup stops at the first miss.

- **kvdepot**: a real daemon (`kvdepot serve`, its pool sized to the bench's chunks,
  one more for the barrier row below; `--disk` when asked), the real
  KVDepotConnector on both sides (scheduler and one worker rank, its KV memory in a
  memfd), so stores, pins, loads, unpins and the touch of a finished request are the
  real ones. Between requests the replay waits until the daemon has applied
  everything the request sent (`_Barrier`) and the scheduler's mirror equals the
  daemon's READY rows, so that each request sees what the pool really holds and the
  figures do not depend on this machine's timing. Then it reads the pool's rows
  (Admin/ListBlocks) and counts those no lookup can reach: a row whose chunk's
  predecessor (the chunk before it in every prompt that has it) is not held. With
  the disk tier, it also follows the disk's records on a Watch stream of its own
  (the daemon's TIER_DISK events, counted until they match GetStats' disk_writes
  and disk_evicted) and counts the rows across the tiers no lookup can reach: a row
  of the pool or the disk with a chunk before it that neither holds (Prefetch
  fetches only a leading run); among them, the disk's.
- **vLLM**: vLLM's own OffloadingConnector with `CPUOffloadingSpec` (its
  CPUOffloadingManager and its `lru` or `arc` policy) of exactly the same chunks,
  driven by the same Scheduler; its transfers complete at once (no worker: the
  manager's bookkeeping is all that decides hits).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdepot.bench.capacity_traces import Trace
from kvdepot.testing.tiers import DiskRecords, unreachable_keys

BLOCK_TOKENS = 16
# A small KV geometry (2 layers, 1 KV head of the test model's 64): a chunk is 8 KiB,
# and what is measured depends on chunk counts only.
LAYERS = 2
KV_HEADS = 1
REQUEST_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0


def _engine_config(**kwargs: Any) -> Any:
    from kvdepot.testing.environment import find_model_dir
    from kvdepot.testing.vllm_engine import EngineConfig, GroupDef

    groups = (GroupDef("full", block_size=BLOCK_TOKENS, num_layers=LAYERS, num_kv_heads=KV_HEADS),)
    # Room for the longest prompt several times over: the GPU cache never runs out.
    return EngineConfig(
        model_dir=str(find_model_dir()),
        groups=groups,
        num_gpu_blocks=512,
        max_num_seqs=4,
        **kwargs,
    )


def chunk_bytes(engine: Any) -> int:
    """One chunk's bytes: every layer's page of one block (one rank)."""
    spec = engine.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return spec.page_size_bytes * LAYERS


@dataclass
class Replay:
    """What one system did with one trace."""

    system: str
    hit_tokens: list[int] = field(default_factory=list)  # per request
    stored_chunks: int = 0
    unreachable_max: int = 0  # kvdepot: the most rows held that no lookup reaches
    unreachable_end: int = 0
    # kvdepot with the disk: rows of the pool or the disk with an earlier chunk that
    # neither holds (across the tiers), and the disk's records among them
    xtier_unreachable_max: int = 0
    xtier_unreachable_end: int = 0
    disk_orphans_max: int = 0
    disk_orphans_end: int = 0
    held_end: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def figures(self, trace: Trace, chunk: int) -> dict[str, Any]:
        hits = sum(self.hit_tokens)
        return {
            "system": self.system,
            "hit_tokens": hits,
            "hit_rate": hits / trace.prompt_tokens,
            "stored_chunks": self.stored_chunks,
            "stored_bytes": self.stored_chunks * chunk,
            "unreachable_max": self.unreachable_max,
            "unreachable_end": self.unreachable_end,
            "xtier_unreachable_max": self.xtier_unreachable_max,
            "xtier_unreachable_end": self.xtier_unreachable_end,
            "disk_orphans_max": self.disk_orphans_max,
            "disk_orphans_end": self.disk_orphans_end,
            "held_end": self.held_end,
            "seconds": self.seconds,
            **self.extra,
        }


def _run_request(engine: Any, prompt: Sequence[int]) -> int:
    """Adds the prompt, steps until it finished and every transfer is in, empties
    vLLM's GPU prefix cache; returns the request's external hit tokens."""
    req_id = engine.add_request(prompt)
    engine.run(timeout=REQUEST_TIMEOUT_S)
    engine.reset_gpu_prefix_cache(scrub=False)
    record = engine.records[req_id]
    assert record.finished, f"{req_id} did not finish"
    return record.external_tokens or 0


def _parents(engine: Any, trace: Trace) -> dict[bytes, bytes | None]:
    """Each offload key of the trace -> the key of the chunk before it (None: first)."""
    parents: dict[bytes, bytes | None] = {}
    for prompt in trace.prompts:
        keys = engine.offload_keys(prompt)
        for i, key in enumerate(keys):
            parents.setdefault(key, keys[i - 1] if i else None)
    return parents


def unreachable(held: set[bytes], parents: dict[bytes, bytes | None]) -> int:
    """Rows held whose chain to the first chunk is broken: no lookup reaches them."""
    return len(unreachable_keys(held, parents))


# -- vLLM's CPU tier ------------------------------------------------------------------------


def run_vllm(trace: Trace, pool_chunks: int, policy: str) -> Replay:
    """The trace through vLLM's OffloadingConnector, CPU tier of `pool_chunks` chunks."""
    from kvdepot.testing.vllm_engine import SyntheticEngine

    replay = Replay(f"vllm-{policy}")
    started = time.monotonic()
    probe = SyntheticEngine(_engine_config(socket=None, workers=False, connector=None))
    chunk = chunk_bytes(probe)
    probe.shutdown()
    engine = SyntheticEngine(
        _engine_config(
            socket=None,
            workers=False,
            connector="OffloadingConnector",
            connector_module=None,
            extra_config={
                "spec_name": "CPUOffloadingSpec",
                "cpu_bytes_to_use": pool_chunks * chunk,
                "eviction_policy": policy,
            },
        )
    )
    try:
        manager = engine.manager
        if manager._num_chunks != pool_chunks:
            raise RuntimeError(f"vLLM's tier holds {manager._num_chunks} chunks, not {pool_chunks}")
        prepare_store = manager.prepare_store

        def counted(keys: Any, req_context: Any) -> Any:
            out = prepare_store(keys, req_context)
            if out is not None:
                replay.stored_chunks += len(out.keys_to_store)
            return out

        manager.prepare_store = counted
        parents = _parents(engine, trace)
        for prompt in trace.prompts:
            replay.hit_tokens.append(_run_request(engine, prompt))
            held = _vllm_held(manager)
            replay.unreachable_max = max(replay.unreachable_max, unreachable(held, parents))
        held = _vllm_held(manager)
        replay.held_end = len(held)
        replay.unreachable_end = unreachable(held, parents)
    finally:
        engine.shutdown()
    replay.seconds = time.monotonic() - started
    return replay


def _vllm_held(manager: Any) -> set[bytes]:
    policy = manager._policy
    if hasattr(policy, "chunks"):  # LRUCachePolicy
        return set(policy.chunks)
    return set(policy.t1) | set(policy.t2)  # ARCCachePolicy


# -- kvdepot -----------------------------------------------------------------------------------


@dataclass
class DiskTier:
    """`--disk` for the kvdepot run: its size in chunks (records are page-aligned)."""

    chunks: int
    directory: Path | None = None


class _Barrier:
    """Until the daemon has applied what the request's end sent on the unpin lane.

    The touch of a finished request (and its load's unpins) go on the unpin lane, as
    datagrams nobody answers. The daemon reads one lane's datagrams in order, so the
    barrier is a pin of our own: a row (the `sentinel`, stored first) pinned twice over
    gRPC, one pin dropped on the same lane after the request's datagrams; once
    Admin/ListBlocks shows one pin left, everything before it is applied. It is pinned
    again over gRPC (two pins: never evictable, so the pool holds one row more than the
    bench's chunks)."""

    def __init__(self, engine: Any, daemon: Any, sentinel: bytes) -> None:
        from kvdepot.common.shards import shard_namespace_id

        manager = engine.manager
        self.manager = manager
        self.client = manager._client
        self.lane = manager.unpin_lane
        self.namespace = shard_namespace_id(manager.namespace_id, 0, 1)
        self.daemon = daemon
        self.sentinel = sentinel
        for _ in range(2):
            self.client.pin(self.namespace, [sentinel], timeout=5.0)
        if self.sentinel_pins() != 2:
            raise RuntimeError("the barrier row did not take two pins")

    def sentinel_pins(self) -> int:
        for block in self.daemon.blocks(self.namespace):
            if block.key == self.sentinel:
                return block.pins
        raise RuntimeError("the barrier row is gone")

    def wait(self, touches_before: int) -> None:
        """`touches_before`: the lane's touch datagrams before the request; its touch
        must have gone (one datagram) before the barrier's unpin goes."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while self.lane.lane_touches <= touches_before:
            if time.monotonic() > deadline:
                raise TimeoutError("the finished request's touch was never sent")
            time.sleep(0.0005)
        left = self.lane.unpin(self.client.session_id, self.namespace, [self.sentinel])
        if left:
            raise RuntimeError("the unpin lane did not take the barrier")
        while self.sentinel_pins() != 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the daemon did not apply the unpin lane's datagrams")
            time.sleep(0.0005)
        self.client.pin(self.namespace, [self.sentinel], timeout=5.0)


class _Daemon:
    """`kvdepot serve` for one kvdepot run, with Admin reads of its blocks."""

    def __init__(self, pool_bytes: int, extra: list[str]) -> None:
        import grpc

        from kvdepot.bench.daemon import OwnDaemon
        from kvdepot.v1 import admin_pb2_grpc

        self.own = OwnDaemon(str(pool_bytes), extra=extra)
        self.own.wait_serving()
        self.target = self.own.target
        self._channel = grpc.insecure_channel(self.own.admin_target)
        self.admin = admin_pb2_grpc.AdminStub(self._channel)

    def stats(self) -> Any:
        from kvdepot.testing.daemon import stats

        return stats(self.admin)

    def blocks(self, namespace: str) -> list[Any]:
        from kvdepot.v1 import admin_pb2

        out, token = [], ""
        while True:
            request = admin_pb2.ListBlocksRequest(
                namespace_id=namespace, page_size=10000, page_token=token
            )
            page = self.admin.ListBlocks(request, timeout=10.0)
            out.extend(page.blocks)
            token = page.next_page_token
            if not token:
                return out

    def close(self) -> None:
        self._channel.close()
        self.own.stop()


def run_kvdepot(
    trace: Trace, pool_chunks: int, policy: str = "lru", disk: DiskTier | None = None
) -> Replay:
    """The trace through a real daemon of `pool_chunks` chunks (and `disk`)."""
    from kvdepot.testing.vllm_engine import SyntheticEngine

    name = f"kvdepot-{policy}" + ("+disk" if disk else "")
    replay = Replay(name)
    started = time.monotonic()
    probe = SyntheticEngine(_engine_config(socket=None, workers=False, connector=None))
    chunk = chunk_bytes(probe)
    probe.shutdown()
    # One engine owns the pool: the per-session shares (meant for many tenants) are off,
    # as vLLM's CPU tier has none.
    extra = ["--max-writing-per-session", "100%", "--max-pinned-per-session", "100%"]
    if policy != "lru":
        extra += ["--eviction-policy", policy]
    disk_dir: Path | None = None
    if disk is not None:
        disk_dir = Path(tempfile.mkdtemp(prefix="kvdcap-disk-"))
        # A record is its header page and the payload, page-aligned; and the file's
        # last page is the health probe's.
        record = 4096 + -(-chunk // 4096) * 4096
        extra += [
            "--disk", str(disk_dir / "tier"),
            "--disk-size", str(disk.chunks * record + 4096),
            "--disk-write-priority", "normal",
        ]  # fmt: skip
    daemon = _Daemon((pool_chunks + 1) * chunk, extra)
    engine = None
    try:
        engine = SyntheticEngine(
            _engine_config(
                socket=daemon.target,
                # A miss in RAM waits for the disk as long as it takes (figures that do
                # not depend on this machine's load); without a disk it is never asked.
                extra_config={"kvdepot_remote_wait_ms": 10_000},
            )
        )
        engine.wait_registered()
        manager = engine.manager
        engine.wait_until(lambda: manager.lanes_open, timeout=20, what="the pin and unpin lanes")
        sentinel_prompt = [5] * (BLOCK_TOKENS + 1)
        _run_request(engine, sentinel_prompt)
        sentinel = engine.offload_keys(sentinel_prompt)[0]
        engine.wait_ready([sentinel])
        barrier = _Barrier(engine, daemon, sentinel)
        records = None if disk is None else DiskRecords(manager._client, barrier.namespace)
        parents = _parents(engine, trace)
        stored_before = daemon.stats().stored_blocks
        for prompt in trace.prompts:
            touches = barrier.lane.lane_touches
            replay.hit_tokens.append(_run_request(engine, prompt))
            barrier.wait(touches)
            held = _settle(engine, daemon, barrier.namespace, records)
            held.discard(sentinel)
            replay.unreachable_max = max(replay.unreachable_max, unreachable(held, parents))
            if records is not None:
                _count_across(replay, held, records.keys(), parents)
        replay.held_end = len(held)
        replay.unreachable_end = unreachable(held, parents)
        if records is not None:
            replay.xtier_unreachable_end, replay.disk_orphans_end = _count_across(
                replay, held, records.keys(), parents
            )
            records.close()
        s = daemon.stats()
        replay.stored_chunks = s.stored_blocks - stored_before
        replay.extra = {
            "load_failures": len(engine.invalid_block_ids),
            "evictions": s.evictions,
            "dropped_stores": s.dropped_stores,
        }
        if disk is not None:
            replay.extra.update(
                disk_hit_chunks=s.disk_hits,
                disk_writes=s.disk_writes,
                disk_write_drops=dict(s.disk_write_drops),
                disk_evicted=s.disk_evicted,
            )
    finally:
        if engine is not None:
            engine.shutdown()
        daemon.close()
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    replay.seconds = time.monotonic() - started
    return replay


def _count_across(
    replay: Replay, pool: set[bytes], disk: set[bytes], parents: dict[bytes, bytes | None]
) -> tuple[int, int]:
    """The rows of the pool or the disk that no lookup reaches across the tiers, and
    the disk's among them; the replay's most of each follows."""
    lost = unreachable_keys(pool | disk, parents)
    orphans = len(lost & disk)
    replay.xtier_unreachable_max = max(replay.xtier_unreachable_max, len(lost))
    replay.disk_orphans_max = max(replay.disk_orphans_max, orphans)
    return len(lost), orphans


def _settle(
    engine: Any, daemon: _Daemon, namespace: str, records: DiskRecords | None
) -> set[bytes]:
    """Until the disk has written what it took (and its events are in), and the
    scheduler's mirror equals the daemon's READY rows; returns those rows' keys."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    mirror = engine.manager.mirror
    while True:
        if records is not None:
            s = daemon.stats()
            if s.disk_inflight_bytes or s.disk_write_waiting or not records.settled(s):
                _later(deadline, "the disk tier's writes")
                continue
        ready = {b.key for b in daemon.blocks(namespace) if b.state == "ready"}
        if mirror.ready == ready:
            return ready
        _later(deadline, "the scheduler's mirror to match the daemon's rows")


def _later(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"waited {SETTLE_TIMEOUT_S:.0f} s for {what}")
    time.sleep(0.001)


RUNNERS: dict[str, Callable[..., Replay]] = {"vllm": run_vllm, "kvdepot": run_kvdepot}
