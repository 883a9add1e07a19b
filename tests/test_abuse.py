"""Clients that misbehave at scale, against a real `kvdepot serve`: many sessions at
once, a Transfer stream whose results are never read, garbage and malformed HTTP/2
on both sockets, and fds that are not memfds. The daemon stays bounded (sessions,
memory, fds) and keeps answering everyone else."""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import struct
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.client import DepotClient, SharedKVBuffer, session_stub
from kvdepot.client.fdpass import FdPassError, encode, send_fd
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import connect, stats
from tests.support.engine import make_key
from tests.support.faults import open_fds, rss_mib

Code = grpc.StatusCode


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_many_concurrent_sessions_are_bounded_and_released(daemon_factory) -> None:
    # Sessions nobody attested share a pool (--max-unattested-sessions, 32): the 257th
    # open makes room by ending the oldest, with a status that says why; every one is
    # released when its client goes. (tests/security/test_identity.py: no lock-out.)
    d = daemon_factory("--pool-size", "16MiB")
    ch = grpc.insecure_channel(d.target)
    stub = session_stub(ch)
    streams = []
    try:
        for i in range(257):
            s = stub.Session(pb.SessionRequest(client_name=f"s{i}", pid=i))
            assert next(s).hello.session_id
            streams.append(s)
        assert stats(d.admin_target).sessions == 32
        with pytest.raises(grpc.RpcError) as info:
            next(streams[0])
        assert info.value.code() == Code.RESOURCE_EXHAUSTED
        assert "make room" in info.value.details()
    finally:
        for s in streams:
            s.cancel()
        ch.close()
    assert wait_for(lambda: stats(d.admin_target).sessions == 0), stats(d.admin_target).sessions
    c = DepotClient(d.target, client_name="after").start()
    assert c.wait_connected(10)
    c.close()


