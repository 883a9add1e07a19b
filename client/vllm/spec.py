"""`KVDepotOffloadingSpec`: vLLM's OffloadingSpec for the kvdepot daemon.

vLLM builds one spec per process: the scheduler process calls `get_manager()`,
each worker process `get_worker()`. Both derive the same namespace id from the
same configuration, so they meet in the daemon without talking to each other.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvdepot.client import DepotClient
from kvdepot.client.vllm.canonical import Uncertified, UnitSpan, unit_span
from kvdepot.client.vllm.config import DepotSettings
from kvdepot.client.vllm.logs import follow_vllm_logging
from kvdepot.client.vllm.manager import KVDepotOffloadingManager
from kvdepot.client.vllm.namespace import (
    NamespaceInputs,
    canonical_units,
    hash_seed,
    namespace_inputs,
    namespace_layout,
)
from kvdepot.client.vllm.stages import lacked_groups, stage_groups
from kvdepot.client.vllm.stats import MetricName
from kvdepot.client.vllm.worker import KVDepotOffloadingWorker
from kvdepot.common.shards import (
    engine_parts,
    engine_shards,
    first_shard,
    route_rank,
    shard_socket,
)
from kvdepot.v1 import depot_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvdepot.vllm")

SPEC_NAME = "KVDepotOffloadingSpec"


@dataclass(frozen=True)
class ConnectorContext:
    """What KVDepotConnector knows and vLLM's OffloadingConfig does not carry:
    the exact per-layer page bytes and the prefix-hash algorithm."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig


#: Set by KVDepotConnector around vLLM's spec construction.
connector_context: contextvars.ContextVar[ConnectorContext | None] = contextvars.ContextVar(
    "kvdepot_connector_context", default=None
)


def _hash_algo(ctx: ConnectorContext | None) -> str:
    if ctx is not None:
        return str(ctx.vllm_config.cache_config.prefix_caching_hash_algo)
    try:
        from vllm.config import get_current_vllm_config

        return str(get_current_vllm_config().cache_config.prefix_caching_hash_algo)
    except Exception:
        return "sha256"


