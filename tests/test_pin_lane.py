"""Pin and unpin lanes against a real `kvdepot serve`: a scheduler's Pin and Unpin calls
as datagrams on Unix socket pairs (kvdepot.client.pin_lane; PinLane and UnpinLane in
kvdepot.server.service.job_lane).

Pins over the lane hold blocks exactly as gRPC's do, and Admin counts them; a pin
the daemon refuses closes the lane and gRPC gives the status; a garbage datagram
or another session's pin closes that lane only; a frozen daemon times the pin out
on its deadline and the lane comes back after; with lanes off, pins use gRPC.
Unpins over their lane drop one pin per key, as gRPC's do, in datagrams of a
bounded size; a refused one is logged and the lane goes on; a garbage datagram
closes it, and the keys it could not send come back to the caller (for gRPC).
A session that comes back gets its lanes back, even inside the back-off of an open
that failed while the daemon was away.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import time

import grpc
import pytest

from kvdepot.client import DepotClient, job_lane, pin_lane
from kvdepot.client.fdpass import send_fd
from kvdepot.client.pin_lane import PinLane, PinTimeout, UnpinLane
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import stats
from tests.support.engine import Engine, Geometry, make_key
from tests.support.ops import store

GEO = Geometry(world_size=1, namespace="pin-lane", groups=[[4096, 4096]], num_blocks=64)


def stored_keys(client: DepotClient, n: int) -> list[bytes]:
    eng = Engine(client, GEO, 0)
    store(eng, range(n))
    return [make_key(c, 0) for c in range(n)]


def test_unpins_sent_without_waiting_are_not_lost(daemon, client) -> None:
    """unpin(wait=False) returns at once; its call must still reach the daemon even
    though the caller keeps nothing of it (grpc cancels a call whose future is
    collected: the pins stayed held until the session ended)."""
    keys = stored_keys(client, 8)
    for round_ in range(20):
        assert client.pin(GEO.namespace, keys) == [True] * 8
        for key in keys:
            client.unpin(GEO.namespace, [key])  # wait=False: fire and forget
        gc.collect()  # what a busy process does at any time
        assert wait_for(lambda: stats(daemon.admin_target).pinned_blocks == 0, 10), round_


def open_lane(client: DepotClient) -> PinLane:
    lane = PinLane(client)
    lane.open_soon()
    assert wait_for(lambda: lane.open, 10), "the pin lane did not open"
    return lane


def test_pins_over_the_lane_hold_blocks_like_grpc_pins(daemon, client) -> None:
    keys = stored_keys(client, 6)
    lane = open_lane(client)
    before = stats(daemon.admin_target)
    absent = make_key(999, 0)
    assert lane.pin(client.session_id, GEO.namespace, [*keys[:4], absent], 1.0) == [
        True,
        True,
        True,
        True,
        False,
    ]
    assert lane.pin(client.session_id, GEO.namespace, keys[:2], 1.0) == [True, True]
    after = stats(daemon.admin_target)
    assert after.lane_pins - before.lane_pins == 2
    assert after.pin_calls - before.pin_calls == 2  # counted as pins too
    assert after.pinned_blocks == 4
    # Unpinned over gRPC, one pin per key per call: the blocks held twice stay.
    client.unpin(GEO.namespace, keys[:4], wait=True)
    assert stats(daemon.admin_target).pinned_blocks == 2
    client.unpin(GEO.namespace, keys[:2], wait=True)
    assert stats(daemon.admin_target).pinned_blocks == 0
    assert lane.lane_pins == 2


def test_a_refused_pin_closes_the_lane_and_grpc_says_why(daemon, client) -> None:
    lane = open_lane(client)
    first = lane.keeper.lane
    client.join("no-such-namespace")  # joined (an observer), but never declared: NOT_FOUND
    assert lane.pin(client.session_id, "no-such-namespace", [make_key(1, 0)], 1.0) is None
    # Dropped (a new lane may already be opening); gRPC answers with the status.
    assert lane.keeper.lane is not first
    with pytest.raises(grpc.RpcError) as err:
        client.pin("no-such-namespace", [make_key(1, 0)])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # It reopens in the background, and pins again.
    keys = stored_keys(client, 2)
    assert wait_for(lambda: lane.open, 10)
    assert lane.pin(client.session_id, GEO.namespace, keys, 1.0) == [True, True]


def raw_lane(client: DepotClient, kind: int = pb.LANE_PINS) -> socket.socket:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    assert client.hello is not None
    token = send_fd(client.hello.fd_socket, client.session_id, theirs.fileno())
    theirs.close()
    client.stub.OpenJobLane(
        pb.OpenJobLaneRequest(session_id=client.session_id, fd_token=token, kind=kind),
        timeout=10,
    )
    mine.settimeout(10)
    return mine


def send_bad_datagram(
    client: DepotClient, kind: int, request: type, what: str, keys: list[bytes]
) -> None:
    """On a fresh lane of `kind`: garbage, or a `request` for another session. The
    daemon must close that lane."""
    bad = raw_lane(client, kind)
    if what == "garbage":
        bad.send(b"\xff\xff\xff not a " + request.__name__.encode())
    else:
        data = request(session_id="someone-else", namespace_id=GEO.namespace, keys=keys)
        bad.send(data.SerializeToString())
    assert bad.recv(64) == b""  # closed by the daemon
    bad.close()


@pytest.mark.parametrize("what", ["garbage", "another session"])
def test_bad_datagrams_close_that_lane_only(daemon, client, what: str) -> None:
    keys = stored_keys(client, 2)
    good = open_lane(client)
    send_bad_datagram(client, pb.LANE_PINS, pb.PinRequest, what, keys)  # nothing pinned
    assert stats(daemon.admin_target).pinned_blocks == 0
    assert good.pin(client.session_id, GEO.namespace, keys, 1.0) == [True, True]
    assert "a pin was refused" in daemon.log()


def test_an_unknown_lane_kind_is_refused(daemon, client) -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    assert client.hello is not None
    token = send_fd(client.hello.fd_socket, client.session_id, theirs.fileno())
    theirs.close()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.OpenJobLane(
            pb.OpenJobLaneRequest(session_id=client.session_id, fd_token=token, kind=7),
            timeout=10,
        )
    mine.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown lane kind 7" in err.value.details()


def test_a_frozen_daemon_times_the_pin_out_and_the_lane_comes_back(daemon, client) -> None:
    keys = stored_keys(client, 2)
    lane = open_lane(client)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(PinTimeout):
            lane.pin(client.session_id, GEO.namespace, keys, 0.2)
        assert not lane.open  # its late answer can never be read as another call's
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: lane.open, 10), "the pin lane did not come back"
    assert lane.pin(client.session_id, GEO.namespace, keys, 1.0) == [True, True]


def test_lanes_off_keeps_pins_on_grpc(daemon, client, monkeypatch) -> None:
    monkeypatch.setenv("KVDEPOT_JOB_LANE", "0")
    lane = PinLane(client)
    lane.open_soon()
    assert lane.pin(client.session_id, GEO.namespace, [make_key(1, 0)], 1.0) is None
    assert not lane.open and stats(daemon.admin_target).job_lanes_open == 0


def test_an_answer_that_does_not_fit_the_call_drops_the_lane(daemon, client) -> None:
    """A reply that is not this call's (wrong length, or not a PinResponse) is never
    handed to the scheduler: the caller gets None and asks over gRPC."""
    keys = stored_keys(client, 2)
    lane = open_lane(client)
    inner = lane.keeper.lane
    assert inner is not None
    # Play a daemon that answers with something else: swap in a socket pair whose
    # other end the test holds.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    inner.sock, original = mine, inner.sock
    try:
        theirs.send(b"\x0a\x01\x01")  # a PinResponse of one key, for a call of two
        assert lane.pin(client.session_id, GEO.namespace, keys, 1.0) is None
        assert lane.keeper.lane is not inner  # dropped (a new one may already be opening)
    finally:
        original.close()
        theirs.close()
    assert wait_for(lambda: lane.open, 10)
    assert lane.pin(client.session_id, GEO.namespace, keys, 1.0) == [True, True]


# -- unpin lanes ------------------------------------------------------------------------


def open_unpin_lane(client: DepotClient) -> UnpinLane:
    lane = UnpinLane(client)
    lane.open_soon()
    assert wait_for(lambda: lane.open, 10), "the unpin lane did not open"
    return lane


def test_unpins_over_the_lane_drop_one_pin_per_key(daemon, client, monkeypatch) -> None:
    keys = stored_keys(client, 5)
    # Held twice (two requests loading them) and once: an unpin drops one pin each.
    assert client.pin(GEO.namespace, keys) == [True] * 5
    assert client.pin(GEO.namespace, keys[:2]) == [True] * 2
    lane = open_unpin_lane(client)
    before = stats(daemon.admin_target)
    monkeypatch.setattr(pin_lane, "UNPIN_KEYS_PER_DATAGRAM", 2)
    assert lane.unpin(client.session_id, GEO.namespace, keys) == ()
    assert lane.lane_unpins == 3  # 2 + 2 + 1 keys
    assert wait_for(lambda: stats(daemon.admin_target).pinned_blocks == 2, 10)
    assert lane.unpin(client.session_id, GEO.namespace, keys[:2]) == ()
    assert wait_for(lambda: stats(daemon.admin_target).pinned_blocks == 0, 10)
    assert stats(daemon.admin_target).lane_unpins - before.lane_unpins == 4


def test_a_refused_unpin_is_logged_and_the_lane_goes_on(daemon, client) -> None:
    keys = stored_keys(client, 2)
    assert client.pin(GEO.namespace, keys) == [True, True]
    lane = open_unpin_lane(client)
    client.join("no-such-namespace")  # joined (an observer), but never declared: NOT_FOUND
    assert lane.unpin(client.session_id, "no-such-namespace", keys) == ()
    # The unpin behind the refused one is applied: nothing queued is lost.
    assert lane.unpin(client.session_id, GEO.namespace, keys) == ()
    assert wait_for(lambda: stats(daemon.admin_target).pinned_blocks == 0, 10)
    assert lane.open
    assert wait_for(lambda: "an unpin of 2 keys was refused" in daemon.log(), 10)


@pytest.mark.parametrize("what", ["garbage", "another session"])
def test_a_bad_unpin_datagram_closes_that_lane_and_the_keys_come_back(
    daemon, client, what: str
) -> None:
    keys = stored_keys(client, 2)
    assert client.pin(GEO.namespace, keys) == [True, True]
    send_bad_datagram(client, pb.LANE_UNPINS, pb.UnpinRequest, what, keys)  # nothing unpinned
    assert stats(daemon.admin_target).pinned_blocks == 2
    # A client whose lane the daemon closed gets its keys back, for gRPC.
    lane = open_unpin_lane(client)
    inner = lane.keeper.lane
    assert inner is not None
    inner.sock.shutdown(socket.SHUT_RDWR)
    assert list(lane.unpin(client.session_id, GEO.namespace, keys)) == keys
    assert lane.keeper.lane is not inner  # dropped (a new one may already be opening)
    client.unpin(GEO.namespace, keys, wait=True)
    assert stats(daemon.admin_target).pinned_blocks == 0


def test_lanes_off_keeps_unpins_on_grpc(daemon, client, monkeypatch) -> None:
    monkeypatch.setenv("KVDEPOT_JOB_LANE", "0")
    lane = UnpinLane(client)
    keys = [make_key(1, 0)]
    assert lane.unpin(client.session_id, GEO.namespace, keys) == keys
    assert not lane.open


@pytest.mark.parametrize("when", ["daemon paused while they are sent", "lane closed before"])
def test_pipelined_pins_stop_at_a_refused_one_and_the_rest_go_over_grpc(
    daemon, client, when: str
) -> None:
    """Pins sent one after another are answered in order; when the daemon refuses one
    it closes the lane and pins none of the calls behind it: `answers` gives the keys
    answered before it, and those after it may be pinned over gRPC without doubling.
    Whether the last call reached the daemon before it closed the lane (it then finds
    a call unread, and the kernel reports a reset) or found the lane closed already,
    the answers sent before are read, also once the lane is closed."""
    keys = stored_keys(client, 4)
    lane = open_lane(client)
    first = lane.keeper.lane
    sid = client.session_id
    client.join("no-such-namespace")  # joined (an observer), but never declared: NOT_FOUND
    if when == "daemon paused while they are sent":
        os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        assert lane.send(sid, GEO.namespace, keys[:2])
        assert lane.send(sid, "no-such-namespace", keys[2:3])
        if when == "lane closed before":
            assert wait_for(lambda: "a pin was refused" in daemon.log(), 10)
            assert not lane.send(sid, GEO.namespace, keys[3:])  # the lane is closed
        else:
            assert lane.send(sid, GEO.namespace, keys[3:])
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # Read only once the daemon has closed the lane: the harder case.
    assert wait_for(lambda: "a pin was refused" in daemon.log(), 10)
    assert lane.answers(1.0) == [True, True]
    # That lane is gone (a new one may already be opening or open in the background).
    assert lane.keeper.lane is not first
    assert (
        stats(daemon.admin_target).pinned_blocks == 2
    )  # the call behind the refused one: not pinned
    assert client.pin(GEO.namespace, keys[3:]) == [True]
    client.unpin(GEO.namespace, [*keys[:2], keys[3]], wait=True)
    assert stats(daemon.admin_target).pinned_blocks == 0
    assert lane.answers(1.0) == []  # nothing owed


def test_a_lane_that_opens_as_its_client_closes_gives_up_quietly(daemon, client) -> None:
    """A lane opens on a thread of its own. When the engine closes its client between
    the lane's fd reaching the daemon and the OpenJobLane call, the open ends as 'no
    lane, for good' (a LaneUnavailable, which the opening thread handles) instead of
    grpc's ValueError escaping as a thread's traceback in the engine's log. Here the
    fd goes for a live session (another client's) over the closed client."""
    live = DepotClient(daemon.target, client_name="pytest-live").start()
    try:
        assert live.wait_connected(10)
        client.close()
        with pytest.raises(job_lane.LaneUnavailable, match="client is closed") as exc:
            job_lane.ClientLane.open(client, live.session_id, kind=pb.LANE_UNPINS)
        assert exc.value.permanent
        open_unpin_lane(live)  # the daemon serves the live client's lane as before
    finally:
        live.close()


def test_keys_encoded_once_make_the_same_call_as_a_whole_pin_request() -> None:
    """A step's keys go to every shard encoded once (kvdepot.client.vllm.pins): the
    daemon reads header + keys as the very PinRequest a whole message would be."""
    keys = [i.to_bytes(36, "big") for i in range(300)]
    header = pb.PinRequest(session_id="s" * 32, namespace_id="ns-shard-3")
    whole = pb.PinRequest(session_id="s" * 32, namespace_id="ns-shard-3", keys=keys)
    data = header.SerializeToString() + pin_lane.encode_pin_keys(keys)
    assert pb.PinRequest.FromString(data) == whole
    assert data == whole.SerializeToString()  # byte for byte: fields go in number order


def test_a_session_back_inside_the_back_off_gets_its_lane_back(daemon, client) -> None:
    """A lane's open fails (as one does while the daemon goes away; here the session
    has the most lanes it may open), which starts the back-off; the daemon is killed
    and restarted, the session comes back inside the back-off, and the lane opens at
    its end with no call asking again (as a vLLM scheduler's unpin lane, asked for
    only when a session starts and when an unpin finds none)."""
    retry_s = 8.0
    lane = UnpinLane(client, retry_s=retry_s)
    held = []
    with pytest.raises(grpc.RpcError) as refused:  # the session's lanes, up to the most
        while len(held) < 9:
            held.append(raw_lane(client, pb.LANE_UNPINS))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    lane.open_soon()  # refused: RESOURCE_EXHAUSTED, so the back-off starts
    wait_for(lambda: not lane.keeper.keeping.opening, 10, "the open to fail")
    failed_at = time.monotonic()
    assert not lane.open
    client.add_session_listener(lambda _session: lane.open_soon())  # runs now: deferred
    client.add_disconnect_listener(lane.drop)
    daemon.kill()
    for sock in held:
        sock.close()
    wait_for(lambda: not client.connected, 10, "the session to end")
    daemon.start()
    assert client.wait_connected(10)
    assert time.monotonic() - failed_at < retry_s - 1, "back after the back-off: no test"
    assert not lane.open  # the new session's request waits for the back-off's end
    assert wait_for(lambda: lane.open, retry_s + 5), "the unpin lane did not come back"
    assert time.monotonic() - failed_at >= retry_s - 0.5
    keys = stored_keys(client, 2)  # in the new daemon
    assert client.pin(GEO.namespace, keys) == [True, True]
    assert lane.unpin(client.session_id, GEO.namespace, keys) == ()
    wait_for(lambda: stats(daemon.admin_target).pinned_blocks == 0, 10, "the unpins")
