"""Hypothesis against a live daemon (docs/architecture.md §8.2: bad input never kills
the daemon, never corrupts another client's data, never leaks a slot).

Every RPC and stream gets random and malformed input: out-of-range sizes, negative
and huge ids, wrong page sizes, duplicate, empty and foreign-group keys, unknown
namespaces, mismatched world sizes, jobs that do not add up, wrong and closed fds
and protocol abuse on the fd socket, undecodable bytes, streams and sessions cut
half-way. After every example:
- each call ended with a documented status (tests.support.faults.DOCUMENTED_CODES),
  and each TransferResult with a documented error_code: never UNKNOWN or INTERNAL;
- the daemon is alive and its invariants hold: it runs with
  KVDEPOT_CHECK_INVARIANTS=1, which checks allocator against index, slots in one
  place only, pins and reservations held only by live sessions, after every
  mutation; Admin/GetStats answers INTERNAL once one broke.
At the end of each test every session is closed and the daemon must hold nothing:
no pins, no reservations, no registrations, no extra fds, used bytes equal to the
ready blocks, and a guardian client's pinned blocks load byte-identical.

Marked `slow`. Short by default (fixed examples: `derandomize`); the long run (20x the
examples, random each run), see tests/README.md:
    KVDEPOT_LONG=1 .venv/bin/python -m pytest -m slow tests/test_fuzz.py -s
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.client.fdpass import FdPassError, encode, read_message, send_fd
from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import DaemonProcess
from tests.support.engine import Engine, Geometry, chunk_plan, make_key
from tests.support.faults import (
    DOCUMENTED_CODE_NAMES,
    DOCUMENTED_CODES,
    DaemonFactory,
    admin,
    assert_pool_accounting,
    fd_targets,
    stats,
    wait_for,
)

LONG = os.environ.get("KVDEPOT_LONG") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]

MAX_JOB_KEYS = 16  # small, so RESOURCE_EXHAUSTED is reachable
NS = "fz"  # world size 2, two groups (the soak geometry)
NS1 = "fz1"  # world size 1, one group
GUARD_ROWS = 6
U32 = 2**32 - 1
U64 = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples * 20 if LONG else examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


# -- the rig: a debug daemon, a home session to fuzz from, a guardian to protect ------------


@dataclass
class RawSession:
    """A Session stream opened by hand (cancel() ends the session)."""

    call: Any
    id: str
    fd_socket: str

    @classmethod
    def open(cls, stub: Any, name: str = "fuzz", pid: int = 0, engine_id: str = "") -> RawSession:
        call = stub.Session(pb.SessionRequest(client_name=name, pid=pid, engine_id=engine_id))
        hello = next(call).hello
        return cls(call, hello.session_id, hello.fd_socket)

    def close(self) -> None:
        self.call.cancel()


@dataclass
class Rig:
    daemon: DaemonProcess
    channel: grpc.Channel
    stub: Any
    admin: Any
    home: DepotClient
    guardian: DepotClient
    home_engines: list[Engine]
    ns1_engine: Engine
    guard_keys: list[bytes]
    base_fds: int
    codes: dict[str, int] = field(default_factory=dict)

    @property
    def session_id(self) -> str:
        return self.home.session_id

    def resolve(self, session: str) -> str:
        return self.session_id if session == "HOME" else session

    def registrations(self) -> list[tuple[int, Geometry]]:
        return [
            (e.registration.registration_id, e.geo) for e in [*self.home_engines, self.ns1_engine]
        ]

    def note(self, code: grpc.StatusCode | str) -> None:
        name = code if isinstance(code, str) else code.name
        self.codes[name] = self.codes.get(name, 0) + 1

    def call(self, fn: Callable[..., Any], request: Any, **kw: Any) -> Any:
        """A unary call that must end with a documented status; returns the reply or None."""
        try:
            reply = fn(request, timeout=10, **kw)
        except grpc.RpcError as exc:
            self.note(exc.code())
            assert exc.code() in DOCUMENTED_CODES, (fn, request, exc.code(), exc.details())
            return None
        self.note(grpc.StatusCode.OK)
        return reply

    def check(self) -> None:
        """After each example: alive, and the invariants hold (INTERNAL otherwise)."""
        assert self.daemon.proc is not None and self.daemon.proc.poll() is None, self.daemon.log()[
            -3000:
        ]
        try:
            stats(self.admin)
        except grpc.RpcError as exc:
            raise AssertionError(f"GetStats: {exc.code()} {exc.details()}") from None

    def final_check(self) -> None:
        """Closes every session and checks the daemon holds nothing any more."""
        self.check()
        # The guardian's pinned rows survived everything, byte for byte.
        geo = soak.geometry(NS)
        for rank in range(geo.world_size):
            eng = Engine(self.guardian, geo, rank)
            blocks, indices = soak.group_job(geo, 0, self.guard_keys, soak.LOAD_BASE)
            res = eng.job(pb.LOAD, self.guard_keys, blocks, indices)
            assert res.success, res.error
            assert eng.mismatches(0, self.guard_keys, blocks[0], 0) == 0
        self.home.close()
        self.guardian.close()
        wait_for("every session to end", lambda: stats(self.admin).sessions == 0, timeout=10)
        s = assert_pool_accounting(self.admin)
        assert (s.pinned_blocks, s.pinned_bytes, s.registrations, s.inflight_jobs) == (0, 0, 0, 0)
        pid = self.daemon.proc.pid  # type: ignore[union-attr]
        try:
            wait_for(
                "the daemon's fds to return to the baseline",
                lambda: len(fd_targets(pid)) <= self.base_fds,
                timeout=10,
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {self.base_fds} at the start, now {sorted(fd_targets(pid))}"
            ) from None
        print(f"status codes seen: {dict(sorted(self.codes.items()))}")


def settled_fd_count(pid: int) -> int:
    """The daemon's fd count once it stops moving (start-up connections closing)."""
    counts = [len(fd_targets(pid))]
    while len(counts) < 4 or len(set(counts[-4:])) > 1:
        time.sleep(0.05)
        counts.append(len(fd_targets(pid)))
    return counts[-1]


