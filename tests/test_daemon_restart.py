"""The daemon killed under load: clients degrade, reconnect, re-register, carry on
(docs/architecture.md §8.1), and nothing blocks past its deadline.

A real daemon process and a DepotClient in this process with the pieces an engine
uses: two ranks registered again by a session listener after every (re)connect, a
Watch mirror, a load thread (store, load back, verify bytes) and a lookup thread.
The daemon is SIGKILLed in the middle, left down for a while, and started again
on the same socket (a memfd pool: it comes back empty, with a new boot id). Every
call is timed: while the daemon is down, lookups must fail fast and jobs must
fail with UNAVAILABLE results instead of hanging.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from kvdepot.client import DepotClient, DepotUnavailable
from kvdepot.common.jobs import Job, JobResult
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import DaemonProcess
from tests.support.engine import Engine, make_key
from tests.support.faults import DaemonFactory

pytestmark = pytest.mark.timeout(150)

NS = "restart-ns"
JOB_DEADLINE = 5.0  # how long the load thread waits for a job's result
LOOKUP_DEADLINE = 1.0
DOWN_SECONDS = 2.0


class Rig:
    """An engine's client side: registers both ranks again after every new session."""

    def __init__(self, client: DepotClient) -> None:
        self.client = client
        self.geo = soak.geometry(NS)
        self.lock = threading.Lock()
        self.engines: list[Engine] = []
        self.boot_ids: list[str] = []
        self.registered = threading.Condition(self.lock)
        client.add_session_listener(self.on_session)

    def on_session(self, boot_id: str) -> None:
        # Right after the daemon came back: RegisterKV waits for the client's unary
        # channel to reconnect (it used to fail at once with the error from the
        # downtime, in about one run of ten).
        # Registrations die with the daemon: register again on every new session.
        engines = [Engine(self.client, self.geo, r) for r in range(self.geo.world_size)]
        with self.lock:
            self.engines = engines
            self.boot_ids.append(boot_id)
            self.registered.notify_all()

    def current(self) -> list[Engine]:
        with self.lock:
            return list(self.engines)


@dataclass
class Op:
    kind: str
    start: float
    seconds: float
    ok: bool
    detail: str = ""


@dataclass
class Recorder:
    ops: list[Op] = field(default_factory=list)
    mismatches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)

    def between(self, kind: str, t0: float, t1: float) -> list[Op]:
        with self.lock:
            return [o for o in self.ops if o.kind == kind and t0 <= o.start < t1]


def run_job(eng: Engine, direction: int, keys: list[bytes], base: int) -> JobResult | None:
    """One job, waited for at most JOB_DEADLINE; None if no result came in time."""
    blocks, indices = soak.group_job(eng.geo, 0, keys, base)
    return eng.result(eng.submit(direction, keys, blocks, indices), JOB_DEADLINE)


def load_loop(rig: Rig, rec: Recorder, stop: threading.Event) -> None:
    """Store a fresh row with both ranks, load it back into rank 0, check the bytes."""
    n = 0
    while not stop.is_set():
        n += 1
        keys = [make_key(n, 0, b"restart")]
        engines = rig.current()
        t0 = time.monotonic()
        results = []
        try:
            for eng in engines:
                blocks, _ = soak.group_job(eng.geo, 0, keys, soak.STORE_BASE)
                eng.fill(0, keys, blocks[0], 0)
                results.append(("store", run_job(eng, pb.STORE, keys, soak.STORE_BASE)))
            if all(r is not None and r.success for _, r in results):
                res = run_job(engines[0], pb.LOAD, keys, soak.LOAD_BASE)
                results.append(("load", res))
                if res is not None and res.success:
                    lblocks, _ = soak.group_job(engines[0].geo, 0, keys, soak.LOAD_BASE)
                    with rec.lock:
                        rec.mismatches += engines[0].mismatches(0, keys, lblocks[0], 0)
        except DepotUnavailable:
            results.append(("job", None))
        seconds = time.monotonic() - t0
        for kind, r in results:
            detail = "no result in time" if r is None else r.error_code
            rec.add(Op(kind, t0, seconds, r is not None and r.success, detail))
        time.sleep(0.005)


def lookup_loop(client: DepotClient, rec: Recorder, stop: threading.Event) -> None:
    keys = [make_key(i, 0, b"restart") for i in range(1, 50)]
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            client.lookup(NS, keys, timeout=LOOKUP_DEADLINE)
            rec.add(Op("lookup", t0, time.monotonic() - t0, True))
        except DepotUnavailable:
            rec.add(Op("lookup", t0, time.monotonic() - t0, False, "DepotUnavailable"))
        except grpc.RpcError as exc:
            rec.add(Op("lookup", t0, time.monotonic() - t0, False, exc.code().name))
        time.sleep(0.01)


@pytest.fixture
def rig(daemon_factory: DaemonFactory) -> Iterator[tuple[DaemonProcess, Rig]]:
    d = daemon_factory("--pool-size", "32MiB")
    client = DepotClient(d.target, client_name="restart-engine").start()
    rig = Rig(client)
    with rig.lock:
        assert rig.registered.wait_for(lambda: rig.engines, timeout=10)
    yield d, rig
    client.close()


