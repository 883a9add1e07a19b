"""Job lanes against a real `kvdepot serve`: Transfer jobs as datagrams on a Unix
socket pair (kvdepot.client.job_lane, kvdepot.server.service.job_lane).

Bytes stored and loaded over a lane come back identical and the lane is what
carried them (Admin counts lane jobs); with the lane off the gRPC stream does;
an engine killed with jobs in flight on its lane leaves nothing held; garbage
datagrams get INVALID_ARGUMENT or close that lane only; a client that never reads
its results cannot grow the daemon's memory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.client import DepotClient
from kvdepot.client.fdpass import send_fd
from kvdepot.common.jobs import Job
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import stats
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import rss_mib


def raw_lane(
    client: DepotClient, bufsize: int | None = None, batched: bool = False
) -> socket.socket:
    """A lane opened by hand (no TransferStream): the test plays the client's end, an
    older client's (one TransferResult a datagram) unless `batched`."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if bufsize:
        for s in (mine, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    assert client.hello is not None
    token = send_fd(client.hello.fd_socket, client.session_id, theirs.fileno())
    theirs.close()
    resp = client.stub.OpenJobLane(
        pb.OpenJobLaneRequest(
            session_id=client.session_id, fd_token=token, batched_results=batched
        ),
        timeout=10,
    )
    assert resp.lane_id > 0 and resp.max_job_bytes >= 1 << 20
    assert resp.batched_results == batched
    return mine


def lane_engine(client: DepotClient, geo: Geometry, job_lane: bool = True) -> Engine:
    eng = Engine(client, geo, 0)
    eng.stream.close()
    eng.stream = client.transfer_stream(job_lane=job_lane)
    if job_lane:
        assert wait_for(lambda: eng.stream.uses_lane, 10), "the lane did not open"
    return eng


def test_store_and_load_over_the_lane_are_byte_identical(daemon, client) -> None:
    geo = Geometry(world_size=1, namespace="lane-bytes")
    eng = lane_engine(client, geo)
    before = stats(daemon.admin_target)
    keys, blocks, idx = chunk_plan(geo, range(0, 40))
    for g, b in enumerate(blocks):
        eng.fill(g, keys[g * 40 : (g + 1) * 40], b, idx[g])
    res = eng.job(pb.STORE, keys, blocks, idx)
    assert res.success and res.stored_keys == 80, res
    # Load into other blocks (zeroed first) and compare every page.
    _, other, _ = chunk_plan(geo, range(0, 40), base_block=300)
    eng.mem[:] = 0
    res = eng.job(pb.LOAD, keys, other, idx)
    assert res.success and res.bytes > 0, res
    for g, b in enumerate(other):
        assert eng.mismatches(g, keys[g * 40 : (g + 1) * 40], b, idx[g]) == 0
    # A failing job keeps the error contract: the same code a Transfer stream gives.
    missing = [make_key(999, 0)]
    res = eng.job(pb.LOAD, missing, [[1], []], [0, 0])
    assert not res.success and res.error_code == "NOT_FOUND", res
    after = stats(daemon.admin_target)
    assert after.job_lanes_open == 1
    assert after.lane_jobs - before.lane_jobs == 3  # all three came by the lane
    assert after.store_jobs - before.store_jobs == 1
    with daemon.admin_channel() as ch:
        engines = admin_pb2_grpc.AdminStub(ch).ListEngines(admin_pb2.ListEnginesRequest())
    assert [e.job_lanes for e in engines.engines] == [1]
    eng.stream.close()  # a half-close: the daemon closes the lane once it is idle
    assert wait_for(lambda: stats(daemon.admin_target).job_lanes_open == 0)


def test_lane_off_uses_the_grpc_stream(daemon, client, monkeypatch) -> None:
    monkeypatch.setenv("KVDEPOT_JOB_LANE", "0")
    geo = Geometry(world_size=1, namespace="lane-off")
    eng = Engine(client, geo, 0)  # its stream follows the environment: no lane
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    for g, b in enumerate(blocks):
        eng.fill(g, keys[g * 4 : (g + 1) * 4], b, idx[g])
    assert eng.job(pb.STORE, keys, blocks, idx).success
    res = eng.job(pb.LOAD, keys, blocks, idx)
    assert res.success
    s = stats(daemon.admin_target)
    assert not eng.stream.uses_lane
    assert s.lane_jobs == 0 and s.job_lanes_open == 0 and s.load_jobs == 1


def test_abort_cancels_lane_jobs_and_the_next_submit_reopens(daemon, client) -> None:
    geo = Geometry(world_size=1, namespace="lane-abort")
    eng = lane_engine(client, geo)
    keys, blocks, idx = chunk_plan(geo, range(0, 8))
    for j in range(1, 40):
        eng.stream.submit(
            Job(
                job_id=j,
                direction=pb.STORE,
                registration_id=eng.registration.registration_id,
                keys=keys,
                block_ids=[b for g in blocks for b in g],
                group_sizes=[len(g) for g in blocks],
                block_indices=idx,
            )
        )
    eng.stream.abort("test")
    assert eng.stream.inflight == 0
    assert wait_for(lambda: stats(daemon.admin_target).job_lanes_open == 0)
    s = stats(daemon.admin_target)
    assert s.inflight_jobs == 0 and s.writing_blocks == 0
    eng._next_job = 100
    assert eng.job(pb.STORE, keys, blocks, idx).success  # gRPC or a new lane: it works
    assert wait_for(lambda: eng.stream.uses_lane, 10)
    assert eng.job(pb.LOAD, keys, blocks, idx).success


# The victim: opens its lane, then submits store and load jobs without waiting for
# them, over and over, so that many are queued in the daemon when it is killed.
VICTIM = """
import json, sys
sys.path.insert(0, sys.argv[2])
from kvdepot.client import DepotClient
from kvdepot.common.jobs import Job
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan
from tests.test_job_lane import lane_engine
c = DepotClient(sys.argv[1], client_name="victim").start()
assert c.wait_connected(10)
geo = Geometry(world_size=1, namespace="victim")
eng = lane_engine(c, geo)
keys, blocks, idx = chunk_plan(geo, range(0, 20))
assert eng.job(pb.STORE, keys, blocks, idx).success
print(json.dumps({"lane": eng.stream.uses_lane}), flush=True)
job_id = 100
while True:
    for direction in (pb.STORE, pb.LOAD):
        job_id += 1
        eng.stream.submit(Job(
            job_id=job_id, direction=direction,
            registration_id=eng.registration.registration_id, keys=keys,
            block_ids=[b for g in blocks for b in g], group_sizes=[len(g) for g in blocks],
            block_indices=idx))
    if eng.stream.inflight > 200:
        eng.stream.wait({job_id - 150}, timeout=30)
        eng.stream.poll()
"""


def test_engine_killed_with_lane_jobs_in_flight_releases_everything(daemon) -> None:
    repo = str(Path(__file__).resolve().parents[1])
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, daemon.target, repo],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVDEPOT_JOB_LANE": "1"},
    )
    try:
        assert json.loads(victim.stdout.readline()) == {"lane": True}  # type: ignore[union-attr]
        # Jobs queue up in the daemon, all by the lane.
        assert wait_for(
            lambda: (
                (s := stats(daemon.admin_target)).lane_jobs > 300
                and s.inflight_jobs > 0
                and s.job_lanes_open == 1
            ),
            30,
        ), stats(daemon.admin_target)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    finally:
        if victim.poll() is None:
            victim.kill()
    assert wait_for(
        lambda: (
            (s := stats(daemon.admin_target)).sessions == 0
            and s.registrations == 0
            and s.job_lanes_open == 0
            and s.inflight_jobs == 0
            and s.writing_blocks == 0
            and s.pinned_blocks == 0
        )
    ), stats(daemon.admin_target)
    # Still serving: a new engine stores and loads over a lane of its own.
    c = DepotClient(daemon.target, client_name="after").start()
    try:
        assert c.wait_connected(10)
        geo = Geometry(world_size=1, namespace="after-kill")
        eng = lane_engine(c, geo)
        keys, blocks, idx = chunk_plan(geo, range(0, 2))
        for g, b in enumerate(blocks):
            eng.fill(g, keys[g * 2 : (g + 1) * 2], b, idx[g])
        assert eng.job(pb.STORE, keys, blocks, idx).success
        assert eng.job(pb.LOAD, keys, blocks, idx).success
    finally:
        c.close()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "older client"])