@pytest.fixture
def rig(daemon_factory: DaemonFactory) -> Iterator[Rig]:
    d = daemon_factory(
        "--pool-size",
        "16MiB",
        "--max-job-keys",
        str(MAX_JOB_KEYS),
        "--reservation-timeout",
        "3",
        env={"KVDEPOT_CHECK_INVARIANTS": "1"},
    )
    pid = d.proc.pid  # type: ignore[union-attr]
    channel = d.channel()
    stats(admin(channel))  # connected: the baseline includes this channel, nothing else
    base_fds = settled_fd_count(pid)
    geo = soak.geometry(NS)
    guardian = DepotClient(d.target, client_name="guardian").start()
    assert guardian.wait_connected(10)
    guard_keys = [make_key(c, 0, b"guard") for c in range(GUARD_ROWS)]
    blocks, indices = soak.group_job(geo, 0, guard_keys, soak.STORE_BASE)
    for rank in range(geo.world_size):
        eng = Engine(guardian, geo, rank)
        eng.fill(0, guard_keys, blocks[0], 0)
        assert eng.job(pb.STORE, guard_keys, blocks, indices).stored_keys == GUARD_ROWS
    assert guardian.pin(NS, guard_keys) == [True] * GUARD_ROWS
    home = DepotClient(d.target, client_name="fuzz-home").start()
    assert home.wait_connected(10)
    home_engines = [Engine(home, geo, r) for r in range(geo.world_size)]
    # Some ready rows for lookups, pins, loads and gets to find.
    keys, blocks_, indices_ = chunk_plan(geo, range(8))
    for eng in home_engines:
        for g, b in enumerate(blocks_):
            eng.fill(g, keys[g * 8 : (g + 1) * 8], b, indices_[g])
        assert eng.job(pb.STORE, keys, blocks_, indices_).success
    geo1 = Geometry(groups=[[2048]], blocks_per_chunk=1, world_size=1, num_blocks=64, namespace=NS1)
    ns1_engine = Engine(home, geo1, 0)
    r = Rig(
        d,
        channel,
        home.stub,
        admin(channel),
        home,
        guardian,
        home_engines,
        ns1_engine,
        guard_keys,
        base_fds,
    )
    yield r
    home.close()
    guardian.close()
    channel.close()


