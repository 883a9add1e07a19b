"""Prometheus series of the remote tier (kvdepot_remote_*), read at scrape time.

The daemon registers `RemoteCollector` in its metrics registry when it runs
with `--remote`. Reads are plain attribute reads of counters the event loop
updates; a scrape may see one call's counters half-updated, never torn values.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from kvdepot.server.remote.link import RemoteLink
from kvdepot.server.remote.stats import Histogram


class RemoteCollector(Collector):
    def __init__(self, link: RemoteLink) -> None:
        self.link = link

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        s = self.link.stats
        up = GaugeMetricFamily(
            "kvdepot_remote_up", "1 while the remote tier answers, 0 while it is down."
        )
        up.add_metric([], 1.0 if self.link.health.up else 0.0)
        yield up
        inflight = GaugeMetricFamily(
            "kvdepot_remote_inflight_bytes", "Bytes queued or in flight to and from the tier."
        )
        inflight.add_metric([], self.link.writer.pending_bytes + self.link.fetcher.pending_bytes)
        yield inflight
        for name, doc, value in (
            ("writes", "Rows written to the remote tier.", s.writes),
            ("write_bytes", "Framed bytes written to the remote tier.", s.write_bytes),
            ("write_present", "Rows not written: the tier had them already.", s.write_present),
            ("reads", "Rows read from the remote tier.", s.reads),
            ("read_bytes", "Bytes of rows read from the tier that verified.", s.read_bytes),
            ("hits", "Rows fetched, verified and made ready in the pool.", s.hits),
            ("misses", "Keys asked for that the tier did not have.", s.misses),
            ("errors", "Remote tier calls that failed (timeouts, connection errors).", s.errors),
        ):
            c = CounterMetricFamily(f"kvdepot_remote_{name}", doc)
            c.add_metric([], value)
            yield c
        for name, doc, counts in (
            ("write_drops", "Rows not written to the tier, by reason.", s.write_drops),
            ("fetch_drops", "Fetched rows not loaded into the pool, by reason.", s.fetch_drops),
            (
                "verify_failures",
                "Values discarded because they did not verify, by reason.",
                s.verify_failures,
            ),
        ):
            c = CounterMetricFamily(f"kvdepot_remote_{name}", doc, labels=["reason"])
            for reason, n in sorted(counts.items()):
                c.add_metric([reason], n)
            yield c
        for name, doc, h in (
            ("write_seconds", "Seconds per write call to the tier.", s.write_seconds),
            ("read_seconds", "Seconds per read call to the tier.", s.read_seconds),
            (
                "miss_to_ready_seconds",
                "Seconds from a Prefetch to the row being ready.",
                s.miss_to_ready_seconds,
            ),
        ):
            yield _histogram(f"kvdepot_remote_{name}", doc, h)


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc)
    fam.add_metric([], buckets=h.cumulative(), sum_value=h.total)
    return fam