def test_clients_survive_a_daemon_sigkill_and_carry_on(rig: tuple[DaemonProcess, Rig]) -> None:
    daemon, r = rig
    client = r.client
    events: list[tuple[float, pb.WatchEvent]] = []
    mirror: set[bytes] = set()
    mirror_lock = threading.Lock()

    def on_watch(ev: pb.WatchEvent) -> None:
        with mirror_lock:
            events.append((time.monotonic(), ev))
            if ev.reset:
                mirror.clear()
            if ev.kind in (pb.WatchEvent.SNAPSHOT, pb.WatchEvent.STORED):
                mirror.update(ev.keys)
            elif ev.kind == pb.WatchEvent.REMOVED:
                mirror.difference_update(ev.keys)

    watch = client.watch(NS, on_watch)
    rec = Recorder()
    stop = threading.Event()
    threads = [
        threading.Thread(target=load_loop, args=(r, rec, stop), daemon=True),
        threading.Thread(target=lookup_loop, args=(client, rec, stop), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: sum(o.ok for o in rec.between("load", 0, 1e18)) >= 20,
            timeout=20,
            what="loads before the kill",
        )
        first_boot = client.boot_id
        with mirror_lock:
            assert mirror, "the Watch mirror saw the stored rows"

        killed = time.monotonic()  # before kill(), which also reaps the process
        daemon.kill()
        wait_for(lambda: not client.connected, timeout=2, what="the client to notice")
        noticed = time.monotonic() - killed
        wait_for(
            lambda: any(t >= killed and e.reset for t, e in list(events)),
            timeout=2,
            what="the watch reset",
        )
        with mirror_lock:
            assert not mirror, "after the reset the mirror must be empty (lookups miss)"

        time.sleep(DOWN_SECONDS)
        # While the daemon is down: calls fail fast, jobs fail with UNAVAILABLE.
        t0 = time.monotonic()
        with pytest.raises(DepotUnavailable):
            client.lookup(NS, [make_key(1, 0, b"restart")])
        with pytest.raises(DepotUnavailable):
            client.pin(NS, [make_key(1, 0, b"restart")])
        eng = r.current()[0]
        down_res = run_job(eng, pb.LOAD, [make_key(1, 0, b"restart")], soak.LOAD_BASE)
        assert down_res is not None and not down_res.success
        assert down_res.error_code == "UNAVAILABLE"
        assert time.monotonic() - t0 < 0.5, "calls while the daemon is down must fail fast"

        daemon.start()
        back = time.monotonic()
        with r.lock:
            assert r.registered.wait_for(lambda: len(r.boot_ids) >= 2, timeout=10), (
                "no re-registration after the daemon came back"
            )
        reconnected = time.monotonic() - back
        assert client.boot_id != first_boot
        wait_for(
            lambda: sum(o.ok for o in rec.between("load", back, 1e18)) >= 20,
            timeout=20,
            what="loads after the restart",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(JOB_DEADLINE * 4)
        watch.stop()

    print(
        f"client noticed the kill in {noticed:.3f}s; re-registered {reconnected:.3f}s after "
        f"the daemon was back"
    )
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert rec.mismatches == 0
    outage = rec.between("load", killed, back) + rec.between("store", killed, back)
    lookups_down = rec.between("lookup", killed + 0.2, back)
    assert lookups_down and not any(o.ok for o in lookups_down)
    assert {o.detail for o in lookups_down} <= {"DepotUnavailable", "UNAVAILABLE"}
    # Jobs during the outage failed (no bytes to trust) with UNAVAILABLE, never timed out.
    assert outage and not any(o.ok for o in outage)
    assert {o.detail for o in outage} <= {"UNAVAILABLE"}, {o.detail for o in outage}
    # Nothing ever blocked past its deadline (a little slack for a loaded machine).
    for o in rec.ops:
        limit = LOOKUP_DEADLINE if o.kind == "lookup" else 3 * JOB_DEADLINE
        assert o.seconds < limit + 0.5, o
    # Fail fast: far below the lookup deadline (no waiting for a dead daemon).
    assert max(o.seconds for o in rec.between("lookup", killed, back)) < 0.5
    assert noticed < 1.0
    # Backoff is capped at 2 s (x1.5 jitter) and gRPC's own reconnect backoff at 1 s,
    # then two RegisterKV calls: 6 s leaves room for a loaded machine.
    assert reconnected < 6.0
    # After the restart the mirror follows the new daemon (fresh snapshot, then deltas).
    with mirror_lock:
        new_keys = set(mirror)
    assert new_keys
    ready = client.lookup(NS, sorted(new_keys))
    assert all(ready)


def test_deadlines_hold_when_the_daemon_is_frozen(rig: tuple[DaemonProcess, Rig]) -> None:
    """SIGSTOP (a hung daemon, not a dead one): unary calls end at their deadline and a
    job wait returns at its timeout; after SIGCONT the job completes."""
    daemon, r = rig
    client = r.client
    eng = r.current()[0]
    key = [make_key(7, 0, b"frozen")]
    pid = daemon.proc.pid  # type: ignore[union-attr]
    os.kill(pid, signal.SIGSTOP)
    try:
        for call in (client.lookup, client.pin):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                call(NS, key, timeout=0.5)
            took = time.monotonic() - t0
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert took < 1.5, took
        blocks, indices = soak.group_job(eng.geo, 0, key, soak.STORE_BASE)
        eng.stream.submit(
            Job(
                job_id=999,
                direction=pb.STORE,
                registration_id=eng.registration.registration_id,
                keys=key,
                block_ids=blocks[0],
                group_sizes=[len(g) for g in blocks],
                block_indices=indices,
            )
        )
        t0 = time.monotonic()
        assert not eng.stream.wait({999}, timeout=0.5)
        assert time.monotonic() - t0 < 1.0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert eng.stream.wait({999}, timeout=10)
    (res,) = [x for x in eng.stream.poll() if x.job_id == 999]
    assert res.success, res.error
