"""The disk tier's counters and the one dict that GetStats and Prometheus will read.

Not thread-safe: DiskTier updates and reads it under its lock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvdepot.server.disk.scan import ScanProgress
from kvdepot.server.disk.space import DiskSpace
from kvdepot.server.tier_health import TierHealth


@dataclass
class DiskStats:
    direct_io: bool = False
    written_records: int = 0
    written_bytes: int = 0
    write_errors: int = 0
    syncs: int = 0  # fdatasync calls that succeeded (DiskTier._sync)
    dropped_down: int = 0  # writes dropped while the disk was down
    dropped_recovering: int = 0  # writes dropped while the index was rebuilt
    read_records: int = 0
    read_bytes: int = 0
    read_misses: int = 0
    read_errors: int = 0
    rejected: int = 0  # records that did not verify on read: dropped, never served
    recovered: int = 0
    recovery_dropped: int = 0  # duplicates or overlaps found by the scan

    def snapshot(
        self, space: DiskSpace, progress: ScanProgress, health: TierHealth, recovering: bool
    ) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out.update(asdict(space.counters))
        out.update(
            up=health.up,
            down_reason=health.reason,
            outages=health.outages,
            capacity_bytes=space.allocator.capacity,
            used_bytes=space.used_bytes,
            records=space.records,
            inflight_bytes=space.inflight_bytes,
            recovery_complete=not recovering,
            recovery_source=progress.source,
            recovery_scanned_bytes=progress.scanned_bytes,
            recovery_total_bytes=progress.total_bytes,
            recovery_headers=progress.headers,
            recovery_refused=progress.refused,
            recovery_old_format=progress.old_format,
            recovery_unheld=progress.unheld,
        )
        return out
