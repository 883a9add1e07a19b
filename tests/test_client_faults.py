"""Client-side failure handling: a frozen daemon is detected by its missing
keepalives, and an aborted Transfer stream fails its jobs at once; listeners on the
stream loop never deadlock it; a process forked from one with live streams says
why its clients cannot connect, and never hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvdepot.client import DepotClient
from kvdepot.common.jobs import Job
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan

pytestmark = pytest.mark.timeout(120)


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
            Job(
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


# Run in a process of its own, with the environment a user's process has: forking
# pytest's process, with its threads, would not test what an engine's process does.
_FORK_SCENARIO = """
import logging, os, sys, time
from kvdepot.client import DepotClient
logging.basicConfig(stream=sys.stdout, level=logging.ERROR, format="%(message)s")
target = sys.argv[1]
parent = DepotClient(target).start()
events = []
parent.watch("fork-test", events.append)
deadline = time.monotonic() + 10
while not (parent.connected and events) and time.monotonic() < deadline:
    time.sleep(0.05)
assert parent.connected and events, "the parent's client did not connect"
crashed = 0
for _ in range(10):  # children that never touch kvdepot
    pid = os.fork()
    if pid == 0:
        time.sleep(0.02)
        os._exit(0)
    crashed += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
print("plain children crashed:", crashed, flush=True)
pid = os.fork()
if pid == 0:
    child = DepotClient(target).start()
    child.watch("fork-test", lambda event: None)
    time.sleep(2)
    print("child connected:", child.connected, flush=True)
    started = time.monotonic()
    child.close()
    print("child closed in %.1f s" % (time.monotonic() - started), flush=True)
    os._exit(0)
print("child exit:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
print("parent connected:", parent.connected, flush=True)
parent.close()
"""


def test_a_process_with_live_streams_may_fork_and_its_child_says_why_it_cannot_connect(
    daemon,
) -> None:
    """gRPC core's fork handlers crashed children forked while a grpc.aio stream was
    open; kvdepot turns them off. A child's kvdepot clients can never open a session
    (grpc.aio does not survive fork): the child says so, never hangs, and leaves the
    parent's client alone."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_SCENARIO, daemon.target],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plain children crashed: 0" in out, out
    assert "forked while its parent had 1 kvdepot stream channel(s) open" in out, out
    assert "'spawn'" in out
    assert "child connected: False" in out
    closed = float(out.split("child closed in ")[1].split(" s")[0])
    assert closed < 6.0, out  # close() waits on the loop at most 5 s, never for ever
    assert "child exit: 0" in out
    assert "parent connected: True" in out
