"""Drive vLLM 0.33.0's real Scheduler and real WORKER-role connectors without a GPU.

`SyntheticEngine` is an engine core with the model replaced by a deterministic
stand-in: every step it runs the real `Scheduler.schedule()`, hands the real
connector metadata to one real worker-role connector per rank (exactly the calls
vLLM's model runner makes), "computes" the scheduled tokens by writing KV bytes
that depend only on (token prefix, layer, KV head, byte position) into the worker
KV tensors, aggregates the workers' outputs with vLLM's `KVOutputAggregator`, and
feeds them to `Scheduler.update_from_output()`.

So any engine that computes a prefix writes the same bytes for it, and a test can
check every loaded byte against `expected_page()` or against an earlier run.

The worker KV tensors live in a memfd (`SharedKVBuffer`) by default, so the
connector's shm path is what runs. Used by the test suite and `kvdepot bench`.
Needs `VLLM_TARGET_DEVICE=cpu` in the environment before vLLM is imported when
there is no GPU (see `cpu_environment()`). What the engine is built from lives in
`vllm_config.py`; prompts and the model config in `environment.py`.
"""

from __future__ import annotations

import hashlib
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, MLAAttentionSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvdepot.client.shm import SharedKVBuffer
from kvdepot.testing.environment import cpu_environment, find_model_dir, prompt_for
from kvdepot.testing.vllm_config import (
    DTYPES,
    EngineConfig,
    GroupDef,
    layer_specs,
    make_vllm_config,
    stage_kv_cache_configs,
    worker_config,
)
from kvdepot.testing.waiting import wait_for

# What tests and benchmarks import from here (the environment helpers import no vLLM).
__all__ = [
    "EngineConfig",
    "GroupDef",
    "RequestRecord",
    "SyntheticEngine",
    "cpu_environment",
    "find_model_dir",
    "prompt_for",
]


@dataclass
class RequestRecord:
    """What the engine saw of one request."""

    req_id: str
    prompt: list[int]
    external_tokens: int | None = None
    local_tokens: int | None = None
    block_ids: tuple[list[int], ...] = ()
    finished: bool = False
    output: list[int] = field(default_factory=list)


class _Rank:
    """One worker rank: its KV memory and its WORKER-role connector."""

    def __init__(self, engine: SyntheticEngine, rank: int) -> None:
        self.rank = rank
        self.vllm_config = engine.worker_config(rank)
        # A pipeline stage's ranks hold that stage's layers only.
        kv_cache_config = engine.rank_kv_cache_config(rank)
        total = kv_cache_config.kv_cache_tensors[0].size
        self.buffer: SharedKVBuffer | None = None
        if engine.cfg.shm:
            self.buffer = SharedKVBuffer.allocate(total, name=f"kvdepot-test-r{rank}")
            raw = self.buffer.tensor()
        else:
            # Private anonymous memory, as malloc gives a real engine's large
            # torch.zeros KV cache (a small torch.zeros would come from the heap).
            self.plain = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = torch.frombuffer(self.plain, dtype=torch.uint8)
        self.raw = raw
        # layer name -> uint8 view (blocks, heads, tokens, row bytes) for the model.
        self.u8: dict[str, torch.Tensor] = {}
        kv_caches: dict[str, torch.Tensor] = {}
        specs = layer_specs(kv_cache_config)
        for tensor in kv_cache_config.kv_cache_tensors:
            for i, name in enumerate(tensor.layers):
                spec = specs[name]
                start = tensor.offset + i * tensor.layer_stride
                region = raw[start : start + spec.page_size_bytes * engine.num_blocks]
                if isinstance(spec, MLAAttentionSpec):  # one latent vector per token
                    shape: tuple[int, ...] = (engine.num_blocks, spec.block_size, spec.head_size)
                    heads = 1
                else:
                    heads = spec.num_kv_heads
                    shape = (engine.num_blocks, heads, spec.block_size, 2 * spec.head_size)
                self.u8[name] = region.view(engine.num_blocks, heads, spec.block_size, -1)
                kv_caches[name] = region.view(spec.dtype).view(shape)
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                engine.layer_group[name] = g
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        with set_current_vllm_config(self.vllm_config):
            self.connector = KVConnectorFactory.create_connector(
                config=self.vllm_config,
                role=KVConnectorRole.WORKER,
                kv_cache_config=kv_cache_config,
            )
            self.connector.register_kv_caches(kv_caches)
        # Steps a paused rank skips (a slow rank): its stores stay queued.
        self.paused = False

    @property
    def offloading_worker(self) -> Any:
        return self.connector.connector_worker.worker

    def close(self) -> None:
        try:
            self.connector.shutdown()
        finally:
            if self.buffer is not None:
                self.buffer.close()


