"""Small statistics for the bench: medians, percentiles, and the overlap window.

Pure functions with no I/O, so the way figures are derived is tested directly
(tests/test_bench.py) and stays the same for the daemon and in-process runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

GB = 1e9  # throughput is reported in GB/s (10^9 bytes), the unit memory bandwidth uses


def median(values: Sequence[float]) -> float:
    """The median; 0.0 for no values (a section that measured nothing reads as zero)."""
    if not values:
        return 0.0
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


Job = tuple[float, float, int]  # (start, end, bytes): one job's interval on CLOCK_MONOTONIC


def overlap_rate(per_worker: Sequence[Sequence[Job]]) -> tuple[float, float]:
    """Aggregate bytes/s while every worker was busy, and the window's length in seconds.

    The window runs from the latest first-job start to the earliest last-job end,
    so it covers only the time when all workers were running (no ramp-up, no tail
    where the fast ones are already done). A job that straddles an edge counts in
    proportion to its overlap. If the workers never overlapped (one finished
    before another began) the rate falls back to all bytes over the whole span.
    """
    busy = [jobs for jobs in per_worker if jobs]
    if not busy:
        return 0.0, 0.0
    start = max(jobs[0][0] for jobs in busy)
    end = min(jobs[-1][1] for jobs in busy)
    if end <= start:
        first = min(jobs[0][0] for jobs in busy)
        last = max(jobs[-1][1] for jobs in busy)
        total = sum(n for jobs in busy for _, _, n in jobs)
        span = max(last - first, 1e-9)
        return total / span, span
    counted = 0.0
    for jobs in busy:
        for t0, t1, n in jobs:
            lo, hi = max(t0, start), min(t1, end)
            if hi <= lo:
                continue
            counted += n * (hi - lo) / max(t1 - t0, 1e-12)
    return counted / (end - start), end - start


def busy_rate(jobs: Sequence[Job]) -> float:
    """Bytes per second of busy time: one worker's jobs, gaps between them left out.

    For jobs run one at a time and interleaved with other work (the paired
    series), this is the rate of the path itself.
    """
    busy = sum(t1 - t0 for t0, t1, _ in jobs)
    return sum(n for _, _, n in jobs) / busy if busy > 0 else 0.0


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0.0 when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else 0.0
