"""Prometheus series of the disk tier (kvdepot_disk_*), read at scrape time.

The daemon registers `DiskCollector` in its metrics registry when it runs with
`--disk`. A scrape reads the same figures as GetStats (`DiskLink.stats_fields`:
the tier's snapshot, taken under its lock, and the link's counters, which the
event loop updates: a scrape may see one call's counters half-updated, never
torn values).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvdepot.server.disk.link import DiskLink

_GAUGES = (
    (
        "up",
        "1 while the disk tier answers, 0 while it is down (full, failing, removed).",
        "healthy",
    ),
    ("capacity_bytes", "Bytes of the disk tier's file that can hold records.", "capacity_bytes"),
    ("used_bytes", "Bytes of the disk tier's file in use by records.", "used_bytes"),
    ("records", "Records in the disk tier's index.", "records"),
    ("inflight_bytes", "Row bytes being written to the disk now.", "inflight_bytes"),
    (
        "write_waiting",
        "Ready rows waiting for the bound on bytes in flight (keys only).",
        "write_waiting",
    ),
    ("recovery_complete", "1 once the disk's index is whole after a start.", "recovery_complete"),
    (
        "recovery_scanned_bytes",
        "Bytes of the file the index rebuild has read.",
        "recovery_scanned_bytes",
    ),
    (
        "recovery_total_bytes",
        "Bytes of the file the index rebuild reads in all.",
        "recovery_total_bytes",
    ),
)
_COUNTERS = (
    ("writes", "Rows written to the disk tier.", "writes"),
    ("write_bytes", "Row bytes written to the disk tier.", "write_bytes"),
    ("reads", "Records read from the disk tier that verified.", "reads"),
    ("read_bytes", "Bytes of records read from the disk tier that verified.", "read_bytes"),
    ("hits", "Rows read from the disk and made ready in the pool.", "hits"),
    ("misses", "Keys asked of the disk tier that it did not have.", "misses"),
    ("promote_drops", "Rows on disk not promoted into the pool.", "promote_drops"),
    ("rejected", "Records that did not verify when read: never served.", "rejected"),
    ("errors", "Failed disk reads and writes (ENOSPC, EIO, EROFS, removed).", "errors"),
    ("evicted", "Records evicted from the disk tier to make room.", "evicted"),
    ("recovered", "Records the disk's index kept after a start.", "recovered"),
)


class DiskCollector(Collector):
    def __init__(self, link: DiskLink) -> None:
        self.link = link

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        fields = {k.removeprefix("disk_"): v for k, v in self.link.stats_fields().items()}
        for name, doc, key in _GAUGES:
            g = GaugeMetricFamily(f"kvdepot_disk_{name}", doc)
            # these fields are numbers (stats_fields is a dict of mixed values)
            g.add_metric([], float(fields[key]))  # type: ignore[arg-type]
            yield g
        for name, doc, key in _COUNTERS:
            c = CounterMetricFamily(f"kvdepot_disk_{name}", doc)
            # these fields are numbers (stats_fields is a dict of mixed values)
            c.add_metric([], float(fields[key]))  # type: ignore[arg-type]
            yield c
        drops = CounterMetricFamily(
            "kvdepot_disk_write_drops",
            "Rows not written to the disk tier, by reason.",
            labels=["reason"],
        )
        # write_drops is a Counter (stats_fields is a dict of mixed values)
        for reason, n in sorted(fields["write_drops"].items()):  # type: ignore[attr-defined]
            drops.add_metric([reason], n)
        yield drops