def test_every_job_is_answered_once_batched_or_not(daemon, client, batched: bool) -> None:
    """Jobs waiting at once (sent while the daemon was stopped, as many as the socket
    queues): a lane that asked for batched results reads TransferResults datagrams
    carrying several results (the daemon reads every waiting job in one wake-up and
    answers those of one turn together); an older client's lane reads one
    TransferResult a datagram. Either way each job has exactly one answer."""
    n = 600  # several socketfuls
    lane = raw_lane(client, batched=batched)
    lane.settimeout(10)
    jobs = [
        pb.TransferJob(job_id=job_id, registration_id=4242, session_id=client.session_id)
        for job_id in range(1, n + 1)  # each fails at once (no such registration)
    ]
    answers: list[pb.TransferResult] = []
    datagrams = bursts = 0
    while jobs:
        bursts += 1
        burst = 0
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        lane.setblocking(False)
        try:  # until the socket's queue is full (its buffer: about 120 small datagrams)
            while jobs:
                lane.send(jobs[0].SerializeToString())
                jobs.pop(0)
                burst += 1
        except BlockingIOError:
            pass
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
            lane.settimeout(10)
        expected = len(answers) + burst
        while len(answers) < expected:
            data = lane.recv(1 << 17)
            assert data, "the lane closed before every job was answered"
            datagrams += 1
            if batched:
                answers += pb.TransferResults.FromString(data).results
            else:
                answers.append(pb.TransferResult.FromString(data))
    assert sorted(r.job_id for r in answers) == list(range(1, n + 1))
    assert {r.error_code for r in answers} == {"FAILED_PRECONDITION"}
    if batched:
        assert bursts > 1 and datagrams <= n / 8, (datagrams, bursts)
    else:
        assert datagrams == n
    lane.shutdown(socket.SHUT_WR)  # half-closed: answered everything, the daemon closes
    assert lane.recv(1 << 17) == b""
    lane.close()
    if not batched:
        return
    # Over the client's own lane (batched), real jobs come back each once too.
    geo = Geometry(world_size=1, namespace="lane-once")
    eng = lane_engine(client, geo)
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    assert eng.job(pb.STORE, keys, blocks, idx).success
    ids = [eng.submit(pb.LOAD, keys, blocks, idx) for _ in range(64)]
    assert eng.stream.wait(ids, timeout=20)
    results = eng.stream.poll()
    assert sorted(r.job_id for r in results) == ids and all(r.success for r in results)
    assert eng.stream.uses_lane


