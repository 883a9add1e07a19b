"""The scheduler-side manager's metrics: their names, and the step's figures its parts add to.

vLLM asks the manager for its stats once per step (`OffloadingManager.get_stats`, on
vLLM's scheduler thread) and ships a non-empty answer to its front end, which turns the
names below into Prometheus metrics (kvdepot.client.vllm.spec declares them).

Threads: the manager's parts count on vLLM's scheduler thread (pins, stores not offered,
load failures, remote-tier asks and give-ups) and `take` runs there too. `StepStats`
owns the accumulator and the lock that guards it, so a part may count from another
thread without losing a figure.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics

from kvdepot.client import DepotClient


class MetricName:
    """Metrics the manager reports through vLLM's offloading stats."""

    CONNECTED = "kvdepot_connected"
    MIRROR_KEYS = "kvdepot_mirror_keys"
    PINS = "kvdepot_pin_rpcs"
    PIN_FAILURES = "kvdepot_pin_failures"
    PIN_SECONDS = "kvdepot_pin_seconds"
    PIN_MISSES = "kvdepot_pin_misses"
    STORES_NOT_OFFERED = "kvdepot_stores_not_offered"
    STORES_SKIPPED = "kvdepot_stores_skipped"
    LOAD_FAILURES = "kvdepot_load_failures"
    REMOTE_PREFETCH_KEYS = "kvdepot_remote_prefetch_keys"
    REMOTE_GAVE_UP = "kvdepot_remote_gave_up"
    POOL_USED_PERC = "kvdepot_pool_used_perc"
    # vLLM's CPU tier's usage gauges, given the pool's figures (see PoolUsage).
    CPU_CACHE_USAGE_PERC = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
    CPU_CACHE_WRITE_USAGE_PERC = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
    CPU_CACHE_READ_USAGE_PERC = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC


class PoolUsage(NamedTuple):
    """The daemon's pool as its last keepalive left it (every shard's added), as the
    fractions of its capacity that vLLM's CPU tier reports: `usage` what transfers
    hold (rows being stored plus rows pinned for a load: what eviction cannot free,
    as vLLM's `kv_offload_cpu_cache_usage_perc` counts its CPU cache), `write` the
    rows being stored, `read` the pinned ones; and `used`, the pool's fill (ready and
    writing rows: what kvdepot's own `kvdepot_pool_used_perc` reports)."""

    usage: float
    write: float
    read: float
    used: float

    @classmethod
    def of(cls, clients: Sequence[DepotClient]) -> PoolUsage | None:
        """From the clients' last keepalives; None until every shard sent one."""
        capacity = used = writing = pinned = 0
        for client in clients:
            hello, alive = client.hello, client.keepalive
            if hello is None or alive is None or not hello.pool_capacity_bytes:
                return None
            capacity += hello.pool_capacity_bytes
            used += alive.pool_used_bytes
            writing += alive.pool_writing_bytes
            pinned += alive.pool_pinned_bytes
        write, read = min(writing / capacity, 1.0), min(pinned / capacity, 1.0)
        return cls(min(write + read, 1.0), write, read, min(used / capacity, 1.0))


class StepStats:
    """Counters and histograms since vLLM last took them, and the gauges last sent."""

    def __init__(self) -> None:
        self._stats = OffloadingConnectorStats()
        self._lock = threading.Lock()
        # (connected, mirror keys, the pool's usage or None)
        self._gauges_sent: tuple[float, float, PoolUsage | None] | None = None

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats.increase_counter(name, n)

    def count_pin(self, seconds: float, misses: int) -> None:
        """One step's pin call: its latency, and how many of its keys were gone."""
        with self._lock:
            self._stats.increase_counter(MetricName.PINS, 1)
            self._stats.observe_histogram(MetricName.PIN_SECONDS, seconds)
            if misses:
                self._stats.increase_counter(MetricName.PIN_MISSES, misses)

    def take(
        self, connected: bool, mirror_keys: int, pool: PoolUsage | None = None
    ) -> OffloadingConnectorStats | None:
        """What happened since the last call, and the gauges when they changed (the
        pool's usage gauges only once known: `pool` None leaves them as they were).

        Prometheus keeps a gauge's last value, so an unchanged gauge need not travel,
        and a quiet decode step reports nothing (None).
        """
        gauges = (1.0 if connected else 0.0, float(mirror_keys), pool)
        with self._lock:
            if gauges == self._gauges_sent and self._stats.is_empty():
                return None
            stats, self._stats = self._stats, OffloadingConnectorStats()
        self._gauges_sent = gauges
        stats.set_gauge(MetricName.CONNECTED, gauges[0])
        stats.set_gauge(MetricName.MIRROR_KEYS, gauges[1])
        if pool is not None:
            stats.set_gauge(MetricName.CPU_CACHE_USAGE_PERC, pool.usage)
            stats.set_gauge(MetricName.CPU_CACHE_WRITE_USAGE_PERC, pool.write)
            stats.set_gauge(MetricName.CPU_CACHE_READ_USAGE_PERC, pool.read)
            stats.set_gauge(MetricName.POOL_USED_PERC, pool.used)
        return stats