class SyntheticEngine:
    """A vLLM engine core (real Scheduler + real connectors) with a synthetic model."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.torch_dtype = DTYPES[cfg.dtype]
        self.num_blocks = cfg.num_gpu_blocks
        self.vllm_config = make_vllm_config(cfg)
        self.world_size = cfg.tp * cfg.pp
        # One per pipeline stage; the first stage's stands for the engine where one
        # config is meant (vLLM hands the scheduler a copy of it).
        self.kv_cache_configs = stage_kv_cache_configs(cfg, self.vllm_config, self.num_blocks)
        self.kv_cache_config = self.kv_cache_configs[0]
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        for config in self.kv_cache_configs:
            config.hash_block_size = hash_bs
            config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
                config, self.vllm_config, sched_bs, hash_bs
            )
        self.hash_block_size = hash_bs
        self.layer_group: dict[str, int] = {}
        self.ring_groups = {g for g, gd in enumerate(cfg.groups) if gd.kind == "ring"}
        # Global layer index (for the KV bytes) of each layer name.
        self.layer_index: dict[str, int] = {}
        for config in self.kv_cache_configs:
            for group in config.kv_cache_groups:
                for name in group.layer_names:
                    self.layer_index[name] = len(self.layer_index)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_bs, hash_fn)
        with set_current_vllm_config(self.vllm_config):
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                # What vLLM's engine core hands its scheduler: the first worker's config
                # with each UniformTypeKVCacheSpecs group flattened to one layer's spec.
                kv_cache_config=generate_scheduler_kv_cache_config(
                    [self.rank_kv_cache_config(r) for r in range(self.world_size)]
                ),
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=sched_bs,
                hash_block_size=hash_bs,
                log_stats=True,
            )
        self.ranks = [_Rank(self, r) for r in range(self.world_size)] if cfg.workers else []
        self.aggregator = KVOutputAggregator(expected_finished_count=self.world_size)
        self.records: dict[str, RequestRecord] = {}
        self._requests: dict[str, Request] = {}
        self._prefix_hash: dict[str, list[int]] = {}
        self._next_id = 0
        self.steps = 0
        self.load_errors = 0
        self.invalid_block_ids: set[int] = set()
        self.failed_recving: set[str] = set()
        # Hooks: called with the engine after the workers started this step's loads.
        self.after_start_load: Callable[[SyntheticEngine], None] | None = None
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.metadata_log: list[Any] = []
        # Seconds the scheduler spent in the last step (schedule, update_from_output), and
        # the CPU seconds its thread itself used in them (without what other threads and
        # processes on its core took from it meanwhile).
        self.last_schedule_s = 0.0
        self.last_update_s = 0.0
        self.last_step_cpu_s = 0.0

    # -- construction ---------------------------------------------------------------------

    def worker_config(self, rank: int) -> VllmConfig:
        return worker_config(self.vllm_config, rank)

    def stage(self, rank: int) -> int:
        """The pipeline stage of `rank` (vLLM numbers a stage's TP ranks consecutively)."""
        return rank // self.cfg.tp

    def rank_kv_cache_config(self, rank: int) -> KVCacheConfig:
        """The KV cache of `rank`: its pipeline stage's."""
        return self.kv_cache_configs[self.stage(rank)]

    # -- requests ----------------------------------------------------------------------

    @property
    def scheduler_connector(self) -> Any:
        return self.scheduler.connector

    @property
    def manager(self) -> Any:
        return self.scheduler.connector.connector_scheduler.manager

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Adds a request (`kv_transfer_params`: vLLM's per-request connector
        parameters, e.g. {"kv_load_tiers": [{"medium": "CPU"}]})."""
        req_id = f"req-{self._next_id}"
        self._next_id += 1
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self._requests[req_id] = req
        self.records[req_id] = RequestRecord(req_id, list(prompt))
        self.scheduler.add_request(req)
        return req_id

    def _prefix_hashes(self, req: Request, upto: int) -> list[int]:
        """H[p] = hash of tokens[0..p], 20 bits (it seeds the KV bytes of position p)."""
        hashes = self._prefix_hash.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        h = hashes[-1] if hashes else 0x9E3779B1
        for p in range(len(hashes), upto):
            h = (h * 1_000_003 + tokens[p] + 1) % (1 << 61)
            hashes.append(h)
        return hashes

    # -- the synthetic model -------------------------------------------------------------

    def token_bytes(self, layer: str, rank: int, prefix_hashes: Sequence[int]) -> torch.Tensor:
        """KV bytes (positions, heads, row) the model writes for these positions."""
        u8 = self.ranks[rank].u8[layer]
        heads, row = u8.shape[1], u8.shape[3]
        h = torch.tensor([x % (1 << 20) for x in prefix_hashes], dtype=torch.int64)
        lid = self.layer_index[layer]
        # Ranks that hold the same KV (vLLM's kv_tp_replicas: MLA's latent) write alike.
        shard = rank % self.cfg.tp // self.kv_cache_config.kv_tp_replicas
        head = torch.arange(heads, dtype=torch.int64) + shard * heads
        col = torch.arange(row, dtype=torch.int64)
        vals = (
            h[:, None, None] * 31 + lid * 1009 + head[None, :, None] * 131 + col[None, None, :] * 7
        ) % 251
        return vals.to(torch.uint8)

    def expected_page(
        self, prompt: Sequence[int], group: int, logical_block: int, layer: str, rank: int
    ) -> torch.Tensor:
        """The bytes one full block of a prompt must hold: (heads, tokens, row)."""
        bs = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
        h = 0x9E3779B1
        hashes = []
        for p in range((logical_block + 1) * bs):
            h = (h * 1_000_003 + prompt[p] + 1) % (1 << 61)
            hashes.append(h)
        vals = self.token_bytes(layer, rank, hashes[logical_block * bs :])
        return vals.permute(1, 0, 2).contiguous()

    def page(self, rank: int, layer: str, block_id: int) -> torch.Tensor:
        """The bytes a worker holds in one block of one layer: (heads, tokens, row)."""
        return self.ranks[rank].u8[layer][block_id].clone()

    def group_layers(self, group: int, rank: int = 0) -> list[str]:
        """The layers of `group` that `rank` holds (its pipeline stage's)."""
        return list(self.rank_kv_cache_config(rank).kv_cache_groups[group].layer_names)

    def _forward(self, out: SchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            req = self._requests[req_id]
            end = req.num_computed_tokens
            start = end - n
            hashes = self._prefix_hashes(req, end)
            table = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self.records[req_id].block_ids = tuple(list(ids) for ids in table)
            positions = torch.arange(start, end, dtype=torch.int64)
            for rank in self.ranks:
                for name, u8 in rank.u8.items():
                    g = self.layer_group[name]
                    bs = u8.shape[2]
                    ids = torch.tensor(table[g], dtype=torch.int64)
                    if g in self.ring_groups:  # one block per request, written around
                        blocks = ids[torch.zeros_like(positions)]
                    else:
                        blocks = ids[positions // bs]
                    slots = positions % bs
                    keep = blocks != 0  # block 0 is vLLM's null block (window skipped)
                    if not bool(keep.any()):
                        continue
                    vals = self.token_bytes(name, rank.rank, hashes[start:end])
                    u8[blocks[keep], :, slots[keep], :] = vals[keep]

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, run the workers and the model, update."""
        c0, t0 = time.thread_time(), time.perf_counter()
        out = self.scheduler.schedule()
        self.last_schedule_s = time.perf_counter() - t0
        schedule_cpu_s = time.thread_time() - c0
        self.steps += 1
        meta = out.kv_connector_metadata
        self.metadata_log.append(meta)
        for req_id, req in self._requests.items():
            rec = self.records[req_id]
            stats = req.prefill_stats
            if rec.external_tokens is None and stats is not None and stats.num_prompt_tokens:
                rec.external_tokens = stats.num_external_cached_tokens
                rec.local_tokens = stats.num_local_cached_tokens
        sync_first = bool(getattr(out, "has_sync_kv_loads", False))
        # The model runner's order: preemption flushes, metadata, (sync loads,)
        # the forward pass, then this step's async loads.
        for rank in self.ranks:
            if not rank.paused:
                rank.connector.handle_preemptions(meta)
            rank.connector.bind_connector_metadata(meta)
            if sync_first and not rank.paused:
                rank.connector.start_load_kv(self._ctx)
        if self.ranks:
            self._forward(out)
        for rank in self.ranks:
            if not sync_first and not rank.paused:
                rank.connector.start_load_kv(self._ctx)
        if self.after_start_load is not None:
            self.after_start_load(self)
        outputs = []
        if not self.ranks:
            outputs.append(self._model_output(out, self._instant_workers(meta)))
        for rank in self.ranks:
            c = rank.connector
            c.wait_for_save()
            results = c.get_transfer_results(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_cache_events=c.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
            self.invalid_block_ids |= kv_out.invalid_block_ids
            self.failed_recving |= kv_out.failed_recving
            c.clear_connector_metadata()
            outputs.append(self._model_output(out, kv_out))
        merged = self.aggregator.aggregate(outputs) if self.ranks else outputs[0]
        assert merged is not None
        c0, t0 = time.thread_time(), time.perf_counter()
        self.scheduler.update_from_output(out, merged)
        self.last_update_s = time.perf_counter() - t0
        self.last_step_cpu_s = schedule_cpu_s + time.thread_time() - c0
        for req_id, req in self._requests.items():
            rec = self.records[req_id]
            if not rec.finished and req.is_finished():
                rec.finished = True
                rec.output = list(req.output_token_ids)
        return out

    def _instant_workers(self, meta: Any) -> KVConnectorOutput | None:
        """Without workers: every job of this step completes at once."""
        if meta is None:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        jobs = {**meta.load_jobs, **meta.store_jobs}
        done = OffloadingWorkerMetadata(completed_jobs={j: self.world_size for j in jobs})
        recving = {job.req_id for job in meta.load_jobs.values() if not job.sync}
        return KVConnectorOutput(
            finished_recving=recving or None, kv_connector_worker_meta=done if jobs else None
        )

    def _model_output(
        self, out: SchedulerOutput, kv_out: KVConnectorOutput | None
    ) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self._requests[req_id]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([1000 + len(req.output_token_ids)])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )

    def busy(self) -> bool:
        connector = self.scheduler_connector
        return self.scheduler.has_requests() or (
            connector is not None and connector.has_pending_push_work()
        )

    def run(self, timeout: float = 30.0, idle_sleep: float = 0.002) -> None:
        """Steps until no request is left and every transfer has been reported."""
        deadline = time.monotonic() + timeout
        while self.busy():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine still busy after {timeout}s: {len(self.scheduler.requests)} "
                    f"request(s), connector jobs pending="
                    f"{self.scheduler_connector.has_pending_push_work()}"
                )
            out = self.step()
            if out.total_num_scheduled_tokens == 0:
                time.sleep(idle_sleep)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 1, timeout: float = 30.0
    ) -> list[RequestRecord]:
        ids = [self.add_request(p, max_tokens) for p in prompts]
        self.run(timeout)
        return [self.records[i] for i in ids]

    # -- helpers for tests -------------------------------------------------------------------

    def offload_keys(self, prompt: Sequence[int], group: int = 0) -> list[bytes]:
        """The OffloadKeys of a prompt's full chunks in one group (as vLLM makes them)."""
        from vllm.v1.kv_offload.base import make_offload_key

        req = Request(
            request_id="keys",
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self._hasher,
        )
        spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
        per_chunk = spec.block_size * self.cfg.blocks_per_chunk // self.hash_block_size
        hashes = req.block_hashes
        return [
            make_offload_key(hashes[i], group) for i in range(per_chunk - 1, len(hashes), per_chunk)
        ]

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        wait_for(predicate, timeout, what, interval=0.005)

    def wait_ready(self, keys: Sequence[bytes], timeout: float = 10.0) -> None:
        """Until the scheduler's mirror holds every key (the Watch stream delivered)."""
        self.wait_until(
            lambda: all(self.manager.is_ready(k) for k in keys),
            timeout,
            f"{len(keys)} keys in the scheduler's mirror",
        )

    def wait_registered(self, timeout: float = 20.0) -> None:
        for rank in self.ranks:
            worker = rank.offloading_worker
            if hasattr(worker, "wait_registered"):
                assert worker.wait_registered(timeout), f"rank {rank.rank} did not register"

    def reset_gpu_prefix_cache(self, scrub: bool = True, keep_blocks: Sequence[int] = ()) -> None:
        """vLLM's `reset_prefix_cache()` (GPU only, not the connector), then fill every
        block except `keep_blocks` with 0xA5 so only a load can bring bytes back."""
        assert self.scheduler.reset_prefix_cache(), "reset_prefix_cache refused"
        if scrub:
            self.scrub(keep_blocks)

    def scrub(self, keep_blocks: Sequence[int] = ()) -> None:
        keep = torch.tensor(sorted(set(keep_blocks)), dtype=torch.int64)
        for rank in self.ranks:
            for u8 in rank.u8.values():
                saved = u8[keep].clone() if len(keep) else None
                u8.fill_(0xA5)
                if saved is not None:
                    u8[keep] = saved

    def kv_digest(self, rank: int, group: int, block_ids: Sequence[int]) -> str:
        """SHA-256 over the bytes of these blocks in every layer of a group."""
        h = hashlib.sha256()
        for name in self.group_layers(group, rank):
            for b in block_ids:
                h.update(self.ranks[rank].u8[name][b].numpy().tobytes())
        return h.hexdigest()

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.close()
        self.scheduler.shutdown()
