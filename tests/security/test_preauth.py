"""Nothing before authentication is costly (docs/security.md, "Nothing before a session").

Each attack is a real attacker process (tests/security/preauth.py) against a real
`kvdepot serve`, while a victim engine beside it measures what it cares about: its
Lookup latency, against the same figure measured just before in the same test, and
its own bytes stored and loaded back.

Before: Transfer jobs of 4 Mi block ids, sent with no session, were each parsed and
copied into Python lists on the event loop before any session or size check; another
client's Lookup p50 went from 1.3 ms to 1,089 ms.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, connect
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import DaemonFactory

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
GEO = Geometry(groups=[[4096, 4096]], blocks_per_chunk=2, world_size=1, num_blocks=64)
ATTACK_SECONDS = 8.0


class Victim:
    """An engine with four chunks stored; what it measures."""

    def __init__(self, d: DaemonProcess) -> None:
        self.client = connect(d, "victim")
        self.engine = Engine(self.client, GEO, 0)
        self.keys, self.blocks, self.indices = chunk_plan(GEO, range(4))
        self.engine.fill(0, self.keys, self.blocks[0], self.indices[0])
        assert self.engine.job(pb.STORE, self.keys, self.blocks, self.indices).success

    def lookup_ms(self, n: int = 200, seconds: float = 5.0) -> list[float]:
        """Up to `n` Lookups (for `seconds` at most): each one's milliseconds."""
        rtts: list[float] = []
        end = time.monotonic() + seconds
        while len(rtts) < n and time.monotonic() < end:
            t = time.perf_counter()
            found = self.client.lookup(GEO.namespace, [self.keys[len(rtts) % 4], make_key(99, 0)])
            rtts.append((time.perf_counter() - t) * 1e3)
            assert found == [True, False]
        return rtts

    def round_trips(self) -> bool:
        fresh = Engine(self.client, GEO, 0)
        blocks = [list(range(8, 16))]
        if not fresh.job(pb.LOAD, self.keys, blocks, self.indices).success:
            return False
        return fresh.mismatches(0, self.keys, blocks[0], self.indices[0], rank=0) == 0


def attack(target: str, shape: str, seconds: float = ATTACK_SECONDS) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, str(REPO / "tests/security/preauth.py"), target, str(seconds), shape],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and "ready" in p.stdout.readline()
    time.sleep(0.5)  # under way
    return p


def report(p: subprocess.Popen[str]) -> dict[str, int]:
    out, _ = p.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])["codes"]


def p50(rtts: list[float]) -> float:
    return statistics.median(rtts)


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory("--pool-size", "64MiB")


# Shape -> the refusal the attacker must get for each of its jobs.
REFUSED = {
    "transfer-4mi": {"INVALID_ARGUMENT"},  # over the job's byte bound: never parsed
    "transfer-counts": {"FAILED_PRECONDITION"},  # no such session: before any list
    "transfer-bound": {"FAILED_PRECONDITION"},  # counted undecoded, then the session
    "lane-4mi": {"INVALID_ARGUMENT"},
    "lane-counts": {"RESOURCE_EXHAUSTED"},  # over --max-job-blocks: before any list
    "lane-bound": {"RESOURCE_EXHAUSTED"},  # counted before its ids are decoded
}


@pytest.mark.parametrize("shape", list(REFUSED))
def test_oversized_jobs_are_refused_before_anything_is_built(
    daemon: DaemonProcess, shape: str
) -> None:
    victim = Victim(daemon)
    quiet = victim.lookup_ms()
    p = attack(daemon.target, shape)
    try:
        loud = victim.lookup_ms()
        codes = report(p)
    finally:
        p.kill()
    print(
        f"{shape}: victim Lookup p50 {p50(quiet):.2f} ms quiet, {p50(loud):.2f} ms under "
        f"attack ({len(loud)} Lookups; max {max(loud):.1f} ms); attacker got {codes}"
    )
    assert set(codes) == REFUSED[shape] and sum(codes.values()) >= 2, codes
    # Generous: the machine is shared; before, the ratio was 800.
    assert p50(loud) < max(5 * p50(quiet), p50(quiet) + 10), (quiet, loud)
    assert victim.round_trips()
    victim.client.close()
