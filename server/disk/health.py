"""The disk tier's health (kvdepot.server.tier_health) in its own words.

A failed write or read (ENOSPC, EIO, EROFS, the file removed) marks the tier down:
writes are dropped (counted) and reads stay in RAM at once. After the back-off the
next write lets one probe through, which reserves the file's space again or creates
the file anew; its success brings the tier back. DiskTier calls it under its lock.
"""

from __future__ import annotations

import logging

from kvdepot.server.tier_health import HealthWords, TierHealth

log = logging.getLogger("kvdepot.disk")

WORDS = HealthWords(
    tier="disk tier",
    down="failed",
    while_down="blocks stay in RAM only, writes to the disk are dropped until it works again",
    back="works again",
    when_back="writes and reads resume",
)


def disk_health(description: str) -> TierHealth:
    return TierHealth(description, WORDS, log)