# -- strategies ------------------------------------------------------------------------


def extremes(lo: int, hi: int, small: int = 70) -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(lo, min(hi, small)),
        st.sampled_from(sorted({lo, hi, hi - 1, max(lo, 0), min(hi, 2**31)})),
        st.integers(lo, hi),
    )


valid_keys = st.builds(make_key, st.integers(0, 12), st.integers(0, 1))
weird_keys = st.one_of(
    st.just(b""),
    st.binary(max_size=4),
    st.binary(min_size=257, max_size=300),
    st.builds(make_key, st.integers(0, 5), st.sampled_from([2, 3, 64, U32])),
    st.binary(min_size=5, max_size=40),
)
any_key = st.one_of(valid_keys, valid_keys, weird_keys)
key_lists = st.one_of(
    st.lists(any_key, max_size=10),
    st.lists(valid_keys, max_size=6).map(lambda ks: ks + ks),  # duplicates
    st.integers(MAX_JOB_KEYS * 16 + 1, MAX_JOB_KEYS * 16 + 40).map(
        lambda n: [make_key(i, 0) for i in range(n)]
    ),  # too large a batch
)
sessions = st.one_of(
    st.just("HOME"), st.just("HOME"), st.sampled_from(["", "nope"]), st.text(max_size=40)
)
namespaces = st.one_of(
    st.sampled_from([NS, NS, NS1, "", "unknown-ns", "x" * 300]), st.text(max_size=40)
)
ranks = extremes(0, U32, small=4)
section_sizes = st.sampled_from([0, 1, 2047, 2048, 6143, 6144, 6145, 16383, 16384, 16385])


