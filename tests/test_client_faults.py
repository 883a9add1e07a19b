"""Client-side failure handling: a frozen daemon is detected by its missing
keepalives, and an aborted Transfer stream fails its jobs at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan

pytestmark = pytest.mark.timeout(120)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_frozen_daemon_is_dropped_and_rejoined_when_it_thaws(daemon) -> None:
    c = DepotClient(daemon.target, keepalive_timeout=2.0).start()
    assert c.wait_connected(10)
    first = c.hello.session_id
    lost: list[float] = []
    c.add_disconnect_listener(lambda: lost.append(time.monotonic()))
    frozen_at = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        # The daemon sends keepalives every 5 s; 2 s of silence is not yet
        # suspicious, but 5 s + 2 s is.
        assert wait_for(lambda: not c.connected, 12), "frozen daemon never detected"
        assert lost and lost[0] - frozen_at < 10
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert c.wait_connected(15), "no reconnect after the daemon thawed"
    assert c.hello.session_id != first  # a fresh session: the old one was released
    c.close()


def test_abort_fails_jobs_in_flight_and_the_stream_reopens(daemon) -> None:
    c = DepotClient(daemon.target).start()
    assert c.wait_connected(10)
    geo = Geometry(world_size=1, namespace="abort")
    eng = Engine(c, geo, 0)
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        eng.stream.submit(
            pb.TransferJob(
                job_id=100,
                direction=pb.STORE,
                registration_id=eng.registration.registration_id,
                keys=keys,
                block_ids=[b for bl in blocks for b in bl],
                group_sizes=[len(b) for b in blocks],
                block_indices=idx,
            )
        )
        assert not eng.stream.wait({100}, timeout=0.3)  # frozen: no answer
        t = time.monotonic()
        eng.stream.abort("gave up on a frozen daemon")
        assert eng.stream.wait({100}, timeout=1.0)
        assert time.monotonic() - t < 1.0
        (res,) = eng.stream.poll()
        assert not res.success and res.error_code == "CANCELLED"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # The same client carries on over a new stream.
    for g, bl in enumerate(blocks):
        eng.fill(g, keys[g * 4 : (g + 1) * 4], bl, idx[g])
    eng._next_job = 200
    res = eng.job(pb.STORE, keys, blocks, idx)
    assert res.success and res.stored_keys + res.present_keys == 8
    c.close()


def test_a_session_listener_may_start_another_client_and_watch(daemon) -> None:
    """Listeners run on the process's stream loop; starting a client (or a watch)
    there must not wait for that same loop."""
    outer = DepotClient(daemon.target)
    inner: list[DepotClient] = []
    events: list[pb.WatchEvent] = []

    def on_session(boot_id: str) -> None:
        if not inner:
            c = DepotClient(daemon.target).start()
            inner.append(c)
            c.watch("nowhere-yet", events.append)

    outer.add_session_listener(on_session)
    outer.start()
    try:
        assert wait_for(lambda: bool(inner) and inner[0].connected, 10)
        # The watch's first event: the daemon's snapshot, even of a namespace no
        # engine has declared yet.
        assert wait_for(lambda: bool(events), 10)
        assert outer.connected
    finally:
        for c in inner:
            c.close()
        outer.close()


def test_a_session_listener_may_watch_while_another_thread_starts_a_watch(daemon) -> None:
    """A thread starting a watch waits for the stream loop; a session listener, on that
    loop, starting a watch on the same client meanwhile must not wait for that thread."""
    client = DepotClient(daemon.target)
    in_listener, thread_started = threading.Event(), threading.Event()
    events: dict[str, list[pb.WatchEvent]] = {"listener": [], "thread": []}

    def on_session(boot_id: str) -> None:
        if in_listener.is_set():
            return
        in_listener.set()
        thread_started.wait(10)
        time.sleep(0.3)  # the thread is now waiting for this loop
        client.watch("from-listener", events["listener"].append)

    def start_watch() -> None:
        in_listener.wait(10)
        thread_started.set()
        client.watch("from-thread", events["thread"].append)

    client.add_session_listener(on_session)
    thread = threading.Thread(target=start_watch, daemon=True)
    thread.start()
    client.start()
    try:
        thread.join(10)
        assert not thread.is_alive(), "the thread's watch waits for a loop that waits for it"
        assert wait_for(lambda: all(events.values()), 10)  # both snapshots came
        assert client.connected
    finally:
        client.close()
