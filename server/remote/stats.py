"""The remote tier's counters and latency histograms (GetStats, Prometheus)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

# Seconds: a loopback call of a few MiB takes about a millisecond; a deadline is seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= it), +Inf last."""
        out, acc = [], 0
        for bound, c in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out


@dataclass
class RemoteStats:
    """Counters since start. Blocks are block rows (every rank's section)."""

    writes: int = 0  # rows written to the tier
    write_bytes: int = 0
    write_present: int = 0  # rows skipped: the tier had them already (fleet-wide dedupe)
    write_drops: Counter[str] = field(default_factory=Counter)  # rows not written, by reason
    reads: int = 0  # rows asked of the tier (GET)
    read_bytes: int = 0  # bytes of verified rows
    hits: int = 0  # rows fetched, verified and made ready in the pool
    misses: int = 0  # rows the tier did not have
    fetch_drops: Counter[str] = field(default_factory=Counter)  # fetched rows not loaded
    verify_failures: Counter[str] = field(default_factory=Counter)  # by codec reason
    errors: int = 0  # failed tier calls (timeouts, connection errors)
    write_seconds: Histogram = field(default_factory=Histogram)  # per write call
    read_seconds: Histogram = field(default_factory=Histogram)  # per read call
    miss_to_ready_seconds: Histogram = field(default_factory=Histogram)  # Prefetch -> READY

    def fields(self, *, enabled: bool, healthy: bool, inflight_bytes: int) -> dict[str, object]:
        """GetStats' remote_* fields."""
        return {
            "remote_enabled": enabled,
            "remote_healthy": healthy,
            "remote_writes": self.writes,
            "remote_write_bytes": self.write_bytes,
            "remote_write_present": self.write_present,
            "remote_write_drops": sum(self.write_drops.values()),
            "remote_reads": self.reads,
            "remote_read_bytes": self.read_bytes,
            "remote_hits": self.hits,
            "remote_misses": self.misses,
            "remote_fetch_drops": sum(self.fetch_drops.values()),
            "remote_verify_failures": sum(self.verify_failures.values()),
            "remote_errors": self.errors,
            "remote_inflight_bytes": inflight_bytes,
        }
