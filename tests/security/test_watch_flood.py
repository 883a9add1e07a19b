"""Watch snapshots are read a slice at a time (docs/security.md, "Watch snapshots").

An attacker process (tests/security/watch_flood.py) fills a namespace of its own with
131,072 rows of 4 KiB, then reopens Watch streams in a loop on 8 threads, each stream
cancelled after its first message. Beside it a victim engine measures its Lookup
latency (against the same figure just before) and stores and loads its own rows.
Before, each open built the whole list of ready keys on the event loop: the victim's
Lookup p50 went from 0.9 to 70-74 ms (max 173-246 ms).

A second test checks that a snapshot read in slices while rows come and go still ends
in the namespace's exact set once the events after it are applied.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from kvdepot.v1 import depot_pb2 as pb
from tests.security.test_preauth import Victim
from tests.support.daemon import DaemonProcess, connect
from tests.support.engine import Engine, Geometry, make_key
from tests.support.faults import DaemonFactory, rss_mib

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
# FLOOD_ROWS: another namespace size, to compare (4,096 rows: one slice per snapshot).
ROWS = int(os.environ.get("FLOOD_ROWS", "131072"))
SECONDS = 8.0
THREADS = 8


def test_reopening_watch_streams_on_a_large_namespace_does_not_hold_the_loop(
    daemon_factory: DaemonFactory,
) -> None:
    d = daemon_factory("--pool-size", "640MiB")
    victim = Victim(d)
    quiet = victim.lookup_ms()
    p = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "watch_flood.py"),
            d.target,
            str(ROWS),
            str(SECONDS),
            str(THREADS),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdin is not None and p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        quiet_full = victim.lookup_ms()  # the namespace full, no stream yet
        rss_quiet = rss_mib(d.proc.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(0.5)  # under way
        loud = victim.lookup_ms(n=400, seconds=SECONDS - 1)
        rss_loud = rss_mib(d.proc.pid)
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    counts = json.loads(out.strip().splitlines()[-1])
    print(
        f"\nvictim Lookup ms: quiet p50 {statistics.median(quiet):.2f} max {max(quiet):.1f}; "
        f"{ROWS} rows, no stream: p50 {statistics.median(quiet_full):.2f} "
        f"max {max(quiet_full):.1f}; under {counts} in {SECONDS} s: "
        f"p50 {statistics.median(loud):.2f} max {max(loud):.1f}; RSS MiB {rss_quiet:.0f} -> "
        f"{rss_loud:.0f}"
    )
    assert counts.get("first_message", 0) >= 50, counts  # the attack ran
    base = statistics.median(quiet_full)
    # 20 ms of room for a loaded machine: the attack cost the victim about 49 ms.
    assert statistics.median(loud) < max(5 * base, base + 20), (quiet_full, loud)
    assert victim.round_trips()


def test_a_snapshot_read_while_rows_come_and_go_ends_in_the_exact_set(
    daemon: DaemonProcess,
) -> None:
    """12,288 rows, then a Watch stream, while 8,192 more rows are stored into a pool
    of about 16,000 (the oldest evicted): the snapshot's keys plus the events after
    it are exactly the rows Lookup finds ready."""
    geo = Geometry(groups=[[4096]], blocks_per_chunk=1, world_size=1, num_blocks=4096)
    writer = connect(daemon, "writer")
    engine = Engine(writer, geo, 0)
    keys = [make_key(c, 0) for c in range(20_480)]

    def store(start: int) -> None:
        part = keys[start : start + 4096]
        assert engine.job(pb.STORE, part, [list(range(len(part)))], [0]).success

    for start in range(0, 12_288, 4096):
        store(start)
    watcher = connect(daemon, "watcher")
    watcher.join(geo.namespace)
    seen: set[bytes] = set()
    stream = watcher.stub.Watch(
        pb.WatchRequest(session_id=watcher.session_id, namespace_id=geo.namespace)
    )
    events = {"snapshot_messages": 0, "after": 0}

    def read() -> None:
        try:
            for ev in stream:
                if ev.kind == pb.WatchEvent.SNAPSHOT:
                    events["snapshot_messages"] += 1
                    seen.update(ev.keys)
                elif ev.kind == pb.WatchEvent.STORED:
                    events["after"] += 1
                    seen.update(ev.keys)
                elif ev.kind == pb.WatchEvent.REMOVED:
                    events["after"] += 1
                    seen.difference_update(ev.keys)
        except grpc.RpcError as exc:  # the test cancels the stream when it is done
            assert exc.code() == grpc.StatusCode.CANCELLED, exc

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for start in range(12_288, 20_480, 4096):  # while the snapshot is read, some of it
        store(start)

    def ready() -> set[bytes]:
        found: list[bool] = []
        for i in range(0, len(keys), 8192):
            found += writer.lookup(geo.namespace, keys[i : i + 8192])
        return {k for k, r in zip(keys, found, strict=True) if r}

    expected = ready()
    assert 4096 < len(expected) < len(keys)  # some rows were evicted
    deadline = time.monotonic() + 20
    while seen != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    stream.cancel()
    assert seen == expected, (len(seen), len(expected), len(seen ^ expected))
    assert events["snapshot_messages"] >= 1 and events["after"] > 0, events