def layouts(ids: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[pb.NamespaceLayout]:
    page = st.one_of(
        st.sampled_from([1024, 2048, 4096]), extremes(0, 2**31, small=8), st.just(2**30 + 1)
    )
    groups = st.one_of(
        st.lists(st.lists(page, min_size=0, max_size=4), min_size=0, max_size=3),
        st.just([[1024] * 4097]),  # too many layers
        st.just([[1024]] * 65),  # too many groups
        st.just([[4096, 4096], [1024, 1024, 1024]]),  # the fz layout itself
    )
    return st.builds(
        lambda i, w, b, g, d: pb.NamespaceLayout(
            id=i,
            world_size=w,
            blocks_per_chunk=b,
            groups=[pb.GroupLayout(layer_page_bytes=x) for x in g],
            description=d,
        ),
        ids
        or st.one_of(
            st.sampled_from([NS, NS1, "fzr-1", "fzr-2", "", "\x00bad", "y" * 129]),
            st.text(max_size=20),
        ),
        st.one_of(st.sampled_from([1, 2, 3]), extremes(0, U32, small=70)),
        st.one_of(st.sampled_from([1, 2]), extremes(0, U32, small=5000)),
        groups,
        st.text(max_size=20),
    )


@st.composite
def unary_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    """(service, method, request) with the home session as "HOME"."""
    s, ns, keys = draw(sessions), draw(namespaces), draw(key_lists)
    key, rank = draw(any_key), draw(ranks)
    method = draw(
        st.sampled_from(
            [
                "Lookup",
                "Pin",
                "Unpin",
                "Put",
                "Get",
                "UnregisterKV",
                "RegisterKV",
                "GetStats",
                "ListNamespaces",
                "ListEngines",
                "ListBlocks",
                "Evict",
                "Clear",
            ]
        )
    )
    if method == "Lookup":
        return "depot", method, pb.LookupRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Pin":
        return "depot", method, pb.PinRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Unpin":
        return "depot", method, pb.UnpinRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Put":
        return (
            "depot",
            method,
            pb.PutRequest(
                session_id=s, namespace_id=ns, key=key, rank=rank, data=bytes(draw(section_sizes))
            ),
        )
    if method == "Get":
        return "depot", method, pb.GetRequest(session_id=s, namespace_id=ns, key=key, rank=rank)
    if method == "UnregisterKV":
        return (
            "depot",
            method,
            pb.UnregisterKVRequest(session_id=s, registration_id=draw(extremes(0, U64))),
        )
    if method == "RegisterKV":  # inline (no memory): only the layout and the rank matter
        return (
            "depot",
            method,
            pb.RegisterKVRequest(session_id=s, namespace=draw(layouts()), rank=rank),
        )
    if method == "ListBlocks":
        return (
            "admin",
            method,
            apb.ListBlocksRequest(
                namespace_id=ns,
                has_group=draw(st.booleans()),
                group=draw(extremes(0, U32, 3)),
                page_size=draw(extremes(0, U32, 20)),
                page_token=draw(
                    st.one_of(
                        st.text(max_size=30),
                        st.just(f"{NS}/00"),
                        st.just(f"{NS}/zz"),
                        st.just("-5"),
                    )
                ),
            ),
        )
    if method == "Evict":
        return "admin", method, apb.EvictRequest(namespace_id=ns, keys=keys[:20])
    request_type = {
        "GetStats": apb.GetStatsRequest,
        "ListNamespaces": apb.ListNamespacesRequest,
        "ListEngines": apb.ListEnginesRequest,
        "Clear": apb.ClearRequest,
    }[method]
    return "admin", method, request_type()


MUTATIONS = [
    "neg_block",
    "huge_block",
    "drop_key",
    "extra_key",
    "dup_key",
    "wrong_group_key",
    "empty_key",
    "group_sizes_len",
    "group_sizes_huge",
    "block_indices_huge",
    "bad_session",
    "too_many_keys",
    "bad_registration",
    "bad_direction",
]


@st.composite
def transfer_jobs(draw: st.DrawFn, regs: list[tuple[int, Geometry]]) -> pb.TransferJob:
    """A job that is valid for one of the home registrations, then 0-2 mutations."""
    reg_id, geo = draw(st.sampled_from(regs))
    bpc = geo.blocks_per_chunk
    keys: list[bytes] = []
    block_ids: list[int] = []
    sizes: list[int] = []
    firsts: list[int] = []
    for g in range(len(geo.groups)):
        first = draw(st.integers(0, 5))
        n = draw(st.integers(0, 6))
        chunks = 0 if n == 0 else (first % bpc + n + bpc - 1) // bpc
        ids = draw(st.lists(st.integers(0, geo.num_blocks - 1), min_size=n, max_size=n))
        picks = draw(st.lists(st.integers(0, 20), min_size=chunks, max_size=chunks, unique=True))
        keys += [make_key(c, g, geo.namespace.encode()) for c in picks]
        block_ids += ids
        sizes.append(n)
        firsts.append(first)
    job = pb.TransferJob(
        job_id=draw(st.integers(0, U64)),
        direction=draw(st.sampled_from([1, 1, 2, 2])),
        registration_id=reg_id,
        keys=keys,
        block_ids=block_ids,
        group_sizes=sizes,
        block_indices=firsts,
        expedited=draw(st.booleans()),
        session_id="HOME",
    )
    for m in draw(st.lists(st.sampled_from(MUTATIONS), max_size=2)):
        if m == "neg_block" and job.block_ids:
            job.block_ids[draw(st.integers(0, len(job.block_ids) - 1))] = draw(
                st.sampled_from([-1, I64_MIN])
            )
        elif m == "huge_block" and job.block_ids:
            job.block_ids[0] = draw(st.sampled_from([geo.num_blocks, I64_MAX]))
        elif m == "drop_key" and job.keys:
            del job.keys[-1]
        elif m == "extra_key":
            job.keys.append(make_key(99, 0))
        elif m == "dup_key" and job.keys:
            job.keys.append(job.keys[0])
        elif m == "wrong_group_key" and job.keys:
            job.keys[0] = make_key(1, len(geo.groups) + draw(st.integers(0, 3)))
        elif m == "empty_key" and job.keys:
            job.keys[0] = b""
        elif m == "group_sizes_len":
            job.group_sizes.append(1)
        elif m == "group_sizes_huge" and job.group_sizes:
            job.group_sizes[0] = U32
        elif m == "block_indices_huge" and job.block_indices:
            job.block_indices[0] = U64
        elif m == "bad_session":
            job.session_id = draw(st.sampled_from(["", "nope"]))
        elif m == "too_many_keys":
            job.keys.extend(make_key(1000 + i, 0) for i in range(MAX_JOB_KEYS + 1))
        elif m == "bad_registration":
            job.registration_id = draw(extremes(0, U64))
        elif m == "bad_direction":
            job.direction = draw(st.sampled_from([0, 3, 7]))
    return job


# -- the tests ---------------------------------------------------------------------------


def test_unary_calls(rig: Rig) -> None:
    depot, adm = rig.stub, rig.admin

    @fuzz_settings(600)
    @given(st.lists(unary_calls(), min_size=1, max_size=12))
    def run(calls: list[tuple[str, str, Any]]) -> None:
        for service, method, request in calls:
            if hasattr(request, "session_id"):
                request.session_id = rig.resolve(request.session_id)
            rig.call(getattr(depot if service == "depot" else adm, method), request)
        rig.check()

    run()
    rig.final_check()


def _drain(results: Iterator[pb.TransferResult], out: queue.Queue) -> None:
    try:
        for r in results:
            out.put(r)
        out.put(grpc.StatusCode.OK)
    except grpc.RpcError as exc:
        out.put(exc.code())


def test_transfer_streams(rig: Rig) -> None:
    regs = rig.registrations()

    @fuzz_settings(300)
    @given(
        st.lists(transfer_jobs(regs), min_size=1, max_size=8),
        st.sampled_from(["read_all", "read_all", "cancel_now", "cancel_after_one", "half_close"]),
    )
    def run(jobs: list[pb.TransferJob], cut: str) -> None:
        requests: queue.SimpleQueue[pb.TransferJob | None] = queue.SimpleQueue()
        for job in jobs:
            job.session_id = rig.resolve(job.session_id)
            requests.put(job)

        def request_iter() -> Iterator[pb.TransferJob]:
            while (job := requests.get()) is not None:
                yield job

        if cut != "cancel_now" and cut != "cancel_after_one":
            requests.put(None)  # half-close: the daemon answers what it got, then ends
        call = rig.stub.Transfer(request_iter(), timeout=20)
        out: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_drain, args=(call, out), daemon=True)
        reader.start()
        results: list[pb.TransferResult] = []
        status = None
        if cut == "cancel_now":
            call.cancel()
        while status is None:
            item = out.get(timeout=20)
            if isinstance(item, grpc.StatusCode):
                status = item
            else:
                results.append(item)
                if cut == "cancel_after_one":
                    call.cancel()
        requests.put(None)
        reader.join(5)
        rig.note(status)
        if cut.startswith("cancel"):
            assert status in DOCUMENTED_CODES | {grpc.StatusCode.CANCELLED}, status
        else:
            assert status is grpc.StatusCode.OK, status
            assert len(results) == len(jobs)
        for r in results:
            rig.note(r.error_code or "OK")
            assert r.success or r.error_code in DOCUMENTED_CODE_NAMES, r
            assert r.error_code not in ("INTERNAL", "UNKNOWN"), r
        rig.check()

    run()
    rig.final_check()


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
    pages = geo.layer_pages
    tensors = []
    off = 0
    for p in pages:
        tensors.append(
            pb.KVTensor(
                region_index=0, region_offset=off, num_blocks=64, block_stride_bytes=p, page_bytes=p
            )
        )
        off += 64 * p
    refs, t = [], 0
    for g in geo.groups:
        refs.append(
            pb.GroupRefs(
                layers=[pb.LayerRef(tensor_index=t + i, page_bytes=p) for i, p in enumerate(g)]
            )
        )
        t += len(g)
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


