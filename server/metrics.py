"""Prometheus metrics (prometheus_client), served on --metrics-port.

Gauges and counters are read from the daemon's state at scrape time (one source
of truth, nothing to keep in sync); per-job sizes and durations are observed
into histograms as jobs finish.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvdepot.server.state import DepotState

_SIZE_BUCKETS = tuple(float(1 << p) for p in range(12, 34, 2))  # 4 KiB .. 8 GiB
_TIME_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _StateCollector(Collector):
    def __init__(self, state: DepotState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.state
        s = st.stats()
        ix = st.index.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvdepot_{name}", doc, value=value)

        yield gauge("pool_capacity_bytes", "Pool size in bytes.", s["capacity_bytes"])
        yield gauge("pool_used_bytes", "Pool bytes held by blocks.", s["used_bytes"])
        yield gauge("pool_pinned_bytes", "Pool bytes of pinned blocks.", s["pinned_bytes"])
        yield gauge(
            "pool_largest_free_extent_bytes", "Largest free extent (fragmentation).",
            s["largest_free_extent_bytes"],
        )
        yield gauge("pool_warmup_done_bytes", "Pool bytes pre-faulted so far.",
                    s["warmup_done_bytes"])
        blocks = GaugeMetricFamily("kvdepot_blocks", "Blocks by state.", labels=["state"])
        blocks.add_metric(["ready"], s["ready_blocks"])
        blocks.add_metric(["writing"], s["writing_blocks"])
        blocks.add_metric(["pinned"], s["pinned_blocks"])
        yield blocks
        yield gauge("sessions", "Open client sessions.", s["sessions"])
        yield gauge("registrations", "KV memory registrations.", s["registrations"])
        yield gauge("namespaces", "Namespaces.", s["namespaces"])
        yield gauge("inflight_jobs", "Transfer jobs in flight.", s["inflight_jobs"])

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvdepot_{name}", doc, value=value)

        yield counter("lookups", "Keys looked up (Lookup RPC).", ix.lookups)
        yield counter("lookup_hits", "Keys found ready.", ix.hits)
        yield counter("lookup_misses", "Keys not ready.", ix.misses)
        ev = CounterMetricFamily("kvdepot_evictions", "Blocks evicted, by reason.",
                                 labels=["reason"])
        for reason in ("lru", "admin", "clear"):
            ev.add_metric([reason], ix.evictions.get(reason, 0))
        yield ev
        dropped = CounterMetricFamily("kvdepot_dropped_stores", "Keys whose store was dropped.",
                                      labels=["reason"])
        for reason, n in ix.dropped_stores.items():
            dropped.add_metric([reason], n)
        yield dropped
        jobs = CounterMetricFamily("kvdepot_transfers", "Successful transfer jobs and Put/Get.",
                                   labels=["direction"])
        jobs.add_metric(["store"], st.traffic.stores)
        jobs.add_metric(["load"], st.traffic.loads)
        yield jobs
        moved = CounterMetricFamily("kvdepot_transfer_bytes", "Bytes copied.",
                                    labels=["direction"])
        moved.add_metric(["store"], st.traffic.stored_bytes)
        moved.add_metric(["load"], st.traffic.loaded_bytes)
        yield moved
        failed = CounterMetricFamily("kvdepot_failed_transfers", "Failed transfer jobs.",
                                     labels=["direction"])
        for direction in ("store", "load"):
            failed.add_metric([direction], st.traffic.failed_jobs.get(direction, 0))
        yield failed


class Metrics:
    """Registers the collector and the histograms; `serve(port)` starts HTTP."""

    def __init__(self, state: DepotState) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state))
        self.job_bytes = Histogram(
            "kvdepot_job_bytes", "Bytes per successful transfer job.", ["direction"],
            buckets=_SIZE_BUCKETS, registry=self.registry,
        )
        self.job_seconds = Histogram(
            "kvdepot_job_copy_seconds", "Copy seconds per successful transfer job.",
            ["direction"], buckets=_TIME_BUCKETS, registry=self.registry,
        )
        state.transfer_observers.append(self.observe)

    def observe(self, direction: str, ok: bool, nbytes: int, seconds: float) -> None:
        if ok:
            self.job_bytes.labels(direction).observe(nbytes)
            self.job_seconds.labels(direction).observe(seconds)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
