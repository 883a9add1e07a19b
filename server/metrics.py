"""Prometheus metrics (prometheus_client), served on --metrics-port.

Gauges and counters are read from the daemon's state at scrape time (one source of
truth, nothing to keep in sync); per-transfer sizes and copy durations are observed
into histograms as transfers finish (transfer jobs and inline Put/Get alike).

The state belongs to the event loop, and the HTTP server (kvdepot.server.metrics_http:
a bearer token, one request at a time, a bounded share of a CPU) answers on its own thread,
so a scrape reads the state *on the loop* (a callback scheduled there) instead of
walking dicts another thread may be changing. A loop that is stuck makes the scrape
fail after SCRAPE_TIMEOUT_S, which is itself worth alerting on.

Metric names (all prefixed kvdepot_) are listed in docs/operations.md; the test
suite checks that list against a live scrape.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from kvdepot.common.kinds import Direction
from kvdepot.server import metrics_http
from kvdepot.server.core.kinds import AbortReason, DropReason, EvictionReason
from kvdepot.server.gc_policy import GcStats
from kvdepot.server.state import DepotState

SCRAPE_TIMEOUT_S = 5.0
DIRECTIONS = tuple(d.label for d in Direction)
SIZE_BUCKETS = tuple(float(1 << p) for p in range(12, 34, 2))  # 4 KiB .. 8 GiB
# Each reason's label and sentence, from the one place a dropped store's answer reads too.
_DROPPED_STORES_HELP = "Key stores dropped: " + "; ".join(
    f"{reason.value} ({reason.text})" for reason in DropReason
)
SECONDS_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


Reason = TypeVar("Reason", bound=enum.StrEnum)


def by_reason(counts: Mapping[Reason, int], reasons: type[Reason]) -> dict[str, int]:
    """Counts under their reasons' labels; every reason is present (at 0) from the
    first scrape, so rate() and alerts work before the first event."""
    return {r.value: counts.get(r, 0) for r in reasons}


@dataclass(frozen=True)
class _Snapshot:
    """Everything a scrape reports from the state, copied on the event loop."""

    stats: dict[str, object]
    doomed_blocks: int
    evictions: dict[str, int]
    dropped_stores: dict[str, int]
    aborted_writes: dict[str, int]
    failed_jobs: dict[str, int]
    gc: GcStats | None
    # Per namespace: (id, bytes held, --namespace-share bytes, rows evicted for room).
    namespaces: list[tuple[str, int, int, int]]


def _read(state: DepotState, gc: GcStats | None) -> _Snapshot:
    ix = state.index.stats
    return _Snapshot(
        stats=state.stats(),
        doomed_blocks=state.index.counts()["doomed"],
        evictions=by_reason(ix.evictions, EvictionReason),
        dropped_stores=by_reason(ix.dropped_stores, DropReason),
        aborted_writes=by_reason(ix.aborted_writes, AbortReason),
        failed_jobs={d.label: state.traffic.of(d).failed_jobs for d in Direction},
        gc=None if gc is None else GcStats(**vars(gc)),
        namespaces=[
            (ns.layout.id, ns.used_bytes, ns.share_bytes, ns.evicted_blocks)
            for ns in state.namespaces()
        ],
    )


def _namespace_families(
    namespaces: list[tuple[str, int, int, int]],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """What each namespace holds, is guaranteed (--namespace-share) and loses to eviction."""
    held = GaugeMetricFamily(
        "kvdepot_namespace_used_bytes", "Pool bytes a namespace holds.", labels=["namespace"]
    )
    share = GaugeMetricFamily(
        "kvdepot_namespace_share_bytes",
        "Pool bytes --namespace-share guarantees a namespace (only those given one).",
        labels=["namespace"],
    )
    evicted = CounterMetricFamily(
        "kvdepot_namespace_evicted_blocks",
        "Rows of a namespace evicted to make room for stores (LRU), since it began.",
        labels=["namespace"],
    )
    for namespace_id, used, share_bytes, evicted_blocks in namespaces:
        held.add_metric([namespace_id], used)
        if share_bytes:
            share.add_metric([namespace_id], share_bytes)
        evicted.add_metric([namespace_id], evicted_blocks)
    yield from (held, share, evicted)


class _StateCollector(Collector):
    def __init__(
        self, state: DepotState, loop: asyncio.AbstractEventLoop | None, gc: GcStats | None
    ) -> None:
        self.state = state
        self.loop = loop
        self.gc = gc

    def snapshot(self) -> _Snapshot:
        loop = self.loop
        if loop is None or _on_loop_thread(loop):
            return _read(self.state, self.gc)

        async def on_loop() -> _Snapshot:
            return _read(self.state, self.gc)

        fut = asyncio.run_coroutine_threadsafe(on_loop(), loop)
        try:
            return fut.result(timeout=SCRAPE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(
                f"the daemon's event loop did not answer within {SCRAPE_TIMEOUT_S}s"
            ) from None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        snap = self.snapshot()
        s = snap.stats

        def gauge(name: str, doc: str, value: object) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"kvdepot_{name}", doc, value=_number(value))

        def counter(name: str, doc: str, value: object) -> CounterMetricFamily:
            return CounterMetricFamily(f"kvdepot_{name}", doc, value=_number(value))

        def by_label(
            kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
            name: str,
            doc: str,
            label: str,
            values: Mapping[str, object],
        ) -> CounterMetricFamily | GaugeMetricFamily:
            family = kind(f"kvdepot_{name}", doc, labels=[label])
            for value_label, value in values.items():
                family.add_metric([value_label], _number(value))
            return family

        yield InfoMetricFamily(
            "kvdepot_build",
            "The daemon's version, boot id, pool backing, and which shard of how many it is "
            "(kvdepot serve --shards; 0 of 1 unsharded).",
            value={
                "version": str(s["version"]),
                "boot_id": str(s["boot_id"]),
                "pool_backing": str(s["pool_backing"]),
                "shard": str(s["shard"]),
                "shards": str(s["shard_count"]),
            },
        )
        yield gauge("uptime_seconds", "Seconds since the daemon started.", s["uptime_seconds"])
        yield gauge("pool_capacity_bytes", "Pool size in bytes.", s["capacity_bytes"])
        yield gauge("pool_used_bytes", "Pool bytes held by blocks (any state).", s["used_bytes"])
        yield gauge("pool_pinned_bytes", "Pool bytes of pinned blocks.", s["pinned_bytes"])
        yield gauge(
            "pool_largest_free_extent_bytes",
            "Largest free extent: the biggest block row a store can get without evicting.",
            s["largest_free_extent_bytes"],
        )
        yield gauge(
            "pool_warmup_done_bytes",
            "Pool bytes pre-faulted so far.",
            s["warmup_done_bytes"],
        )
        yield gauge(
            "pool_warmup_complete",
            "1 once the whole pool is pre-faulted.",
            bool(s["warmup_complete"]),
        )
        yield gauge(
            "pool_page_locked_bytes",
            "Pool bytes page-locked for DMA (cuMemHostRegister); 0 without a CUDA device.",
            s["page_locked_bytes"],
        )
        yield gauge(
            "pool_page_locking_failed",
            "1 when page-locking the pool stopped (see the log: a locked-memory limit, "
            "say); copies still work, slower.",
            bool(s["page_locking_error"]),
        )
        yield by_label(
            GaugeMetricFamily,
            "blocks",
            "Blocks by state: ready (readable), writing (reserved, not all ranks written), "
            "freeing (dropped, waiting for a copy in flight).",
            "state",
            {
                "ready": s["ready_blocks"],
                "writing": s["writing_blocks"],
                "freeing": snap.doomed_blocks,
            },
        )
        yield gauge(
            "pinned_blocks",
            "Ready blocks pinned by an engine (a subset of ready).",
            s["pinned_blocks"],
        )
        yield gauge("engines", "Open engine sessions.", s["sessions"])
        yield gauge(
            "registrations", "KV memory registrations (one per engine rank).", s["registrations"]
        )
        yield gauge("namespaces", "Namespaces (model and layout).", s["namespaces"])
        yield from _namespace_families(snap.namespaces)
        yield gauge("inflight_jobs", "Transfer jobs being validated or copied.", s["inflight_jobs"])
        yield counter(
            "event_loop_cpu_seconds",
            "CPU seconds the event loop's thread used: every job's control plane, not the "
            "copies. A rate near 1 is its one core saturated: run more --shards.",
            s["loop_cpu_seconds"],
        )
        # The copy threads' load: threads="cpu", the shared threads (--copy-threads);
        # threads="gpu", each GPU's own (--gpu-copy-threads each), by device UUID.
        devices = s["gpu_copy_devices"]
        assert isinstance(devices, list)
        copy_families = (
            (
                GaugeMetricFamily,
                "copy_threads",
                "Copy threads: cpu, shared by the copies the CPUs make; gpu, a GPU's own.",
                "copy_threads",
                None,
            ),
            (
                CounterMetricFamily,
                "copies_started",
                "Copies the copy threads started (a job's copy, or each part of a split one).",
                "copies_started",
                "gpu_copies_started",
            ),
            (
                CounterMetricFamily,
                "copy_wait_seconds",
                "Seconds copies waited in the queue for a copy thread (over copies: the mean "
                "wait).",
                "copy_wait_seconds",
                "gpu_copy_wait_seconds",
            ),
            (
                CounterMetricFamily,
                "copy_busy_seconds",
                "Seconds the copy threads spent copying, the running copies included (over "
                "kvdepot_copy_threads: how busy).",
                "copy_busy_seconds",
                "gpu_copy_busy_seconds",
            ),
            (
                GaugeMetricFamily,
                "copy_longest_running_seconds",
                "Age of the oldest copy running now (0: none): copies take milliseconds, so "
                "seconds here is a hung copy (a GPU's DMA that never ends).",
                "copy_longest_running_seconds",
                "gpu_copy_longest_running_seconds",
            ),
        )
        for kind, name, doc, cpu_field, gpu_field in copy_families:
            family = kind(f"kvdepot_{name}", doc, labels=["threads", "device"])
            family.add_metric(["cpu", ""], _number(s[cpu_field]))
            per_gpu = s[gpu_field] if gpu_field else [s["gpu_copy_threads"]] * len(devices)
            assert isinstance(per_gpu, list)
            for device, value in zip(devices, per_gpu, strict=True):
                family.add_metric(["gpu", str(device)], _number(value))
            yield family

        yield counter("lookups", "Keys looked up (Lookup RPC).", s["lookups"])
        yield counter("lookup_hits", "Keys looked up and found ready.", s["hits"])
        yield counter("lookup_misses", "Keys looked up and not ready.", s["misses"])
        yield counter(
            "pin_keys", "Keys named in Pin calls (the vLLM connector's lookups).", s["pin_keys"]
        )
        yield counter(
            "pinned_keys", "Keys pinned: named in a Pin call and ready.", s["pinned_keys"]
        )
        yield by_label(
            CounterMetricFamily,
            "transfer_blocks",
            "Blocks (one key's section of a rank) written by successful store jobs "
            "and read by successful load jobs, inline Put/Get included.",
            "direction",
            {"store": s["stored_blocks"], "load": s["loaded_blocks"]},
        )
        yield by_label(
            CounterMetricFamily,
            "evictions",
            "Blocks evicted: lru (room for a store), admin (Evict), clear (Clear).",
            "reason",
            snap.evictions,
        )
        yield by_label(
            CounterMetricFamily,
            "dropped_stores",
            _DROPPED_STORES_HELP,
            "reason",
            snap.dropped_stores,
        )
        yield by_label(
            CounterMetricFamily,
            "aborted_writes",
            "Block rows dropped before they became ready.",
            "reason",
            snap.aborted_writes,
        )
        yield by_label(
            CounterMetricFamily,
            "failed_transfers",
            "Transfer jobs that failed (the engine recomputes).",
            "direction",
            snap.failed_jobs,
        )
        yield gauge(
            "recovery_journal_blocks",
            "Blocks the journal listed as ready when the daemon started after a crash "
            "(--pool-file); 0 after a clean start.",
            s["recovery_blocks_total"],
        )
        yield by_label(
            CounterMetricFamily,
            "recovery_blocks",
            "Journal blocks checked after a crash: verified (bytes matched, served again) "
            "or rejected (dropped).",
            "outcome",
            {
                "verified": s["recovery_blocks_verified"],
                "rejected": s["recovery_blocks_rejected"],
            },
        )
        yield gauge(
            "recovery_complete",
            "0 while blocks from the journal are still being verified, else 1.",
            bool(s["recovery_complete"]),
        )
        if snap.gc is not None:
            yield counter(
                "gc_frozen_objects",
                "Objects moved out of the garbage collector's walks (the index's, mostly); "
                "they leave that set again when freed.",
                snap.gc.frozen,
            )
            yield gauge(
                "gc_tick_max_seconds",
                "Longest collection of the objects not yet frozen (it holds the event loop).",
                snap.gc.max_tick_seconds,
            )


def _number(value: object) -> float:
    """A stats value (int, float or bool) as a sample value."""
    if not isinstance(value, int | float):
        raise TypeError(f"not a number: {value!r}")
    return float(value)


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Metrics:
    """The daemon's metrics registry: state collector, transfer histograms, process.

    Build it on the event loop (it remembers the running loop and reads the state
    there); `serve(port)` starts the HTTP endpoint on a background thread.
    """

    def __init__(
        self,
        state: DepotState,
        loop: asyncio.AbstractEventLoop | None = None,
        gc: GcStats | None = None,
    ) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None  # no loop (unit use): read the state directly
        # No *_created series: Prometheus reads them as separate gauges, and counter resets
        # already show in kvdepot_build_info's boot_id. (Process-wide, and this is the
        # daemon's only registry.)
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state, loop, gc))
        ProcessCollector(registry=self.registry)  # memory, CPU, open fds of the daemon
        GCCollector(registry=self.registry)  # python_gc_*: collections by generation
        self.transfer_bytes = Histogram(
            "kvdepot_transfer_size_bytes",
            "Bytes per successful transfer (a job, or one inline Put/Get), by direction.",
            ["direction"],
            buckets=SIZE_BUCKETS,
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "kvdepot_transfer_copy_seconds",
            "Copy seconds per successful transfer (a job, or one inline Put/Get), by direction.",
            ["direction"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        for direction in DIRECTIONS:  # series exist (at 0) before the first transfer
            self.transfer_bytes.labels(direction)
            self.transfer_seconds.labels(direction)
        self._stop_http: Callable[[], None] | None = None
        state.add_transfer_observer(self.observe)

    def observe(self, direction: Direction, ok: bool, nbytes: int, seconds: float) -> None:
        """A transfer finished (called on the event loop)."""
        if ok:
            self.transfer_bytes.labels(direction.label).observe(nbytes)
            self.transfer_seconds.labels(direction.label).observe(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1", token: str | None = None) -> None:
        """Serves http://addr:port/metrics until the process exits; with `token`, only to
        requests that carry it (kvdepot.server.metrics_http)."""
        self._stop_http = metrics_http.serve(self.registry, port, addr, token)
