"""The remote tier's health (kvdepot.server.tier_health) in its own words."""

from __future__ import annotations

import logging

from kvdepot.server.tier_health import HealthWords, TierHealth

log = logging.getLogger("kvdepot.remote")

WORDS = HealthWords(
    tier="remote tier",
    down="is not answering",
    while_down="writes to it are dropped and lookups stay local until it answers again",
    back="answers again",
    when_back="writes and fetches resume",
)


def remote_health(description: str) -> TierHealth:
    return TierHealth(description, WORDS, log)
