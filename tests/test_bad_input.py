"""Bad input on every RPC gets a specific status and a message that says what to
fix; the daemon keeps serving and no slot leaks."""

from __future__ import annotations

import os
import socket
from typing import Any

import grpc
import pytest

from kvdepot.client import DepotClient
from kvdepot.client.fdpass import FdPassError, send_fd
from kvdepot.common.jobs import Job, JobResult
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

Code = grpc.StatusCode


@pytest.fixture
def setup(daemon_factory):
    d = daemon_factory("--pool-size", "16MiB", "--max-job-keys", "8", "--max-batch-keys", "128")
    c = DepotClient(d.target, client_name="bad-input").start()
    assert c.wait_connected(10)
    geo = Geometry(world_size=1, namespace="bad")
    eng = Engine(c, geo, 0)
    yield d, c, geo, eng
    c.close()


def expect(code: grpc.StatusCode, words: str, fn, *args, **kwargs) -> None:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value.details()
    assert words in info.value.details(), info.value.details()


def job_result(eng: Engine, **fields: Any) -> JobResult:
    fields.setdefault("registration_id", eng.registration.registration_id)
    job = Job(job_id=eng._next_job, **fields)
    eng._next_job += 1
    eng.stream.submit(job)
    assert eng.stream.wait({job.job_id}, timeout=10)
    (res,) = [r for r in eng.stream.poll() if r.job_id == job.job_id]
    return res