DEPOT_METHODS = {
    "Session": "unary_stream",
    "RegisterKV": "unary",
    "UnregisterKV": "unary",
    "Watch": "unary_stream",
    "Lookup": "unary",
    "Pin": "unary",
    "Unpin": "unary",
    "Transfer": "stream_stream",
    "Put": "unary",
    "Get": "unary",
}
ADMIN_METHODS = ["GetStats", "ListNamespaces", "ListEngines", "ListBlocks", "Evict", "Clear"]
ALL_METHODS = [(f"/kvdepot.v1.Depot/{m}", kind) for m, kind in DEPOT_METHODS.items()] + [
    (f"/kvdepot.v1.Admin/{m}", "unary") for m in ADMIN_METHODS
]


def _raw(channel: grpc.Channel, method: str, kind: str, payloads: list[bytes]) -> grpc.StatusCode:
    ident: dict[str, Any] = {
        "request_serializer": lambda b: b,
        "response_deserializer": lambda b: b,
    }
    try:
        if kind == "unary":
            channel.unary_unary(method, **ident)(payloads[0], timeout=10)
        elif kind == "unary_stream":
            call = channel.unary_stream(method, **ident)(payloads[0], timeout=10)
            next(call)  # a parsable request opens the stream (a session, a watch): end it
            call.cancel()
        else:
            list(channel.stream_stream(method, **ident)(iter(payloads), timeout=10))
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK  # we cancelled it after the first message
        return exc.code()
    return grpc.StatusCode.OK