def test_garbage_datagrams_fail_clearly_and_others_are_served(daemon, client) -> None:
    lane = raw_lane(client)
    lane.settimeout(10)
    # job_id 7, then bytes that are no protobuf field: the job fails by its id.
    lane.send(b"\x08\x07" + b"\xff" * 5)
    res = pb.TransferResult.FromString(lane.recv(65536))
    assert res.job_id == 7 and not res.success
    assert res.error_code == "INVALID_ARGUMENT" and "TransferJob" in res.error, res
    # A valid job on the same lane still runs (and fails by the usual rules).
    lane.send(
        pb.TransferJob(
            job_id=8, registration_id=4242, session_id=client.session_id
        ).SerializeToString()
    )
    res = pb.TransferResult.FromString(lane.recv(65536))
    assert res.job_id == 8 and res.error_code == "FAILED_PRECONDITION", res
    assert "registration 4242" in res.error
    # A job naming another session is refused: a lane is its own session's.
    lane.send(pb.TransferJob(job_id=9, registration_id=4242, session_id="x").SerializeToString())
    res = pb.TransferResult.FromString(lane.recv(65536))
    assert res.job_id == 9 and res.error_code == "PERMISSION_DENIED", res
    assert "its own session only" in res.error
    # No job id to answer: the daemon closes this lane (the client reads its end).
    lane.send(b"\xff" * 16)
    assert lane.recv(65536) == b""
    lane.close()
    assert wait_for(lambda: stats(daemon.admin_target).job_lanes_open == 0)
    # A lane fd that is no SEQPACKET socket is refused with a clear status.
    r, w = os.pipe()
    token = send_fd(client.hello.fd_socket, client.session_id, r)  # type: ignore[union-attr]
    os.close(r)
    os.close(w)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.OpenJobLane(
            pb.OpenJobLaneRequest(session_id=client.session_id, fd_token=token), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "socket" in info.value.details()
    # Everyone else is served: a store and load over a new lane.
    geo = Geometry(world_size=1, namespace="lane-garbage")
    eng = lane_engine(client, geo)
    keys, blocks, idx = chunk_plan(geo, range(0, 2))
    assert eng.job(pb.STORE, keys, blocks, idx).success
    assert eng.job(pb.LOAD, keys, blocks, idx).success


def test_unread_lane_results_keep_the_daemon_bounded(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    c = DepotClient(d.target, client_name="unread").start()
    assert c.wait_connected(10)
    lane = raw_lane(c)
    time.sleep(0.5)
    before = rss_mib(d.proc.pid)
    total = 200_000
    sent = 0
    stuck_since = None
    try:
        while sent < total:  # until the daemon stops taking jobs (or all went)
            job = pb.TransferJob(
                job_id=sent + 1,
                registration_id=12345,  # each fails at once: a result each, never read
                session_id=c.session_id,
                keys=[make_key(sent, 0)],
                block_ids=[0],
                direction=pb.STORE,
            )
            try:
                lane.send(job.SerializeToString(), socket.MSG_DONTWAIT)
                sent += 1
                stuck_since = None
            except BlockingIOError:
                now = time.monotonic()
                stuck_since = stuck_since or now
                if now - stuck_since > 1.5:
                    break
                time.sleep(0.01)
        taken = stats(d.admin_target).lane_jobs
        grown = rss_mib(d.proc.pid) - before
        # The daemon stopped reading after a bounded number of unanswered results.
        assert sent < total and taken < 20_000, (sent, taken)
        assert grown < 10, f"RSS grew {grown:.1f} MiB with {taken} unread lane jobs"
        with grpc.insecure_channel(d.target) as ch:  # still answers others
            hc = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert hc.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        lane.close()
        c.close()
    assert wait_for(lambda: stats(d.admin_target).job_lanes_open == 0)


def test_daemon_shutdown_answers_lane_jobs_and_exits(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    c = DepotClient(d.target, client_name="shutdown").start()
    try:
        assert c.wait_connected(10)
        geo = Geometry(world_size=1, namespace="lane-shutdown")
        eng = lane_engine(c, geo)
        keys, blocks, idx = chunk_plan(geo, range(0, 20))
        assert eng.job(pb.STORE, keys, blocks, idx).success  # job 1: the loads find them
        ids = list(range(2, 102))
        for j in ids:
            eng.stream.submit(
                Job(
                    job_id=j,
                    direction=pb.STORE if j % 2 else pb.LOAD,
                    registration_id=eng.registration.registration_id,
                    keys=keys,
                    block_ids=[b for g in blocks for b in g],
                    group_sizes=[len(g) for g in blocks],
                    block_indices=idx,
                )
            )
        assert d.stop() == 0  # SIGTERM: a clean exit
        # Every job has an answer: done before the shutdown, refused, or UNAVAILABLE.
        assert eng.stream.wait(ids, timeout=20)
        results = eng.stream.poll()
        assert sorted(r.job_id for r in results) == ids
        assert all(r.success or r.error_code == "UNAVAILABLE" for r in results), [
            (r.error_code, r.error) for r in results if not r.success
        ]
    finally:
        c.close()


def test_no_lane_to_be_had_means_the_grpc_stream(daemon, client) -> None:
    # The session already has the most lanes a session may open: a new stream is
    # refused one (RESOURCE_EXHAUSTED) and its jobs go on the gRPC stream instead.
    held = [raw_lane(client) for _ in range(8)]
    try:
        token_sock, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        token = send_fd(client.hello.fd_socket, client.session_id, other.fileno())  # type: ignore[union-attr]
        other.close()
        with pytest.raises(grpc.RpcError) as info:
            client.stub.OpenJobLane(
                pb.OpenJobLaneRequest(session_id=client.session_id, fd_token=token), timeout=10
            )
        token_sock.close()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        geo = Geometry(world_size=1, namespace="lane-refused")
        eng = Engine(client, geo, 0)
        assert not eng.stream.uses_lane
        before = stats(daemon.admin_target).lane_jobs
        keys, blocks, idx = chunk_plan(geo, range(0, 3))
        for g, b in enumerate(blocks):
            eng.fill(g, keys[g * 3 : (g + 1) * 3], b, idx[g])
        assert eng.job(pb.STORE, keys, blocks, idx).success
        eng.mem[:] = 0
        assert eng.job(pb.LOAD, keys, blocks, idx).success
        for g, b in enumerate(blocks):
            assert eng.mismatches(g, keys[g * 3 : (g + 1) * 3], b, idx[g]) == 0
        assert stats(daemon.admin_target).lane_jobs == before
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: stats(daemon.admin_target).job_lanes_open == 0)


def test_a_job_too_large_for_a_datagram_goes_on_grpc(daemon, client) -> None:
    geo = Geometry(world_size=1, namespace="lane-large")
    eng = lane_engine(client, geo)
    before = stats(daemon.admin_target).lane_jobs
    # 120,000 keys (~5 MiB): more than a lane datagram, and than a job may name.
    keys = [make_key(i, 0) for i in range(120_000)]
    eng.stream.submit(
        Job(
            job_id=1,
            direction=pb.STORE,
            registration_id=eng.registration.registration_id,
            keys=keys,
            block_ids=list(range(len(keys))),
            group_sizes=[len(keys), 0],
            block_indices=[0, 0],
        )
    )
    assert eng.stream.wait({1}, timeout=30)
    (res,) = eng.stream.poll()
    # Larger than any legal job (bounds.max_job_bytes): refused unparsed, which ends
    # that stream (INVALID_ARGUMENT); the client's next job opens another.
    assert not res.success and "INVALID_ARGUMENT" in res.error, res
    assert stats(daemon.admin_target).lane_jobs == before  # it went on the gRPC stream
    assert eng.stream.uses_lane  # and the lane stays open for the next jobs
    eng._next_job = 2
    ks, blocks, idx = chunk_plan(geo, range(0, 2))
    assert eng.job(pb.STORE, ks, blocks, idx).success
    assert stats(daemon.admin_target).lane_jobs == before + 1


def test_a_stream_gets_its_lane_back_from_a_restarted_daemon(daemon, client) -> None:
    """The daemon killed and started again: the stream's lane broke with the session,
    and the stream's first job in the new session asks for a lane, which the next
    jobs take (kvdepot.common.lane_keeping's rules, kept by client/lane_keeper.py)."""
    geo = Geometry(world_size=1, namespace="lane-back")
    stream = lane_engine(client, geo).stream
    old_lane = stream._lanes.lane
    daemon.kill()
    wait_for(lambda: not client.connected and not stream.uses_lane, 10, "the lane to end")
    daemon.start()
    assert client.wait_connected(10)
    eng = Engine(client, geo, 0)  # registered in the new daemon
    eng.stream.close()
    eng.stream = stream  # the stream of before the restart, with no lane now
    keys, blocks, idx = chunk_plan(geo, range(0, 4))
    for g, b in enumerate(blocks):
        eng.fill(g, keys[g * 4 : (g + 1) * 4], b, idx[g])
    assert eng.job(pb.STORE, keys, blocks, idx).success  # on gRPC: it asked for a lane
    assert wait_for(lambda: stream.uses_lane, 10), "the lane did not come back"
    assert stream._lanes.lane is not old_lane
    before = stats(daemon.admin_target).lane_jobs
    eng.mem[:] = 0
    assert eng.job(pb.LOAD, keys, blocks, idx).success
    for g, b in enumerate(blocks):
        assert eng.mismatches(g, keys[g * 4 : (g + 1) * 4], b, idx[g]) == 0
    assert stats(daemon.admin_target).lane_jobs == before + 1
