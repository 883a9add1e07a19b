"""The fd socket and registrations: what a client may send over the socket (wrong and
closed fds, protocol abuse) and what it may then register.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.bench.geometry import registration_pb
from kvdepot.client import SharedKVBuffer
from kvdepot.client.fdpass import FdPassError, encode, read_message, send_fd
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.engine import chunk_plan
from tests.support.fuzz_rig import LONG, NS, U32, U64, RawSession, Rig, fuzz_settings
from tests.support.fuzz_strategies import layouts, ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]

# The fd socket: what a client may send, and what it may then register.
FD_KINDS = [
    "sealable",
    "sealable",
    "unsealable",
    "pipe",
    "devnull",
    "file",
    "readonly",
    "small",
    "closed_after_send",
]
FD_PROTOCOL = [
    "good",
    "good",
    "good",
    "bad_session",
    "no_fd",
    "two_fds",
    "garbage",
    "huge_length",
    "early_close",
    "not_json",
    "json_list",
]
SHM_BYTES = 64 * (4096 + 4096 + 1024 * 3)


def make_fd(kind: str, tmp: str) -> tuple[int, list[Any]]:
    """An fd of the given kind, and the objects that keep it alive."""
    if kind in ("sealable", "closed_after_send"):
        buf = SharedKVBuffer.allocate(SHM_BYTES, name="kvdepot-fuzz")
        return buf.fd, [buf]
    if kind == "small":
        buf = SharedKVBuffer.allocate(4096, name="kvdepot-fuzz")
        return buf.fd, [buf]
    if kind == "unsealable":
        fd = os.memfd_create("kvdepot-fuzz-unsealable", os.MFD_CLOEXEC)
        os.ftruncate(fd, SHM_BYTES)
        return fd, []
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r, []
    if kind == "devnull":
        return os.open(os.devnull, os.O_RDWR), []
    if kind == "file":
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, SHM_BYTES)
        return fd, []
    buf = SharedKVBuffer.allocate(SHM_BYTES, name="kvdepot-fuzz")
    return os.open(f"/proc/self/fd/{buf.fd}", os.O_RDONLY), [buf]


def fd_exchange(path: str, session_id: str, fd: int, protocol: str) -> str | None:
    """Talks to the fd socket; returns a token when the daemon handed one out."""
    if protocol == "good":
        try:
            return send_fd(path, session_id, fd, timeout=5)
        except FdPassError:
            return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
        try:
            if protocol == "bad_session":
                s.sendmsg([encode({"session_id": "nope"})], rights)
            elif protocol == "no_fd":
                s.sendall(encode({"session_id": session_id}))
            elif protocol == "two_fds":
                s.sendmsg(
                    [encode({"session_id": session_id})],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("ii", fd, fd))],
                )
            elif protocol == "garbage":
                s.sendmsg([b"\x00\x00\x00\x05hello"], rights)
            elif protocol == "huge_length":
                s.sendmsg([b"\xff\xff\xff\xff"], rights)
            elif protocol == "early_close":
                s.sendmsg([b"\x00\x00"], rights)
                return None
            elif protocol == "not_json":
                s.sendmsg([b"\x00\x00\x00\x03{{{"], rights)
            elif protocol == "json_list":
                s.sendmsg([b"\x00\x00\x00\x02[]"], rights)
            reply, _ = read_message(s)
        except (OSError, FdPassError):
            return None
    assert "fd_token" not in reply, (protocol, reply)  # abuse never yields a token
    return None


@st.composite
def registrations(draw: st.DrawFn) -> dict[str, Any]:
    geo = soak.geometry(NS)
    tensors, refs = registration_pb(geo, 64)  # each layer its own 64-block tensor
    layout = draw(
        st.one_of(
            st.just(geo.layout()),
            st.just(geo.layout()),
            layouts(),
            st.builds(
                lambda w: pb.NamespaceLayout(  # same id, other world size
                    id=NS, world_size=w, blocks_per_chunk=2, groups=geo.layout().groups
                ),
                st.sampled_from([1, 3, 64]),
            ),
        )
    )
    for m in draw(
        st.lists(
            st.sampled_from(
                [
                    "page_bytes",
                    "region_index",
                    "num_blocks",
                    "stride",
                    "offset",
                    "tensor_index",
                    "layer_count",
                    "group_count",
                    "page_offset",
                ]
            ),
            max_size=2,
        )
    ):
        if m == "page_bytes":
            refs[0].layers[0].page_bytes = draw(st.sampled_from([0, 4095, 4097, U64]))
        elif m == "region_index":
            tensors[0].region_index = draw(st.sampled_from([1, U32]))
        elif m == "num_blocks":
            tensors[-1].num_blocks = draw(st.sampled_from([0, 65, U64]))
        elif m == "stride":
            tensors[0].block_stride_bytes = draw(st.sampled_from([0, 1, U64]))
        elif m == "offset":
            tensors[-1].region_offset = draw(st.sampled_from([1, SHM_BYTES, U64]))
        elif m == "tensor_index" and refs[-1].layers:
            refs[-1].layers[-1].tensor_index = draw(st.sampled_from([len(tensors), U32]))
        elif m == "layer_count":
            del refs[0].layers[-1]
        elif m == "group_count":
            refs.append(pb.GroupRefs())
        elif m == "page_offset":
            refs[1].layers[0].page_offset = draw(st.sampled_from([1, U64]))
    return {
        "layout": layout,
        "tensors": tensors,
        "groups": refs,
        "rank": draw(ranks),
        "size": draw(st.sampled_from([SHM_BYTES, SHM_BYTES, 0, 1, SHM_BYTES + 1, U64])),
        "token": draw(
            st.sampled_from(
                ["received", "received", "received", "random", "reused", "other_session"]
            )
        ),
        "fd_kind": draw(st.sampled_from(FD_KINDS)),
        "fd_protocol": draw(st.sampled_from(FD_PROTOCOL)),
        "then": draw(st.sampled_from(["store_load", "unregister", "end_session", "keep"])),
    }


def test_registrations_and_the_fd_socket(rig: Rig, tmp_path: Any) -> None:
    tmp_file = str(tmp_path / "not-a-memfd")
    geo = soak.geometry(NS)

    @fuzz_settings(250)
    @given(st.lists(registrations(), min_size=1, max_size=4))
    def run(regs: list[dict[str, Any]]) -> None:
        session = RawSession.open(rig.stub, name="fuzz-register")
        mine = [session]
        last_token = None
        fd_kind_of: dict[str, str] = {}  # token -> the kind of fd it stands for
        for spec in regs:
            fd, keep = make_fd(spec["fd_kind"], tmp_file)
            try:
                token = fd_exchange(session.fd_socket, session.id, fd, spec["fd_protocol"])
                if token is not None:
                    fd_kind_of[token] = spec["fd_kind"]
            finally:
                os.close(fd) if not keep else None
            if spec["fd_kind"] == "closed_after_send":
                keep.clear()  # our copy goes away; the daemon's must stay usable
            if spec["token"] == "random":
                token = os.urandom(16).hex()
            elif spec["token"] == "reused":
                token = last_token
            last_token = token
            # "other_session": the token belongs to `session`, the call names another.
            session_id = rig.session_id if spec["token"] == "other_session" else session.id
            regions = (
                []
                if token is None
                else [pb.MemoryRegion(shm=pb.SharedMemoryHandle(fd_token=token, size=spec["size"]))]
            )
            reply = rig.call(
                rig.stub.RegisterKV,
                pb.RegisterKVRequest(
                    session_id=session_id,
                    namespace=spec["layout"],
                    rank=spec["rank"],
                    regions=regions,
                    tensors=spec["tensors"] if regions else [],
                    groups=spec["groups"] if regions else [],
                ),
            )
            # A reused token may still stand for an earlier (unclaimed) fd.
            kind = fd_kind_of.get(token or "", "none")
            if reply is not None and regions:
                assert kind in ("sealable", "closed_after_send"), f"a {kind} fd was accepted"
                if spec["then"] == "store_load" and reply.memory_path == "shm":
                    keys, blocks, indices = chunk_plan(geo, range(2), salt=b"fz-reg")
                    for direction in (pb.STORE, pb.LOAD):
                        rig.call(
                            lambda req, **kw: list(rig.stub.Transfer(iter([req]), **kw)),
                            pb.TransferJob(
                                job_id=1,
                                direction=direction,
                                registration_id=reply.registration_id,
                                keys=keys,
                                block_ids=[b for g in blocks for b in g],
                                group_sizes=[len(g) for g in blocks],
                                block_indices=indices,
                                session_id=session_id,
                            ),
                        )
                elif spec["then"] == "unregister":
                    rig.call(
                        rig.stub.UnregisterKV,
                        pb.UnregisterKVRequest(
                            session_id=session_id, registration_id=reply.registration_id
                        ),
                    )
            if spec["then"] == "end_session":
                session.close()
                session = RawSession.open(rig.stub, name="fuzz-register")
                mine.append(session)
        rig.check()
        # An example is an engine process: its sessions end with it (the daemon must
        # release what they held; the next example's check and final_check see that).
        for each in mine:
            each.close()

    run()
    rig.final_check()