def test_transfer_jobs_with_bad_fields_fail_with_reasons(setup) -> None:
    d, c, geo, eng = setup
    keys, blocks, idx = chunk_plan(geo, range(0, 2))
    flat = [b for bl in blocks for b in bl]
    sizes = [len(b) for b in blocks]
    cases = [
        (
            dict(
                direction=pb.STORE,
                keys=keys,
                block_ids=[-1, *flat[1:]],
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "out of range",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=keys,
                block_ids=[10**12, *flat[1:]],
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "out of range",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=keys[:3],
                block_ids=flat,
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "describe 4 chunk",
        ),
        (
            dict(direction=pb.STORE, keys=keys, block_ids=flat, group_sizes=[4], block_indices=[0]),
            "INVALID_ARGUMENT",
            "group_sizes has 1",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=keys,
                block_ids=flat[:-1],
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "block id",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=[keys[0]] * 4,
                block_ids=flat,
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "same key twice",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=keys[2:] + keys[:2],
                block_ids=flat,
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "group-major",
        ),
        (
            dict(
                direction=pb.DIRECTION_UNSPECIFIED,
                keys=keys,
                block_ids=flat,
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "STORE or LOAD",
        ),
        (
            dict(
                direction=pb.STORE,
                keys=[b"k1", b"k2", b"k3", b"k4"],
                block_ids=flat,
                group_sizes=sizes,
                block_indices=idx,
            ),
            "INVALID_ARGUMENT",
            "OffloadKey",
        ),
        (
            dict(
                direction=pb.LOAD, keys=keys, block_ids=flat, group_sizes=sizes, block_indices=idx
            ),
            "NOT_FOUND",
            "not ready",
        ),
    ]
    big = chunk_plan(geo, range(0, 5))  # 10 keys > --max-job-keys 8
    cases.append(
        (
            dict(
                direction=pb.STORE,
                keys=big[0],
                block_ids=[b for x in big[1] for b in x],
                group_sizes=[len(x) for x in big[1]],
                block_indices=big[2],
            ),
            "RESOURCE_EXHAUSTED",
            "--max-job-keys",
        )
    )
    for fields, code, words in cases:
        res = job_result(eng, **fields)
        assert not res.success and res.error_code == code, (fields, res)
        assert words in res.error, res.error
    # Job for a registration that does not exist (before RegisterKV).
    res = job_result(
        eng,
        direction=pb.STORE,
        keys=keys,
        block_ids=flat,
        group_sizes=sizes,
        block_indices=idx,
        registration_id=999,
    )
    assert res.error_code == "FAILED_PRECONDITION" and "RegisterKV" in res.error
    # A good job still works on the same stream, and nothing leaked.
    for g, bl in enumerate(blocks):
        eng.fill(g, keys[g * 2 : (g + 1) * 2], bl, idx[g])
    assert (
        job_result(
            eng, direction=pb.STORE, keys=keys, block_ids=flat, group_sizes=sizes, block_indices=idx
        ).stored_keys
        == 4
    )
    stats = c.admin.GetStats(admin_pb2.GetStatsRequest())
    assert stats.writing_blocks == 0 and stats.ready_blocks == 4
    assert stats.used_bytes == 2 * 16384 + 2 * 8192  # 2 rows per group, 4 KiB granules


def test_register_kv_refuses_bad_layouts_and_memory(setup) -> None:
    d, c, geo, eng = setup
    layout = geo.layout()
    req = pb.RegisterKVRequest(session_id=c.session_id, namespace=layout, rank=3)
    expect(Code.INVALID_ARGUMENT, "rank 3 out of range", c.stub.RegisterKV, req)
    bad = pb.NamespaceLayout(id="bad", world_size=1, blocks_per_chunk=4, groups=layout.groups)
    expect(
        Code.FAILED_PRECONDITION,
        "another layout",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=bad),
    )
    # Group ids: one per group, distinct; and a namespace's are part of its layout
    # (its keys end with them). None given is 0, 1, ..., as an older client meant.
    for ids, words in (([0, 0], "twice"), ([0], "1 group id(s) for"), ([0] * 17, "MAX_GROUPS")):
        odd = pb.NamespaceLayout(
            id="ids", world_size=1, blocks_per_chunk=1, groups=layout.groups, group_ids=ids
        )
        expect(
            Code.INVALID_ARGUMENT,
            words,
            c.stub.RegisterKV,
            pb.RegisterKVRequest(session_id=c.session_id, namespace=odd),
        )
    n = len(layout.groups)
    same = pb.NamespaceLayout()
    same.CopyFrom(layout)
    same.group_ids[:] = range(n)
    moved = pb.NamespaceLayout()
    moved.CopyFrom(layout)
    moved.group_ids[:] = range(1, n + 1)
    expect(
        Code.FAILED_PRECONDITION,
        "another layout",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=moved),
    )
    # Naming 0, 1, ... is the layout the engine registered without ids.
    assert c.stub.RegisterKV(pb.RegisterKVRequest(session_id=c.session_id, namespace=same))
    zero = pb.NamespaceLayout(id="z", world_size=0, blocks_per_chunk=1, groups=layout.groups)
    expect(
        Code.INVALID_ARGUMENT,
        "world_size",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=zero),
    )
    expect(
        Code.FAILED_PRECONDITION,
        "open a Session",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id="nope", namespace=layout),
    )
    shm = pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token="forged", size=4096))
    expect(
        Code.INVALID_ARGUMENT,
        "unknown fd_token",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=layout, regions=[shm]),
    )
    expect(
        Code.INVALID_ARGUMENT,
        "needs a handle",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(
            session_id=c.session_id, namespace=layout, regions=[pb.MemoryRegion()]
        ),
    )
    # Page sizes that differ from the layout, and a tensor larger than its region.
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # the daemon seals it
    os.ftruncate(fd, 1 << 16)
    os.posix_fallocate(fd, 0, 1 << 16)  # populated (a sparse memfd is refused first)
    for tensors, groups, words in [
        (
            [pb.KVTensor(num_blocks=4, block_stride_bytes=2048, page_bytes=2048)],
            [
                pb.GroupRefs(layers=[pb.LayerRef(page_bytes=2048)] * 2),
                pb.GroupRefs(layers=[pb.LayerRef(page_bytes=1024)] * 3),
            ],
            "layout says 4096",
        ),
        (
            [pb.KVTensor(num_blocks=400, block_stride_bytes=4096, page_bytes=4096)],
            [
                pb.GroupRefs(layers=[pb.LayerRef(page_bytes=4096)] * 2),
                pb.GroupRefs(layers=[pb.LayerRef(page_bytes=1024)] * 3),
            ],
            "spans bytes",
        ),
    ]:
        token = send_fd(c.hello.fd_socket, c.session_id, fd)
        region = pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token=token, size=1 << 16))
        expect(
            Code.INVALID_ARGUMENT,
            words,
            c.stub.RegisterKV,
            pb.RegisterKVRequest(
                session_id=c.session_id,
                namespace=layout,
                regions=[region],
                tensors=tensors,
                groups=groups,
            ),
        )
    os.close(fd)
    ipc = pb.MemoryRegion(cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"\0" * 64, size=1))
    expect(
        Code.INVALID_ARGUMENT,
        "not available",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=layout, regions=[ipc]),
    )


