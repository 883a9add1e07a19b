"""Shares per owner (docs/security.md, "Shares per owner"): what one client takes, it
takes from its own share, never from another client's.

Each attack is a real attacker process (tests/security/owners.py) against a real
`kvdepot serve`, with a legitimate engine beside it whose bytes must come back
exactly. Before:
- a process opening Sessions in a loop ended the oldest session nobody had attested,
  whoever's it was: a TCP engine (which never attests) lost its session 47 times in
  10 s, and 8 processes holding the fd socket's places kept local engines from
  attesting, so theirs went too;
- two sessions of one process each took their 50 % of the pool in rows being written
  (or pinned): the pool was held whole, every other engine's stores "pool full";
- processes of one uid (engine pods share the image's) took the uid's whole quota of
  sessions: another engine of the uid got none, and the daemon logged nothing;
- a session holder opened thousands of idle Transfer streams, using up the server's
  concurrent-call limit: every other client's calls got RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, connect
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import DaemonFactory
from tests.support.unprivileged import AS_NOBODY, nobody_python, nobody_script

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
OWNERS = str(REPO / "tests/security/owners.py")
GEO = Geometry(groups=[[16384, 16384]], blocks_per_chunk=2, world_size=1, num_blocks=64)


def start(mode: str, target: str, seconds: float, *args: str, as_nobody: bool = False):
    """An owners.py process (as uid 65534: from copies that uid may read), once it says
    it is under way (and what it said)."""
    cmd = [*AS_NOBODY, nobody_python(), nobody_script(OWNERS)] if as_nobody else None
    p = subprocess.Popen(
        [*(cmd or [sys.executable, OWNERS]), mode, target, str(seconds), *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/" if as_nobody else REPO,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "ready" in line, (mode, line, p.wait(30))
    return p, json.loads(line)["ready"]


def finish(p: subprocess.Popen[str]) -> dict:
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def round_trip(d: DaemonProcess, name: str, chunks: range) -> str:
    """A new engine (a session of its own, opened now) stores rows and loads them
    back into other blocks: "ok" when byte for byte, else what went wrong."""
    try:
        client = connect(d, name)
    except AssertionError:
        return "no session"
    try:
        eng = Engine(client, GEO, 0)
        keys, blocks, indices = chunk_plan(GEO, chunks, salt=name.encode())
        eng.fill(0, keys, blocks[0], indices[0])
        stored = eng.job(pb.STORE, keys, blocks, indices)
        if not stored.success or stored.stored_keys != len(keys):
            why = stored.drop_reason or stored.error
            return f"stored {stored.stored_keys} of {len(keys)}: {why}"
        back = [[b + 32 for b in blocks[0]]]
        loader = Engine(client, GEO, 0)  # memory of its own: nothing there but what loads
        loaded = loader.job(pb.LOAD, keys, back, indices)
        if not loaded.success:
            return f"load failed: {loaded.error}"
        wrong = loader.mismatches(0, keys, back[0], indices[0], rank=0)
        return "ok" if wrong == 0 else f"{wrong} pages wrong"
    except Exception as exc:  # the old code's failures, reported rather than raised
        return f"{type(exc).__name__}: {exc}"[:300]
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sessions_opened_in_a_loop_end_only_the_openers_own(
    daemon_factory: DaemonFactory,
) -> None:
    """Row: open Sessions in a loop. The TCP engine (uid 65534: it cannot reach the fd
    socket, as an engine on another host cannot) keeps its one session throughout;
    a local engine connecting during the attack gets a session and round-trips."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv: the TCP engine runs as uid 65534")
    port = free_port()
    d = daemon_factory("--pool-size", "64MiB", "--listen", f"127.0.0.1:{port}")
    victim, _ = start("tcp-victim", f"127.0.0.1:{port}", 12, as_nobody=True)
    time.sleep(2.5)  # its quiet figures first (owners.QUIET)
    attacker, _ = start("churn", d.target, 9)
    time.sleep(1)
    local = round_trip(d, "local engine", range(4))  # connects under the attack
    churned = finish(attacker)["codes"]
    seen = finish(victim)
    print(f"\nchurn: {churned}; TCP engine: {seen}; local engine: {local}")
    assert churned.get("opened", 0) > 200, churned  # the attack ran
    assert seen["sessions_opened"] == 1, seen  # never lost its session
    assert seen["failed"] == 0 and seen["wrong"] == 0 and seen["gets"] > 50, seen
    assert local == "ok"
    assert round_trip(d, "engine after", range(4, 8)) == "ok"


@pytest.mark.parametrize("mode", ["hold-writing", "hold-pins"])
def test_sessions_of_one_process_share_one_quota(daemon_factory: DaemonFactory, mode: str) -> None:
    """Row: two sessions of one process each take their 50 % of the pool (in rows
    being written, or pinned). Now the process's sessions share one 50 %: another
    engine stores and loads half the pool beside it, byte for byte."""
    d = daemon_factory("--pool-size", "8MiB")
    hog, held = start(mode, d.target, 30)
    # Rows of 64 KiB: 1.5 MiB stored by other processes, and loaded back.
    other = [round_trip(d, "other engine", range(16)), round_trip(d, "another", range(16, 24))]
    print(f"\n{mode}: the hog's two sessions {held}; other engines: {other}")
    assert other == ["ok", "ok"]
    if mode == "hold-writing":  # the second session's rows past the process's 50 %
        assert held == [64, 0], held
    else:  # the second session's pins refused: the process holds its 50 % already
        assert held == [64, "RESOURCE_EXHAUSTED"], held
    hog.kill()
    hog.wait()