class KVDepotOffloadingSpec(OffloadingSpec):
    """Offloads to the node-local kvdepot daemon (`kvdepot_socket`)."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            MetricName.CONNECTED: OffloadingGaugeMetadata(
                documentation="1 while the scheduler holds a session with the kvdepot daemon."
            ),
            MetricName.MIRROR_KEYS: OffloadingGaugeMetadata(
                documentation="Ready keys in the scheduler's local mirror of the namespace."
            ),
            MetricName.PINS: OffloadingCounterMetadata(
                documentation=(
                    "Pin calls made by the scheduler (one per step with hits and per daemon "
                    "shard the engine uses, on its pin lane or over gRPC)."
                )
            ),
            MetricName.PIN_FAILURES: OffloadingCounterMetadata(
                documentation="Pin calls that failed or passed kvdepot_pin_timeout_ms."
            ),
            MetricName.PIN_MISSES: OffloadingCounterMetadata(
                documentation="Keys the mirror held that were gone when pinned."
            ),
            MetricName.PIN_SECONDS: OffloadingHistogramMetadata(
                documentation="Latency of the scheduler's pin call.",
                buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
            ),
            MetricName.STORES_NOT_OFFERED: OffloadingCounterMetadata(
                documentation="Chunks not offered for storing because the daemon was away."
            ),
            MetricName.STORES_SKIPPED: OffloadingCounterMetadata(
                documentation=(
                    "Chunks not stored because they were offered fewer than store_threshold times."
                )
            ),
            MetricName.LOAD_FAILURES: OffloadingCounterMetadata(
                documentation="Chunks whose load failed (vLLM recomputed them)."
            ),
            MetricName.REMOTE_PREFETCH_KEYS: OffloadingCounterMetadata(
                documentation=(
                    "Keys missing in the pool asked of the tiers below it (disk, fleet) "
                    "with Prefetch."
                )
            ),
            MetricName.REMOTE_GAVE_UP: OffloadingCounterMetadata(
                documentation="Keys asked of the tiers below the pool that did not arrive in time."
            ),
            # vLLM's CPU tier's gauges, for the daemon's pool (its keepalive's figures).
            MetricName.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation=(
                    "Fraction of the kvdepot pool held by transfers (rows being stored and "
                    "rows pinned for a load: what eviction cannot free; 1.0 = saturated, "
                    "stores are dropped). The node's pool: every engine's transfers."
                )
            ),
            MetricName.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of the kvdepot pool held by rows being stored."
            ),
            MetricName.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Fraction of the kvdepot pool held by rows pinned for a load."
            ),
            MetricName.POOL_USED_PERC: OffloadingGaugeMetadata(
                documentation=(
                    "Fraction of the kvdepot pool that rows take (ready and being stored); "
                    "a full pool evicts to store."
                )
            ),
        }

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvdepot_socket", "kvdepot_namespace")

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        follow_vllm_logging()  # vLLM 0.33 configures its logging after our import
        self.settings = DepotSettings.from_extra_config(self.extra_config)
        ctx = connector_context.get()
        if ctx is None:
            log.warning(
                "KVDepotOffloadingSpec is used without KVDepotConnector: failed loads will "
                "crash vLLM's stock connector. Use kv_connector=KVDepotConnector with "
                "kv_connector_module_path=kvdepot.client.vllm."
            )
        hash_algo = _hash_algo(ctx)
        seed = hash_seed(hash_algo)
        if seed == "random":
            log.warning(
                "prefix_caching_hash_algo=%s is seeded per process without PYTHONHASHSEED: "
                "engines cannot share offloaded blocks, and nothing survives an engine "
                "restart. Set PYTHONHASHSEED to one value for every engine, or use sha256.",
                hash_algo,
            )
        kv_cache_config = ctx.kv_cache_config if ctx is not None else None
        heads = ctx.vllm_config.model_config.get_total_num_kv_heads() if ctx is not None else 0
        # The decoder layers vLLM splits over the pipeline stages (get_pp_indices).
        self._model_layers = (
            ctx.vllm_config.model_config.get_total_num_hidden_layers() if ctx is not None else 0
        )
        units = canonical_units(config, kv_cache_config, heads)
        canonical = None if isinstance(units, str) else units
        if isinstance(units, str) and config.canonical_layout:
            log.warning(
                "kvdepot stores each rank's section as is; canonical_layout is ignored "
                "(%s), and engines of other TP sizes do not share this engine's blocks "
                "(docs/architecture.md, Namespaces)",
                units,
            )
        self.namespace: NamespaceInputs = namespace_inputs(
            config, kv_cache_config, hash_algo, self.settings.namespace_salt, seed, canonical
        )
        self.namespace_id = self.namespace.digest()
        self._manager: KVDepotOffloadingManager | None = None
        self._worker: KVDepotOffloadingWorker | None = None
        self._node_shards = self.settings.shards  # None: "auto", not asked yet
        self._asked: DepotClient | None = None  # the client that asked, until used
        log.info("kvdepot namespace %s: %s", self.namespace_id, self.namespace.description())

    def _client(self, role: str, shard: int = 0) -> DepotClient:
        socket = shard_socket(self.settings.socket, shard)
        name = self.settings.client_name or (
            f"vllm-{role} engine={self.config.engine_id} pid={os.getpid()}"
        )
        client = DepotClient(socket, client_name=name, engine_id=self.config.engine_id)
        client.start()
        if self.settings.startup_wait_s > 0 and not client.wait_connected(
            self.settings.startup_wait_s
        ):
            log.warning(
                "kvdepot daemon at %s is not reachable yet; running without it (lookups "
                "miss) and reconnecting in the background",
                socket,
            )
        return client

    def make_layout(
        self, namespace_id: str, layer_pages: list[list[int]], world_size: int | None = None
    ) -> depot_pb2.NamespaceLayout:
        """The NamespaceLayout a worker declares in `namespace_id` (in a namespace part:
        of the `world_size` ranks of that part, kvdepot.common.shards)."""
        return namespace_layout(namespace_id, self.namespace, layer_pages, world_size)

    def node_shards(self, role: str) -> int:
        """The shards the node's daemon runs: `kvdepot_shards`, or with "auto" what the
        hello of the configured socket (shard 0's) says, asked once per process within
        `kvdepot_startup_wait_s`. A daemon that does not answer by then counts as one
        shard until the engine restarts (the scheduler's log then names the fix)."""
        if self._node_shards is None:
            self._asked = self._client(role, 0)
            hello = self._asked.hello
            self._node_shards = max(1, hello.shard_count) if hello is not None else 1
            if hello is None:
                log.warning(
                    "kvdepot_shards is auto and the daemon at %s did not answer within "
                    "kvdepot_startup_wait_s: this engine uses shard 0 alone until it "
                    "restarts",
                    self.settings.socket,
                )
            elif self._node_shards > 1:
                log.info(
                    "kvdepot: the daemon at %s runs %d shards (kvdepot_shards auto)",
                    self.settings.socket,
                    self._node_shards,
                )
        return self._node_shards

    def _shard_client(self, role: str, shard: int) -> DepotClient:
        """A client of `shard`: the one that asked for the shard count when it is shard 0's."""
        if shard == 0 and self._asked is not None:
            client, self._asked = self._asked, None
            return client
        return self._client(role, shard)

    def _drop_asking_client(self) -> None:
        """Closes the client that asked for the shard count if the engine does not use
        shard 0 (its session would otherwise linger in the daemon's engine list)."""
        if self._asked is not None:
            self._asked.close()
            self._asked = None

    def _first_shard(self, node_shards: int) -> int:
        """The first of the shards this engine uses: `kvdepot_first_shard`, or the one
        its namespace picks, so that engines of other models spread over the node
        (kvdepot.common.shards). A first shard the node cannot have (not a multiple of
        the shards the engine uses, or past the last) is said and the pick is used:
        the daemon may run fewer shards than the setting was written for, and that
        must never stop the engine."""
        world = self._route_world
        wanted = self.settings.first_shard
        if wanted is not None:
            used = engine_shards(node_shards, world)
            if wanted % used == 0 and wanted + used <= node_shards:
                return wanted
            log.warning(
                "kvdepot_first_shard is %d, but an engine of %d rank(s) on a daemon of %d "
                "shard(s) uses %d and can start only at a multiple of it below %d: this "
                "engine uses the shard its namespace picks",
                wanted,
                world,
                node_shards,
                used,
                node_shards,
            )
        return first_shard(self.namespace_id, node_shards, world)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            node_shards = self.node_shards("scheduler")
            # One client per namespace part (a shard's share of the ranks, or of a
            # pipeline stage's): the scheduler reads every part.
            parts = engine_parts(
                self._route_world,
                node_shards,
                self._first_shard(node_shards),
                self.namespace.pp_size,
            )
            clients = [self._shard_client("scheduler", part.shard) for part in parts]
            held = stage_groups(
                [g.layer_names for g in self.config.groups],
                self._model_layers,
                self.namespace.pp_size,
            )
            lacks = lacked_groups(
                [g.group_id for g in self.config.groups], held, [part.stage for part in parts]
            )
            if any(lacks):
                log.info(
                    "kvdepot: pipeline stages hold no layer of some offloaded groups; "
                    "the parts that lack them (by group id): %s",
                    {p.namespace_id(""): sorted(g) for p, g in zip(parts, lacks, strict=True) if g},
                )
            self._drop_asking_client()
            self._manager = KVDepotOffloadingManager(
                clients,
                self.namespace_id,
                self.settings,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                node_shards=node_shards,
                part_suffixes=[part.namespace_id("") for part in parts],
                chunk_events=self.kv_events_config.self_describing_kv_events,
                part_lacks=lacks,
            )
        return self._manager

    @property
    def _route_world(self) -> int:
        """The ranks the engine's shards are dealt by: a canonical namespace's rows are
        made by engines of every TP size, whose ranks hold different units, so every
        engine of it uses one shard, as a TP=1 engine does (kvdepot.common.shards)."""
        return 1 if self.namespace.canonical else self.namespace.world_size

    def _units(self, kv_caches: CanonicalKVCaches) -> UnitSpan | None:
        """The units this rank's pages hold in a canonical namespace (None in another).
        A rank whose pages vLLM did not certify, or that are not one slice per head,
        must not write there: it raises, as vLLM's own offloading does, naming the fix."""
        if not self.namespace.canonical:
            return None
        try:
            return unit_span(kv_caches, self.namespace.world_size)
        except Uncertified as exc:
            message = (
                f"kvdepot: rank {self.config.parallel.rank} cannot store into the canonical "
                f"namespace {self.namespace_id} ({exc}); remove canonical_layout from "
                f"kv_connector_extra_config"
            )
            log.error("%s", message)
            raise ValueError(message) from None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            units = self._units(kv_caches)
            # Replicated ranks (MLA at TP > 1) share one section: each is rank 0 of the
            # namespace, the first to store a row copies it and the others' stores find
            # it present (no copy); every rank loads the one section. In a canonical
            # namespace a rank is its first unit, on the engine's one shard.
            replicated = self.namespace.replicated_ranks > 1
            rank = 0 if replicated or units is not None else self.config.parallel.rank
            role = f"worker rank={self.config.parallel.rank}"
            node_shards = self.node_shards(role)
            route = route_rank(
                rank,
                self._route_world,
                node_shards,
                self._first_shard(node_shards),
                self.namespace.pp_size,
            )
            if units is not None:  # the namespace's rows: a section per unit
                route = route._replace(rank=units.first, world_size=self.namespace.world_size)
            sharded = route.shard != 0 or route.shards > 1
            if sharded or route.stages > 1:
                log.info(
                    "kvdepot: rank %d (pipeline stage %d of %d) uses shard %d of the node's "
                    "%d as its rank %d of %d",
                    rank,
                    route.stage,
                    route.stages,
                    route.shard,
                    node_shards,
                    route.rank,
                    route.world_size,
                )
            client = self._shard_client(role, route.shard)
            self._drop_asking_client()
            self._worker = KVDepotOffloadingWorker(
                client,
                kv_caches,
                namespace_id=self.namespace_id,
                make_layout=functools.partial(self.make_layout, world_size=route.world_size),
                rank=route.rank,
                blocks_per_chunk=self.blocks_per_chunk,
                memory_path=self.settings.memory_path,
                job_timeout_s=self.settings.job_timeout_s,
                route=route,
                node_shards=node_shards,
                units=units,
            )
            if self.settings.startup_wait_s > 0 and self._worker._client.connected:
                # Registration runs in the background; give it a moment so the
                # first requests can already offload.
                self._worker.wait_registered(self.settings.startup_wait_s)
        return self._worker
