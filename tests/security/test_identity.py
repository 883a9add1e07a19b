"""Kernel identity, never a message (docs/security.md, "Identity").

Every attack runs against a real `kvdepot serve` with real processes: an unrelated
victim holding a secret behind a listening Unix socket, a second process holding a
stolen session id, a process opening sessions in a loop. Each asserts the attack
fails with a clear status, and that the legitimate path beside it still moves the
same bytes out as in.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from kvdepot.client import DepotClient, session_stub
from kvdepot.client.fdpass import FdPassError, attest, send_fd
from kvdepot.client.pvm import register_process_kv, send_identity
from kvdepot.server import errors
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.memory.copy_engine import LOAD, STORE, CpuCopyEngine, MappedRegion
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, connect, stats
from tests.support.engine import Engine, Geometry, chunk_plan

pytestmark = pytest.mark.timeout(180)

GEO = Geometry(world_size=1, namespace="identity", num_blocks=16, groups=[[4096]])
SECRET = b"victim-secret-" * 293  # 4102 bytes: spans two pages


def round_trip(client: DepotClient, memory: str, salt: bytes) -> int:
    """Stores two chunks from `memory` ("shm"/"pvm"), wipes it, loads them back;
    returns the pages whose bytes differ (0: byte-exact)."""
    eng = Engine(client, GEO, 0, memory)
    keys, blocks, idx = chunk_plan(GEO, range(2), salt=salt)
    eng.fill(0, keys, blocks[0], idx[0])
    stored = eng.job(STORE, keys, blocks, idx)
    assert stored.success, stored.error
    eng.mem[:] = 0
    loaded = eng.job(LOAD, keys, blocks, idx)
    assert loaded.success, loaded.error
    return eng.mismatches(0, keys, blocks[0], idx[0])


def raw_session(d: DaemonProcess, claimed_pid: int) -> tuple[grpc.Channel, object, pb.SessionHello]:
    """A Session opened by hand, claiming any pid (what a hostile client can do)."""
    ch = d.channel()
    call = session_stub(ch).Session(pb.SessionRequest(client_name="x", pid=claimed_pid))
    return ch, call, next(iter(call)).hello


def register_pvm(
    ch: grpc.Channel, session_id: str, pid: int, address: int, size: int, token: str
) -> pb.RegisterKVResponse:
    page = 4096
    return session_stub(ch).RegisterKV(
        pb.RegisterKVRequest(
            session_id=session_id,
            namespace=Geometry(
                world_size=1, namespace="stolen", num_blocks=1, groups=[[page]]
            ).layout(),
            rank=0,
            regions=[
                pb.MemoryRegion(
                    pvm=pb.ProcessMemory(pid=pid, address=address, size=size, pid_token=token)
                )
            ],
            tensors=[
                pb.KVTensor(region_index=0, num_blocks=1, block_stride_bytes=page, page_bytes=page)
            ],
            groups=[pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=page)])],
        ),
        timeout=10,
    )


VICTIM = textwrap.dedent(
    """
    import ctypes, json, mmap, socket, sys
    secret = sys.argv[2].encode()
    buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)          # private anonymous: no fd to steal
    buf[: len(secret)] = secret
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[1])
    listener.listen(8)
    print(json.dumps({"pid": __import__("os").getpid(), "address": address,
                      "size": len(buf)}), flush=True)
    sys.stdin.read()                                  # until the test is done
    print(buf[: len(secret)].decode(), flush=True)
    """
)


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[tuple[dict, str, subprocess.Popen[str]]]:
    """An unrelated process: a secret in private memory, a listening Unix socket."""
    path = str(tmp_path / "victim.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, path, SECRET.decode()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    info = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    try:
        yield info, path, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def secret_after(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate("", timeout=10)
    return out.strip()


def refused(exc: pytest.ExceptionInfo[grpc.RpcError], code: grpc.StatusCode, *words: str) -> None:
    assert exc.value.code() == code, exc.value.details()
    for w in words:
        assert w in exc.value.details(), exc.value.details()


# -- item 1: pvm copies only the process that sent its own socketpair ---------------------


def test_pvm_with_a_socket_connected_to_a_victim_is_refused_and_own_pvm_works(
    daemon_factory, victim
) -> None:
    d = daemon_factory("--pool-size", "64MiB", "--pvm")
    info, path, proc = victim
    ch, call, hello = raw_session(d, claimed_pid=info["pid"])  # the lie is ignored
    try:
        for claimed in (info["pid"], 0):
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(path)  # SO_PEERCRED of this socket names the victim
            token = send_fd(hello.fd_socket, hello.session_id, conn.fileno())
            conn.close()
            with pytest.raises(grpc.RpcError) as exc:
                register_pvm(ch, hello.session_id, claimed, info["address"], info["size"], token)
            refused(exc, grpc.StatusCode.PERMISSION_DENIED, "connected to a listener")
        # The victim's socketpair would do no better: its creator is not the sender.
        with pytest.raises(grpc.RpcError) as exc:
            mine = send_identity(hello.fd_socket, hello.session_id).pid_token
            register_pvm(ch, hello.session_id, info["pid"], info["address"], info["size"], mine)
        refused(exc, grpc.StatusCode.PERMISSION_DENIED, "register only its own memory")
    finally:
        call.cancel()  # type: ignore[attr-defined]
        ch.close()
    assert stats(d).registrations == 0 and stats(d).permission_denied >= 3
    assert secret_after(proc) == SECRET.decode()  # nothing was written either
    # Beside it, this process's own pvm registration stores and loads byte-exact.
    client = connect(d, "own pvm")
    try:
        assert round_trip(client, "pvm", b"own") == 0
    finally:
        client.close()


def test_pvm_with_a_socket_connected_to_the_daemon_is_refused(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB", "--pvm")
    ch, call, hello = raw_session(d, claimed_pid=d.proc.pid)  # type: ignore[union-attr]
    try:
        for target in (d.socket_path, hello.fd_socket):  # its gRPC and fd sockets
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(target)  # names the daemon itself
            token = send_fd(hello.fd_socket, hello.session_id, conn.fileno())
            conn.close()
            with pytest.raises(grpc.RpcError) as exc:
                register_pvm(ch, hello.session_id, 0, 0x10000, 1 << 20, token)
            refused(exc, grpc.StatusCode.PERMISSION_DENIED, "connected to a listener")
    finally:
        call.cancel()  # type: ignore[attr-defined]
        ch.close()
    assert stats(d).registrations == 0
    assert d.proc.poll() is None  # type: ignore[union-attr]


def test_pvm_is_off_unless_the_operator_enables_it(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    client = connect(d, "pvm wanted")
    try:
        kv = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(grpc.RpcError) as exc:
            register_process_kv(
                client,
                Geometry(world_size=1, namespace="off", num_blocks=1, groups=[[4096]]).layout(),
                0,
                [(kv.ctypes.data, kv.nbytes)],
                [
                    pb.KVTensor(
                        region_index=0, num_blocks=1, block_stride_bytes=4096, page_bytes=4096
                    )
                ],
                [pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])],
            )
        refused(exc, grpc.StatusCode.FAILED_PRECONDITION, "--pvm", "KVDEPOT_PVM=1")
        assert round_trip(client, "shm", b"off") == 0  # shared memory is unaffected
    finally:
        client.close()


# -- item 2: a session belongs to the process that opened it -----------------------------

THIEF = textwrap.dedent(
    """
    import json, os, socket, sys
    import grpc
    from kvdepot.client.fdpass import FdPassError, attest, send_fd
    from kvdepot.client import session_stub
    from kvdepot.client.pvm import send_identity
    from kvdepot.v1 import depot_pb2 as pb, depot_pb2_grpc
    target, fd_socket, stolen = sys.argv[1:4]
    out = {}
    memfd = os.memfd_create("thief")
    os.ftruncate(memfd, 4096)
    for name, call in (("fd", lambda: send_fd(fd_socket, stolen, memfd)),
                       ("attest", lambda: attest(fd_socket, stolen))):
        try:
            call(); out[name] = "accepted"
        except FdPassError as exc:
            out[name] = [exc.code, str(exc)]
    ch = grpc.insecure_channel(target)
    stub = session_stub(ch)
    own = stub.Session(pb.SessionRequest(client_name="thief"))
    mine = next(own).hello.session_id
    lane, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    token = send_fd(fd_socket, mine, theirs.fileno())        # a lane of its own session...
    try:                                                     # ...opened on the stolen one
        stub.OpenJobLane(pb.OpenJobLaneRequest(session_id=stolen, fd_token=token), timeout=5)
        out["lane"] = "accepted"
    except grpc.RpcError as exc:
        out["lane"] = [exc.code().name, exc.details()]
    pid_token = send_identity(fd_socket, mine).pid_token
    try:
        stub.RegisterKV(pb.RegisterKVRequest(session_id=stolen, namespace=pb.NamespaceLayout(
            id="t", world_size=1, blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[4096])]), rank=0,
            regions=[pb.MemoryRegion(pvm=pb.ProcessMemory(address=4096, size=4096,
                                                          pid_token=pid_token))]), timeout=5)
        out["pvm"] = "accepted"
    except grpc.RpcError as exc:
        out["pvm"] = [exc.code().name, exc.details()]
    own.cancel()
    print(json.dumps(out), flush=True)
    """
)


def test_another_process_presenting_a_session_id_is_denied_and_counted(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB", "--pvm")
    owner = connect(d, "owner")
    try:
        before = stats(d).permission_denied
        out = subprocess.run(
            [sys.executable, "-c", THIEF, d.target, owner.hello.fd_socket, owner.session_id],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["fd"][0] == "PERMISSION_DENIED" and "another process" in got["fd"][1], got
        assert got["attest"][0] == "PERMISSION_DENIED", got
        assert got["lane"][0] == "PERMISSION_DENIED" and "another session" in got["lane"][1]
        assert got["pvm"][0] == "PERMISSION_DENIED", got
        assert stats(d).permission_denied >= before + 4
        # The owner's session, lane and memory are untouched, and still work.
        stream_lane = owner.transfer_stream()
        assert stream_lane.uses_lane
        stream_lane.close()
        assert round_trip(owner, "shm", b"owner") == 0
        assert owner.sessions_opened == 1
    finally:
        owner.close()


LANE_MAKER = textwrap.dedent(
    """
    import socket, sys
    chan = socket.socket(fileno=int(sys.argv[1]))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    socket.send_fds(chan, [b"lane"], [b.fileno()])
    chan.recv(1)
    """
)


def test_a_lane_made_by_another_process_is_refused(daemon_factory) -> None:
    """The owner itself passes a socketpair another process made: the lane would
    answer that process, so it is refused."""
    d = daemon_factory("--pool-size", "64MiB")
    owner = connect(d, "owner")
    here, there = socket.socketpair()
    maker = subprocess.Popen(
        [sys.executable, "-c", LANE_MAKER, str(there.fileno())], pass_fds=[there.fileno()]
    )
    try:
        _, (fd,), _, _ = socket.recv_fds(here, 16, 1)
        token = send_fd(owner.hello.fd_socket, owner.session_id, fd)
        os.close(fd)
        with pytest.raises(grpc.RpcError) as exc:
            owner.stub.OpenJobLane(
                pb.OpenJobLaneRequest(session_id=owner.session_id, fd_token=token), timeout=5
            )
        refused(exc, grpc.StatusCode.PERMISSION_DENIED, f"pid {maker.pid}")
        assert round_trip(owner, "shm", b"lane") == 0
    finally:
        here.send(b"x")
        maker.wait(10)
        owner.close()


FLOOD = textwrap.dedent(
    """
    import sys, time
    import grpc
    from kvdepot.v1 import depot_pb2 as pb, depot_pb2_grpc
    ch = grpc.insecure_channel(sys.argv[1])
    stub = depot_pb2_grpc.DepotStub(ch)
    calls, ended = [], 0
    for i in range(int(sys.argv[2])):
        call = stub.Session(pb.SessionRequest(client_name=f"flood{i}"))
        try:
            next(call)
        except grpc.RpcError as exc:
            print("REFUSED", exc.code().name, exc.details(), flush=True)
            sys.exit(1)
        calls.append(call)
    print("OPENED", len(calls), flush=True)
    sys.stdin.read()
    """
)


def test_a_process_opening_sessions_in_a_loop_locks_no_one_out(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, d.target, "300"],  # more than --max-sessions (256)
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        line = flood.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("OPENED 300"), line  # never refused: the oldest made room
        assert stats(d).sessions <= 32  # --max-unattested-sessions
        engine = connect(d, "engine")
        try:
            assert round_trip(engine, "shm", b"flood") == 0
            assert engine.sessions_opened == 1
        finally:
            engine.close()
    finally:
        flood.kill()
        flood.wait(10)


def test_sessions_per_process_are_limited(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB", "--max-sessions-per-pid", "3")
    calls, ch = [], d.channel()
    try:
        stub = session_stub(ch)
        for i in range(4):
            call = stub.Session(pb.SessionRequest(client_name=f"s{i}"))
            hello = next(call).hello
            calls.append(call)
            if i < 3:
                assert attest(hello.fd_socket, hello.session_id) == os.getpid()
        with pytest.raises(FdPassError) as exc:
            attest(hello.fd_socket, hello.session_id)
        assert exc.value.code == "RESOURCE_EXHAUSTED"
        assert "--max-sessions-per-pid" in str(exc.value)
        with pytest.raises(grpc.RpcError) as ended:  # the daemon ended the 4th session
            next(calls[-1])
        refused(ended, grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-sessions-per-pid")
    finally:
        for c in calls:
            c.cancel()
        ch.close()


def test_session_ids_are_secrets_shown_as_tags(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    client = connect(d, "tagged")
    try:
        sid = client.session_id
        assert len(sid) == 32 and int(sid, 16) >= 0  # 128 random bits
        with d.admin_channel() as ch:
            engines = (
                admin_pb2_grpc.AdminStub(ch)
                .ListEngines(admin_pb2.ListEnginesRequest(), timeout=5)
                .engines
            )
        assert [e.session_id for e in engines] == [sid[:8]]
        assert engines[0].pid == os.getpid()  # the kernel's word (attested)
    finally:
        client.close()
    # Once the daemon has ended the session, everything it logged about it is written.
    wait_for(lambda: stats(d).sessions == 0, what="the session's end")
    assert sid not in d.log() and sid[:8] in d.log()


# -- item 6: a memfd is charged to its owner; the daemon maps only what it may write ------


def test_sparse_unwritable_and_device_fds_are_refused(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    client = connect(d, "memfds")
    layout = GEO.layout()
    tensors = [pb.KVTensor(region_index=0, num_blocks=1, block_stride_bytes=4096, page_bytes=4096)]
    refs = [pb.GroupRefs(layers=[pb.LayerRef(tensor_index=0, page_bytes=4096)])]
    sparse = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
    os.ftruncate(sparse, 1 << 20)
    readonly = os.open(f"/proc/self/fd/{sparse}", os.O_RDONLY)
    device = os.open("/dev/zero", os.O_RDWR)
    try:
        for fd, words in (
            (sparse, "populate it first"),
            (readonly, "O_RDWR"),
            (device, "not a memfd"),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                client.register_kv(layout, 0, SimpleNamespace(fd=fd, size=1 << 20), tensors, refs)
            refused(exc, grpc.StatusCode.INVALID_ARGUMENT, words)
        assert os.fstat(sparse).st_blocks == 0  # the daemon allocated nothing
        os.posix_fallocate(sparse, 0, 1 << 20)  # populated: accepted
        client.register_kv(layout, 0, SimpleNamespace(fd=sparse, size=1 << 20), tensors, refs)
        assert round_trip(client, "shm", b"memfd") == 0
    finally:
        for fd in (sparse, readonly, device):
            os.close(fd)
        client.close()


# -- item 10: every run inside its region and the pool -----------------------------------


class _Buffer(MappedRegion):
    kind = "test"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.address = array.ctypes.data
        self.size = array.nbytes

    def close(self) -> None:
        pass


def test_copy_engine_refuses_runs_outside_the_region_or_pool(planner_impl: str) -> None:
    region = _Buffer(np.arange(8192, dtype=np.uint8) % 251)
    pool = np.zeros(16384, dtype=np.uint8)
    engine = CpuCopyEngine()
    for runs in (
        [(0, 4096, 0, 4097)],  # one byte past the region
        [(0, 0, 16000, 4096)],  # past the pool
        [(0, 0, 0, 4096), (0, (1 << 63) - 10, 0, 20)],  # offset + size overflows int64
        [(0, 0, (1 << 63) - 10, 20)],  # pool offset + size overflows int64
        [(1, 0, 0, 16)],  # a region the registration does not have
        [(0, 0, 0, 0)],  # a run that moves nothing
        [(0, -1, 0, 16)],  # a negative offset
    ):
        with pytest.raises(errors.DepotError) as exc:
            engine.prepare(STORE, [region], pool.ctypes.data, CopyPlan(runs), pool.nbytes)
        assert exc.value.code is errors.Code.INVALID_ARGUMENT
    assert not pool.any()  # nothing moved
    engine.copy(STORE, [region], pool.ctypes.data, CopyPlan([(0, 4096, 8192, 4096)]), pool.nbytes)
    assert (pool[8192:12288] == region.array[4096:]).all()


def test_a_job_naming_blocks_beyond_the_registered_memory_fails_cleanly(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "64MiB")
    client = connect(d, "out of range")
    try:
        eng = Engine(client, GEO, 0, "shm")
        keys, _, idx = chunk_plan(GEO, range(1))
        result = eng.job(STORE, keys, [[GEO.num_blocks, GEO.num_blocks + 1]], idx)
        assert not result.success and result.error_code == "INVALID_ARGUMENT", result
        assert round_trip(client, "shm", b"range") == 0
        assert d.proc.poll() is None  # type: ignore[union-attr]
    finally:
        client.close()
