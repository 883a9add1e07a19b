"""Soak: four engine processes against a small pool, every loaded
byte checked, the daemon's memory and fds bounded.

Each process (tests/support/soak.py) does random stores (some rows only half
written), pinned and unpinned loads, lookups, pins, inline Gets and admin
evictions (Evict, sometimes Clear) in one shared namespace, for
KVDEPOT_SOAK_SECONDS (default 30, or 600 with KVDEPOT_LONG=1). Every block's bytes
derive from its key and rank, so a process checks every block it loads, whoever
stored it. The daemon checks its invariants after every mutation
(KVDEPOT_CHECK_INVARIANTS=1). This test samples the daemon's RSS and open fds from
/proc the whole time.

Marked `slow`; the long run (documented in tests/README.md):
    KVDEPOT_LONG=1 .venv/bin/python -m pytest -m slow tests/test_soak.py -s
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from kvdepot.testing.waiting import wait_for
from tests.support.faults import (
    DaemonFactory,
    admin,
    assert_pool_accounting,
    fd_targets,
    rss_bytes,
    soak_process,
    stats,
)

LONG = os.environ.get("KVDEPOT_LONG") == "1"
SECONDS = float(os.environ.get("KVDEPOT_SOAK_SECONDS") or (600 if LONG else 30))
WORKERS = 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(int(SECONDS) + 180)]

# Bounds on the daemon while the workers run. Four sessions need a few sockets each,
# plus one operator-socket connection each (their Evict and Clear go to Admin there); the
# pool (8 MiB) and the workers' registered memfds (2.8 MiB each) are mapped and counted
# in RSS from the start, so growth beyond that is a leak.
FD_HEADROOM = 28
RSS_GROWTH_LIMIT = 24 << 20


def test_four_engines_soak(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(
        "--pool-size", "8MiB", "--reservation-timeout", "5", env={"KVDEPOT_CHECK_INVARIANTS": "1"}
    )
    pid = d.proc.pid  # type: ignore[union-attr]
    stub = admin(d.admin_channel())
    stats(stub)
    base_fds = len(fd_targets(pid))
    samples: list[tuple[float, int, int]] = []  # (seconds since start, rss, fds)
    stop = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not stop.wait(0.25):
            samples.append((time.monotonic() - start, rss_bytes(pid), len(fd_targets(pid))))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = [
        soak_process(
            "soak",
            "--target",
            d.target,
            "--seconds",
            str(SECONDS),
            "--seed",
            str(seed),
            "--key-space",
            "300",
        )
        for seed in range(1, WORKERS + 1)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=SECONDS + 120)
            assert p.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        stop.set()
        sampler.join(5)
        for p in procs:
            if p.poll() is None:
                p.kill()

    totals: dict[str, int] = {}
    for r in reports:
        for k, v in r["ops"].items():
            totals[k] = totals.get(k, 0) + v
    print(
        f"soak {SECONDS:.0f}s x {WORKERS}: {dict(sorted(totals.items()))}; "
        f"verified pages {sum(r['verified_pages'] for r in reports)}"
    )
    # Zero wrong bytes, zero unexpected failures, and real work on every path.
    assert [r["mismatches"] for r in reports] == [0] * WORKERS
    assert [r["errors"] for r in reports] == [[]] * WORKERS
    for r in reports:
        ops = r["ops"]
        assert ops.get("store_keys", 0) > 0 and ops.get("load_ok", 0) > 0, ops
        assert ops.get("get_ok", 0) > 0 and r["verified_pages"] > 0, ops
    assert totals.get("evicted", 0) + totals.get("clear", 0) > 0
    assert stats(stub).evictions > 0  # the pool was small enough to evict by LRU too

    # Bounded resources while it ran: after warm-up (every worker registered),
    # RSS and fds stay within fixed bounds.
    warm = [s for s in samples if s[0] >= min(5.0, SECONDS / 4)]
    assert len(warm) >= 4, samples
    rss_warm = warm[0][1]
    rss_max = max(s[1] for s in warm)
    fds_max = max(s[2] for s in samples)
    print(
        f"daemon RSS {rss_warm >> 20} MiB after warm-up, max {rss_max >> 20} MiB; "
        f"fds {base_fds} idle, max {fds_max}"
    )
    assert rss_max - rss_warm <= RSS_GROWTH_LIMIT
    assert fds_max <= base_fds + FD_HEADROOM

    # Afterwards the daemon holds nothing for the departed workers.
    wait_for(lambda: stats(stub).sessions == 0, timeout=10, what="the workers' sessions to end")
    s = assert_pool_accounting(stub)
    assert (s.pinned_blocks, s.registrations, s.inflight_jobs) == (0, 0, 0)
    wait_for(
        lambda: len(fd_targets(pid)) <= base_fds,
        timeout=10,
        what="the daemon's fds to return to idle",
    )