def test_malformed_fds_are_refused(setup) -> None:
    d, c, geo, eng = setup
    # An fd that cannot be mapped (a socket) is refused at RegisterKV.
    a, b = socket.socketpair()
    token = send_fd(c.hello.fd_socket, c.session_id, a.fileno())
    region = pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token=token, size=4096))
    expect(
        Code.INVALID_ARGUMENT,
        "cannot map",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=geo.layout(), regions=[region]),
    )
    a.close()
    b.close()
    # A size beyond the file.
    fd = os.memfd_create("small", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    token = send_fd(c.hello.fd_socket, c.session_id, fd)
    region = pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token=token, size=1 << 20))
    expect(
        Code.INVALID_ARGUMENT,
        "fewer than",
        c.stub.RegisterKV,
        pb.RegisterKVRequest(session_id=c.session_id, namespace=geo.layout(), regions=[region]),
    )
    # No fd at all, and an fd from a session that does not exist.
    with socket.socket(socket.AF_UNIX) as s:
        from kvdepot.client.fdpass import encode, read_message

        s.connect(c.hello.fd_socket)
        s.sendall(encode({"session_id": c.session_id}))
        reply, _ = read_message(s)
        assert "exactly one fd" in reply["error"]
    with pytest.raises(FdPassError, match="unknown session_id"):
        send_fd(c.hello.fd_socket, "forged", fd)
    os.close(fd)


def test_lookup_pin_put_get_watch_errors(setup) -> None:
    d, c, geo, eng = setup
    k = make_key(1, 0)
    expect(Code.NOT_FOUND, "unknown namespace", c.lookup, "nope", [k])
    expect(Code.NOT_FOUND, "unknown namespace", c.pin, "nope", [k])
    expect(
        Code.FAILED_PRECONDITION,
        "unknown session",
        c.stub.Pin,
        pb.PinRequest(session_id="x", namespace_id="bad", keys=[k]),
    )
    expect(Code.INVALID_ARGUMENT, "section", c.put, "bad", k, 0, b"short")
    expect(Code.INVALID_ARGUMENT, "names group 9", c.put, "bad", make_key(1, 9), 0, b"x")
    expect(Code.INVALID_ARGUMENT, "rank 5", c.get, "bad", k, 5)
    expect(Code.NOT_FOUND, "not ready", c.get, "bad", k, 0)
    expect(Code.RESOURCE_EXHAUSTED, "split it", c.lookup, "bad", [k] * 200)
    with pytest.raises(grpc.RpcError) as info:
        next(iter(c.stub.Watch(pb.WatchRequest(session_id=c.session_id, namespace_id=""))))
    assert info.value.code() == Code.INVALID_ARGUMENT
    # Unpinning what we never pinned is counted, not an error.
    assert (
        c.stub.Unpin(
            pb.UnpinRequest(session_id=c.session_id, namespace_id="bad", keys=[k])
        ).not_pinned
        == 1
    )
    # Still serving, nothing held.
    stats = c.admin.GetStats(admin_pb2.GetStatsRequest())
    assert stats.used_bytes == 0 and stats.pinned_blocks == 0
    assert d.proc.poll() is None
