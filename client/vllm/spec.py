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
from kvdepot.client.vllm.config import DepotSettings
from kvdepot.client.vllm.logs import follow_vllm_logging
from kvdepot.client.vllm.manager import KVDepotOffloadingManager
from kvdepot.client.vllm.namespace import NamespaceInputs, namespace_inputs, namespace_layout
from kvdepot.client.vllm.stats import MetricName
from kvdepot.client.vllm.worker import KVDepotOffloadingWorker
from kvdepot.common.shards import engine_shards, first_shard, route_rank, shard_socket
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
        if hash_algo.startswith("xxhash"):
            log.warning(
                "prefix_caching_hash_algo=%s is seeded per process: engines cannot share "
                "offloaded blocks, and nothing survives an engine restart. Use sha256.",
                hash_algo,
            )
        if config.canonical_layout:
            log.warning("kvdepot stores each rank's section as is; canonical_layout is ignored")
        self.namespace: NamespaceInputs = namespace_inputs(
            config,
            ctx.kv_cache_config if ctx is not None else None,
            hash_algo,
            self.settings.namespace_salt,
        )
        self.namespace_id = self.namespace.digest()
        self._manager: KVDepotOffloadingManager | None = None
        self._worker: KVDepotOffloadingWorker | None = None
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
        """The NamespaceLayout a worker declares in `namespace_id` (on a shard: of the
        `world_size` ranks that shard serves)."""
        return namespace_layout(namespace_id, self.namespace, layer_pages, world_size)

    @property
    def engine_shards(self) -> int:
        """The daemon shards this engine uses (kvdepot.common.shards)."""
        return engine_shards(self.settings.shards, self.namespace.world_size)

    @property
    def first_shard(self) -> int:
        """The first of them: picked by the namespace, so that engines of other models
        spread over the node's shards (kvdepot.common.shards.first_shard)."""
        return first_shard(self.namespace_id, self.settings.shards, self.namespace.world_size)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVDepotOffloadingManager(
                [
                    self._client("scheduler", self.first_shard + s)
                    for s in range(self.engine_shards)
                ],
                self.namespace_id,
                self.settings,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            world = self.namespace.world_size
            route = route_rank(rank, world, self.settings.shards, self.first_shard)
            sharded = route.shard != 0 or route.shards > 1
            if sharded:
                log.info(
                    "kvdepot: rank %d uses shard %d of the node's %d as its rank %d of %d",
                    rank,
                    route.shard,
                    self.settings.shards,
                    route.rank,
                    route.world_size,
                )
            self._worker = KVDepotOffloadingWorker(
                self._client(f"worker rank={rank}", route.shard),
                kv_caches,
                namespace_id=self.namespace_id,
                make_layout=functools.partial(self.make_layout, world_size=route.world_size),
                rank=route.rank,
                blocks_per_chunk=self.blocks_per_chunk,
                memory_path=self.settings.memory_path,
                job_timeout_s=self.settings.job_timeout_s,
                route=route if sharded else None,
                node_shards=self.settings.shards,
            )
            if self.settings.startup_wait_s > 0 and self._worker._client.connected:
                # Registration runs in the background; give it a moment so the
                # first requests can already offload.
                self._worker.wait_registered(self.settings.startup_wait_s)
        return self._worker