def test_unread_transfer_results_keep_memory_bounded(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    c = DepotClient(d.target, client_name="unread").start()
    assert c.wait_connected(10)
    time.sleep(0.5)
    before = rss_mib(d.proc.pid)
    sent = [0]

    def jobs():
        for i in range(60_000):  # each fails at once (no such registration): a result each
            sent[0] += 1
            yield pb.TransferJob(
                job_id=i + 1,
                registration_id=12345,
                session_id=c.session_id,
                keys=[make_key(i, 0)],
                block_ids=[0],
                direction=1,
            )

    ch = grpc.insecure_channel(d.target)
    call = session_stub(ch).Transfer(jobs())  # results never read
    try:
        last = -1
        while sent[0] != last:  # until the client can send no more (or sent them all)
            last = sent[0]
            time.sleep(1.0)
        grown = rss_mib(d.proc.pid) - before
        # Before: every result was queued in the daemon (60k jobs: +17 MiB here).
        assert grown < 10, f"RSS grew {grown:.1f} MiB with {sent[0]} unread jobs"
        assert serving(d.target)  # still answers others
    finally:
        call.cancel()
        ch.close()
        c.close()


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def send_and_drain(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while select.select([s], [], [], 5)[0] and s.recv(65536):
                pass
        except OSError:
            pass  # the daemon may close on us: that is a fine answer


def connected_client(target: str, name: str) -> DepotClient:
    """A client with both of its connections open (its streams' and its calls'), so
    that a baseline of the daemon's fds taken now counts them."""
    c = connect(target, name, engine_id="")
    # Any unary call opens the calls' connection; its answer does not matter here. (Admin
    # would not do: it is on the operator socket, another connection.)
    with contextlib.suppress(grpc.RpcError):
        c.lookup("warm-up", [b"k"], timeout=10)
    return c


def test_garbage_and_malformed_http2_on_both_sockets(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    c = connected_client(d.target, "garbage")
    fd_socket = c.hello.fd_socket
    rng = random.Random(12)
    baseline = open_fds(d.proc.pid)
    garbage = [
        rng.randbytes(4096),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        H2_PREFACE + rng.randbytes(1000),
        H2_PREFACE + h2_frame(4, 0, 0, b"\x00" * 5),  # SETTINGS of a bad length
        H2_PREFACE + h2_frame(4, 0, 0, b"") + h2_frame(1, 4, 2, rng.randbytes(64)),  # even id
        H2_PREFACE + h2_frame(4, 0, 0, b"") + h2_frame(0, 1, 1, b"x" * 100),  # DATA, no HEADERS
        H2_PREFACE + h2_frame(4, 0, 0, b"") + h2_frame(8, 0, 0, b"\x7f\xff\xff\xff"),
        H2_PREFACE + b"\x00\xff\xff\x01\x04\x00\x00\x00\x01",  # HEADERS longer than sent
        b"\xff\xff\xff\xff" + b"x" * 100,  # fd socket: a 4 GiB length
        encode({"session_id": c.session_id})[:6],  # cut short
        b"\x00\x00\x00\x05notjs",
        encode({"session_id": 7}),
    ]
    for path in (d.socket_path, fd_socket):
        for data in garbage:
            send_and_drain(path, data)
            assert serving(d.target)
    # Everyone else is served, and the connections left nothing open.
    buf = SharedKVBuffer.allocate(1 << 16)
    assert send_fd(fd_socket, c.session_id, buf.fd)
    buf.close()
    assert wait_for(lambda: open_fds(d.proc.pid) <= baseline + 2), open_fds(d.proc.pid)
    c.close()


def non_memfd_fds(tmp: Path) -> dict[str, int]:
    """Ten kinds of fd that are not a sealable memfd of the right size."""
    r, w = os.pipe()
    a, b = socket.socketpair()
    (tmp / "plain").write_bytes(b"\0" * 65536)
    small = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(small, 4096)
    unsealable = os.memfd_create("unsealable", os.MFD_CLOEXEC)
    os.ftruncate(unsealable, 65536)
    fds = {
        "pipe read end": r,
        "pipe write end": w,
        "socket": a.detach(),
        "regular file": os.open(tmp / "plain", os.O_RDWR),
        "directory": os.open(tmp, os.O_RDONLY | os.O_DIRECTORY),
        "/dev/null": os.open("/dev/null", os.O_RDWR),
        "eventfd": os.eventfd(0),
        "pidfd": os.pidfd_open(os.getpid()),
        "memfd smaller than registered": small,
        "memfd without sealing": unsealable,
    }
    b.close()
    return fds


def test_ten_kinds_of_non_memfd_fds_are_refused_without_leaks(daemon_factory, tmp_path) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    c = connected_client(d.target, "fds")
    layout = pb.NamespaceLayout(
        id="fds", world_size=1, blocks_per_chunk=1, groups=[pb.GroupLayout(layer_page_bytes=[4096])]
    )
    tensor = pb.KVTensor(
        region_index=0, region_offset=0, num_blocks=16, block_stride_bytes=4096, page_bytes=4096
    )
    refs = pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])
    baseline = open_fds(d.proc.pid)
    fds = non_memfd_fds(tmp_path)
    for kind, fd in fds.items():
        try:
            token = send_fd(c.hello.fd_socket, c.session_id, fd)
        except FdPassError:
            continue  # refused at the fd socket: fine
        region = pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token=token, size=65536))
        with pytest.raises(grpc.RpcError) as info:
            c.stub.RegisterKV(
                pb.RegisterKVRequest(
                    session_id=c.session_id,
                    namespace=layout,
                    regions=[region],
                    tensors=[tensor],
                    groups=[refs],
                ),
                timeout=10,
            )
        assert info.value.code() == Code.INVALID_ARGUMENT, (kind, info.value.details())
        assert "Traceback" not in info.value.details()
    for fd in fds.values():
        os.close(fd)
    # None of them stayed open in the daemon, and a real memfd still registers.
    assert wait_for(lambda: open_fds(d.proc.pid) <= baseline), (open_fds(d.proc.pid), baseline)
    buf = SharedKVBuffer.allocate(65536)
    reg = c.register_kv(layout, 0, buf, [tensor], [refs])
    assert reg.registration_id
    buf.close()
    c.close()


def test_unread_watch_streams_stay_bounded_however_many_stores(daemon_factory) -> None:
    # 10 Watch streams nobody reads, over 4096-key store jobs into a 16 MiB pool (every
    # store past the first 4096 evicts one). What the streams hold must not grow with
    # the number of stores: a lagging watcher is resynced, not queued without end.
    from tests.support.engine import Engine, Geometry

    d = daemon_factory("--pool-size", "16MiB")
    c = DepotClient(d.target, client_name="watched").start()
    assert c.wait_connected(10)
    geo = Geometry(
        groups=[[4096]], blocks_per_chunk=1, world_size=1, num_blocks=4096, namespace="w"
    )
    eng = Engine(c, geo, 0)
    ch = grpc.insecure_channel(d.target)
    calls = [
        session_stub(ch).Watch(pb.WatchRequest(session_id=c.session_id, namespace_id="w"))
        for _ in range(10)
    ]

    def store(jobs: range) -> None:
        for j in jobs:
            keys = [make_key(i, 0, salt=b"%d" % j) for i in range(4096)]
            assert eng.job(pb.STORE, keys, [list(range(4096))], [0]).success

    try:
        store(range(24))  # 98,304 stores: past every bound (the watch queues are full)
        middle = rss_mib(d.proc.pid)
        store(range(24, 48))  # as many again
        grown = rss_mib(d.proc.pid) - middle
        assert grown < 8, f"RSS grew {grown:.1f} MiB over the second 98,304 stores"
        assert serving(d.target)
    finally:
        for call in calls:
            call.cancel()
        ch.close()
        c.close()