def test_pins_of_every_process_together_leave_a_quarter_of_the_pool(
    daemon_factory: DaemonFactory,
) -> None:
    """Two processes, one session each, each pin half the pool: the second's pins
    would hold it all; past 75 % (--max-pool-held) they are refused, and another
    engine stores and loads beside them."""
    d = daemon_factory("--pool-size", "8MiB")
    first, held = start("hold-pins-one", d.target, 30, "0")
    second, held2 = start("hold-pins-one", d.target, 30, "1")
    other = round_trip(d, "other engine", range(16))
    print(f"\ntwo processes' pins: {held}, {held2}; other engine: {other}")
    assert held == [64] and held2 == ["RESOURCE_EXHAUSTED"]
    assert other == "ok"
    for p in (first, second):
        p.kill()
        p.wait()


@pytest.mark.parametrize("held", ["75%", "40%"])
def test_a_lower_pool_held_setting_takes_effect(daemon_factory: DaemonFactory, held: str) -> None:
    """Two processes pin 30% of the pool each (within --max-pinned-per-session 30%):
    together 60%, which the default --max-pool-held (75%) allows and 40% refuses; an
    engine stores and loads beside them either way."""
    d = daemon_factory(
        "--pool-size", "8MiB", "--max-pinned-per-session", "30%", "--max-pool-held", held
    )
    first, got = start("hold-pins-one", d.target, 30, "0", "30")
    second, got2 = start("hold-pins-one", d.target, 30, "1", "30")
    print(f"\n--max-pool-held {held}: pins {got}, {got2}")
    assert got == [38]  # 30% of 8 MiB in 64 KiB chunks
    assert got2 == ([38] if held == "75%" else ["RESOURCE_EXHAUSTED"])
    assert round_trip(d, "other engine", range(8)) == "ok"
    for p in (first, second):
        p.kill()
        p.wait()


def test_lower_call_caps_take_effect(daemon_factory: DaemonFactory) -> None:
    """--max-calls-per-pid 16, --max-calls-per-uid 24: two processes of one uid open 200
    idle Transfer streams each; 16 of the first stay open and 8 of the second (the
    uid's 24), the rest are refused, and another engine's calls are served."""
    d = daemon_factory(
        "--pool-size", "64MiB", "--max-calls-per-pid", "16", "--max-calls-per-uid", "24"
    )
    first, _ = start("streams", d.target, 10, "200")  # still open while the second opens
    second, _ = start("streams", d.target, 1, "200")
    got, got2 = finish(first), finish(second)
    print(f"\nstreams held: {got}, {got2}")
    assert got["open"] == 16 and got2["open"] == 8, (got, got2)
    assert got["codes"]["RESOURCE_EXHAUSTED"] == 184, got
    said = d.log_path.read_text()
    assert "--max-calls-per-pid" in said and "--max-calls-per-uid" in said, said[-2000:]
    assert round_trip(d, "engine beside", range(4)) == "ok"


def test_processes_of_one_uid_share_its_quota_fairly(daemon_factory: DaemonFactory) -> None:
    """Row: processes of one uid hold the uid's whole quota of sessions. Now another
    engine of the uid takes the place of the oldest session of the process holding
    the most, and the daemon says so in words."""
    d = daemon_factory(
        "--pool-size", "64MiB", "--max-sessions-per-uid", "8", "--max-sessions-per-pid", "4"
    )
    hogs = [start("sessions", d.target, 20, "4") for _ in range(2)]
    assert [held for _, held in hogs] == [4, 4]  # the uid's 8
    third = round_trip(d, "third engine", range(4))
    log = d.log_path.read_text()
    said = [line for line in log.splitlines() if "fair share" in line]
    print(f"\nthird engine: {third}; the log: {said[:2]}")
    assert third == "ok"
    assert any("over its fair share" in line for line in said), log[-2000:]
    for p, _ in hogs:
        p.kill()
        p.wait()


@pytest.mark.parametrize("mode", ["bare-streams", "streams", "unread-calls"])
def test_idle_streams_of_one_client_leave_the_others_served(
    daemon_factory: DaemonFactory, mode: str
) -> None:
    """Row: ~4,150 idle Transfer streams use up the server's concurrent-call limit.
    Without a session each is refused at once (the gate); with one, past the
    account's --max-calls-per-pid (256), and so are Lookups whose request never comes.
    Another engine's Lookups are served throughout."""
    d = daemon_factory("--pool-size", "64MiB")
    victim = connect(d, "victim")
    eng = Engine(victim, GEO, 0)
    keys, blocks, indices = chunk_plan(GEO, range(4))
    assert eng.job(pb.STORE, keys, blocks, indices).success

    def lookups() -> tuple[float, int]:
        """p50 ms of 100 Lookups, and how many were refused."""
        rtts, refused = [], 0
        for _ in range(100):
            t = time.perf_counter()
            try:
                assert victim.lookup(GEO.namespace, [keys[0], make_key(99, 0)]) == [True, False]
                rtts.append((time.perf_counter() - t) * 1e3)
            except grpc.RpcError as exc:
                refused += 1
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return statistics.median(rtts or [0]), refused

    quiet = lookups()
    hog, said = start(mode, d.target, 5, "5000")
    loud = lookups()
    got = finish(hog)
    print(
        f"\n{mode}: {said} opened; {got}; victim Lookup p50 ms, refused of 100: "
        f"quiet {quiet[0]:.2f}, {quiet[1]}; under attack {loud[0]:.2f}, {loud[1]}"
    )
    assert loud[1] == 0
    limit = 0 if mode == "bare-streams" else 256  # the gate; --max-calls-per-pid
    assert got["open"] <= limit, got
    assert round_trip(d, "engine after", range(4, 8)) == "ok"
    victim.close()