def test_undecodable_and_random_bytes_on_every_method(rig: Rig) -> None:
    payload = st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\xff\xff\xff", b"\x0a\x05ab", b"\x08", b"\x12\xff\xff\xff\xff\x0f"]),
    )

    @fuzz_settings(300)
    @given(st.sampled_from(ALL_METHODS), st.lists(payload, min_size=1, max_size=4))
    def run(method: tuple[str, str], payloads: list[bytes]) -> None:
        code = _raw(rig.channel, method[0], method[1], payloads)
        rig.note(code)
        assert code in DOCUMENTED_CODES, (method, payloads, code)
        rig.check()

    run()
    rig.final_check()


def test_sessions_and_watches_cut_half_way(rig: Rig) -> None:
    @fuzz_settings(150)
    @given(
        st.text(max_size=300),
        st.integers(I64_MIN, I64_MAX),
        st.text(max_size=50),
        st.lists(
            st.sampled_from(["pin", "put_half", "watch", "watch_unknown", "lookup"]), max_size=4
        ),
        st.sampled_from(["cancel", "keep"]),
    )
    def run(name: str, pid: int, engine_id: str, actions: list[str], end: str) -> None:
        s = RawSession.open(rig.stub, name=name, pid=pid, engine_id=engine_id)
        keys = [make_key(c, 0) for c in range(4)]
        for a in actions:
            if a == "pin":
                rig.call(rig.stub.Pin, pb.PinRequest(session_id=s.id, namespace_id=NS, keys=keys))
            elif a == "put_half":  # rank 0 of a fresh row: a reservation of this session
                rig.call(
                    rig.stub.Put,
                    pb.PutRequest(
                        session_id=s.id,
                        namespace_id=NS,
                        key=make_key(pid % 1000, 1, b"half"),
                        rank=0,
                        data=bytes(6144),
                    ),
                )
            elif a in ("watch", "watch_unknown"):
                call = rig.stub.Watch(
                    pb.WatchRequest(
                        session_id=s.id, namespace_id=NS if a == "watch" else "nowhere"
                    ),
                    timeout=10,
                )
                first = next(call)
                assert first.kind == pb.WatchEvent.SNAPSHOT and first.reset
                call.cancel()
            else:
                rig.call(
                    rig.stub.Lookup, pb.LookupRequest(session_id=s.id, namespace_id=NS, keys=keys)
                )
        if end == "cancel":
            s.close()
        rig.check()  # with "keep", the session is still open here
        s.close()

    run()
    rig.final_check()
