"""`DepotClient`: a synchronous, thread-safe client for the kvdepot daemon (no vLLM needed).

    client = DepotClient("unix:///run/kvdepot/kvdepot.sock", client_name="my-engine")
    client.start()                       # never raises: reconnects in the background
    client.wait_connected(5.0)
    reg = client.register_kv(layout, rank=0, shm=buf, tensors=[...], groups=[...])
    stream = client.transfer_stream()
    stream.submit(Job(job_id=1, direction=STORE, registration_id=reg.registration_id, ...))
    stream.wait({1}, timeout=5.0); results = stream.poll()  # JobResults

Failure contract (what an engine relies on): calls made while the daemon is
unreachable fail fast with `DepotUnavailable` or a gRPC error within their
deadline; a Transfer stream that breaks answers every job in flight with a
failed result (`error_code="UNAVAILABLE"`); watchers get a reset (forget every
key) when the daemon goes away and a fresh snapshot when it is back. The session
reconnects by itself with backoff; listeners hear about every new session so
they can re-register (registrations die with the daemon).

The façade: every RPC the client library makes is made here, and every
`RegisterKVRequest` is built by `_register_request` (a registration on any memory
path, `register_memory`; an observer join, `join`). The other modules ask: the
memory paths (kvdepot.client.cuda_ipc, kvdepot.client.pvm) call `register_memory`,
the lanes `open_lane`, and the stream modules open their calls with `open_session_call`,
`open_watch_call` and `open_transfer_call` (tests/test_client_rpcs.py checks that no other
module of the client calls a stub).

Threads and ownership: the unary calls, `join`, `watch`, `transfer_stream`, `start`
and `close` are called from any thread. The client owns three channels: the sync
one (unary calls and the Transfer streams, kvdepot.client.transfer_stream); the
`grpc.aio` one of its long-lived streams, Session and Watch (kvdepot.client.watch),
held by its `SessionKeeper` (kvdepot.client.session) and used only on the process's
stream loop thread (kvdepot.client.stream_loop), where `open_session_call`, `open_watch_call`,
`join_async` and `rejoin` run; and the operator socket's, opened on first use of
`admin` (under `_lock`). `close` ends all three. The joined namespaces are kept by
`Memberships` (kvdepot.client.session), under a lock of their own.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any, cast

import grpc

from kvdepot.client.fdpass import send_fd
from kvdepot.client.session import DepotUnavailable, Memberships, SessionKeeper
from kvdepot.client.shm import SharedKVBuffer
from kvdepot.client.transfer_stream import TransferStream
from kvdepot.client.watch import Watch
from kvdepot.common.kinds import (
    HELLO_CLIENT_METADATA,
    HELLO_ENGINE_METADATA,
    HELLO_PID_METADATA,
    PUT_PART_BYTES,
    SESSION_METADATA,
    TICKET_METADATA,
)
from kvdepot.v1 import admin_pb2_grpc, depot_pb2, depot_pb2_grpc

__all__ = ["DepotClient", "DepotUnavailable", "normalize_target"]

log = logging.getLogger("kvdepot.client")

DEFAULT_TIMEOUT = 5.0
_MAX_MESSAGE = 512 << 20
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    # Reconnect quickly after a daemon restart.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
# The Session and Watch streams' channel: no HTTP/2 bandwidth-delay probing. When
# messages arrive, the probe pings the daemon for a while, on gRPC's threads, which
# an engine's scheduler then shares the CPU with (172 thread wakes in 0.8 s of decode
# steps that followed a Watch snapshot, against 8 without). A Unix socket needs no
# estimate: a fixed window large enough for a snapshot part stands in for it.
_STREAM_CHANNEL_OPTIONS = (
    *_CHANNEL_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 4 << 20),
)


def session_metadata(session_id: str) -> list[tuple[str, str]]:
    """A call's metadata naming `session_id`: the daemon reads the request of no Depot
    call but Session without a live session named there (server/service/gate.py)."""
    if not session_id or not (session_id.isascii() and session_id.isprintable()):
        return []  # no value gRPC can carry: the daemon says there is no session
    return [(SESSION_METADATA, session_id)]


def hello_metadata(request: depot_pb2.SessionRequest) -> list[tuple[str, str | bytes]]:
    """A Session call's metadata: its request's fields, which are all the daemon reads
    of it (it never reads a Session request: server/service/gate.py). Names are cut to
    the 200 characters the daemon keeps, so the metadata stays small."""
    return [
        (HELLO_CLIENT_METADATA, request.client_name[:200].encode()),
        (HELLO_PID_METADATA, str(request.pid)),
        (HELLO_ENGINE_METADATA, request.engine_id[:200].encode()),
    ]


_CALL_ARGS = ("timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _WithSession:
    """One method of a Depot stub whose calls send the session their request names
    as metadata too (`session_metadata`). A request stream without that metadata is
    opened as its first request's session: that request is waited for (the library's
    own streams pass the metadata themselves)."""

    __slots__ = ("_method", "_streaming")

    def __init__(self, method: Any, streaming: bool) -> None:
        self._method = method
        self._streaming = streaming

    def _with_session(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs.update(zip(_CALL_ARGS, args, strict=False))
        metadata = list(kwargs.get("metadata") or ())
        if isinstance(request, depot_pb2.SessionRequest):  # its fields go as metadata
            if not any(key == HELLO_CLIENT_METADATA for key, _ in metadata):
                kwargs["metadata"] = metadata + hello_metadata(request)
            return request
        if any(key == SESSION_METADATA for key, _ in metadata):
            return request
        first = request
        if self._streaming:
            first = next(request, None)
            request = iter(()) if first is None else itertools.chain([first], request)
        kwargs["metadata"] = metadata + session_metadata(getattr(first, "session_id", ""))
        return request

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        request = self._with_session(request, args, kwargs)
        return self._method(request, **kwargs)

    def future(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        request = self._with_session(request, args, kwargs)
        return self._method.future(request, **kwargs)

    def with_call(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        request = self._with_session(request, args, kwargs)
        return self._method.with_call(request, **kwargs)


def session_stub(channel: grpc.Channel) -> depot_pb2_grpc.DepotStub:
    """A Depot stub on `channel` whose calls send the session their requests name as
    metadata: what the daemon needs before it reads a request of any Depot call but
    Session (server/service/gate.py). DepotClient's `stub` is one. (Not a gRPC client
    interceptor: one registers a method on the channel at every call, which crashes
    the process on a closed channel where a plain call raises ValueError.)"""
    stub = depot_pb2_grpc.DepotStub(channel)
    wrapped = SimpleNamespace()
    for method in depot_pb2.DESCRIPTOR.services_by_name["Depot"].methods:
        setattr(
            wrapped, method.name, _WithSession(getattr(stub, method.name), method.client_streaming)
        )
    return cast(depot_pb2_grpc.DepotStub, wrapped)


def _register_request(
    session_id: str,
    layout: depot_pb2.NamespaceLayout,
    rank: int = 0,
    regions: Sequence[depot_pb2.MemoryRegion] = (),
    tensors: Sequence[depot_pb2.KVTensor] = (),
    groups: Sequence[depot_pb2.GroupRefs] = (),
    units: int = 1,
) -> depot_pb2.RegisterKVRequest:
    """The one RegisterKVRequest builder: a registration (memory regions of any path;
    of ranks [rank, rank + units)) or, with the layout's id alone and nothing else, an
    observer join."""
    return depot_pb2.RegisterKVRequest(
        session_id=session_id,
        namespace=layout,
        rank=rank,
        regions=regions,
        tensors=tensors,
        groups=groups,
        unit_count=units if units > 1 else 0,
    )


def _shm_region(
    hello: depot_pb2.SessionHello | None, session_id: str, shm: SharedKVBuffer, timeout: float
) -> depot_pb2.MemoryRegion:
    """The shm path's region: the memfd passed to the daemon's fd socket (SCM_RIGHTS),
    named in the registration by the token the daemon gave back."""
    if hello is None or not hello.fd_socket:
        raise DepotUnavailable("the daemon takes no fds (no fd socket)")
    token = send_fd(hello.fd_socket, session_id, shm.fd, timeout=timeout)
    return depot_pb2.MemoryRegion(shm=depot_pb2.SharedMemoryHandle(fd_token=token, size=shm.size))


def normalize_target(target: str) -> str:
    """'/run/x.sock' or 'unix:///run/x.sock' -> a gRPC target."""
    if target.startswith("/"):
        return f"unix://{target}"
    return target


class DepotClient:
    """One session with the daemon, kept open (and re-opened) in the background."""

    def __init__(
        self,
        target: str,
        client_name: str = "",
        engine_id: str = "",
        *,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        keepalive_timeout: float = 15.0,
    ) -> None:
        self.target = normalize_target(target)
        self.client_name = client_name or f"pid {os.getpid()}"
        self.engine_id = engine_id
        # The daemon sends a keepalive every few seconds; a daemon that says nothing
        # for this long is frozen (SIGSTOP, swapping, a hung loop): treat it as gone.
        self.keepalive_timeout = keepalive_timeout
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        # Requests that name a session name it in their metadata too (gate.py).
        self.stub = session_stub(self._channel)
        # Admin is not on this socket: `admin` opens the operator socket on first use.
        self._admin_channel: grpc.Channel | None = None
        self._admin: admin_pb2_grpc.AdminStub | None = None
        self._lock = threading.Lock()
        self._session = SessionKeeper(self, _STREAM_CHANNEL_OPTIONS, backoff_initial, backoff_max)
        self._memberships = Memberships()
        # Unpins sent without waiting, until they end: grpc cancels a call whose
        # future is garbage-collected ("Cancelled upon garbage collection!").
        self._unpins_in_flight: set[grpc.Future] = set()

    @property
    def admin_target(self) -> str:
        """The daemon's operator socket: the data socket's path + ".admin" (its default;
        a daemon run with another --admin-socket is reached with an AdminStub of one's
        own). Only Unix-socket targets have one: Admin is never served over TCP."""
        if not self.target.startswith("unix:"):
            raise DepotUnavailable(f"{self.target}: Admin is served on the operator socket only")
        return self.target + ".admin"

    @property
    def admin(self) -> admin_pb2_grpc.AdminStub:
        """An Admin stub on the operator socket (mode 0600 or the operator group: an
        engine that is not the daemon's user or in that group is refused at connect)."""
        with self._lock:
            if self._admin is None:
                self._admin_channel = grpc.insecure_channel(self.admin_target)
                self._admin = admin_pb2_grpc.AdminStub(self._admin_channel)
            return self._admin

    # -- session (kvdepot.client.session) --------------------------------------------

    def start(self) -> DepotClient:
        self._session.start()
        return self

    @property
    def hello(self) -> depot_pb2.SessionHello | None:
        return self._session.hello

    @property
    def keepalive(self) -> depot_pb2.SessionKeepalive | None:
        """The open session's last keepalive (the daemon's pool usage, every few
        seconds); None while disconnected or before the first."""
        return self._session.keepalive

    @property
    def sessions_opened(self) -> int:
        return self._session.sessions_opened

    @property
    def connected(self) -> bool:
        return self._session.connected

    @property
    def session_id(self) -> str:
        session = self._session  # read per job (TransferStream.submit): no extra calls
        hello = session.hello
        if hello is None or not session.connected:
            raise DepotUnavailable(f"not connected to the kvdepot daemon at {self.target}")
        return hello.session_id

    @property
    def boot_id(self) -> str | None:
        return self.hello.boot_id if self.hello else None

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._session.wait_connected(timeout)

    def add_session_listener(self, fn: Callable[[str], None]) -> None:
        """fn(boot_id) after every (re)connect, on the stream loop thread (shared by the
        process's clients): keep it short, never wait for the loop."""
        self._session.add_listener(fn)

    def add_disconnect_listener(self, fn: Callable[[], None]) -> None:
        self._session.add_disconnect_listener(fn)

    def close(self) -> None:
        """Ends the session: the daemon releases everything this client held."""
        self._session.close()
        self._channel.close()
        with self._lock:
            admin_channel, self._admin_channel, self._admin = self._admin_channel, None, None
        if admin_channel is not None:
            admin_channel.close()
        self._session.mark_down()

    # -- namespaces ------------------------------------------------------------------

    def joined(self, namespace_id: str, session_id: str) -> bool:
        """Whether `namespace_id` is joined in session `session_id` (no call)."""
        return self._memberships.joined(namespace_id, session_id)

    def join(self, namespace_id: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Joins `namespace_id` as an observer (a RegisterKV of the id alone: Watch,
        Lookup, Pin, Unpin and Prefetch it; no memory, no Put/Get), unless this
        session joined it already. Remembered: every later session joins it again
        before it is used. `watch`, `lookup`, `pin`, `unpin`, `prefetch` and the
        scheduler's lanes join by themselves; call this only to join early."""
        self._memberships.remember(namespace_id)
        session_id = self.session_id
        if self.joined(namespace_id, session_id):
            return
        observer = depot_pb2.NamespaceLayout(id=namespace_id)
        self.stub.RegisterKV(_register_request(session_id, observer), timeout=timeout)
        self._memberships.mark_joined(session_id, namespace_id)

    async def join_async(
        self, stub: depot_pb2_grpc.DepotStub, session_id: str, namespace_id: str
    ) -> None:
        """`join` on the stream loop (a Watch stream's first step)."""
        self._memberships.remember(namespace_id)
        if not self.joined(namespace_id, session_id):
            observer = depot_pb2.NamespaceLayout(id=namespace_id)
            await stub.RegisterKV(
                _register_request(session_id, observer),
                timeout=self.keepalive_timeout,
                metadata=session_metadata(session_id),
            )
            self._memberships.mark_joined(session_id, namespace_id)

    async def rejoin(self, stub: depot_pb2_grpc.DepotStub, session_id: str) -> None:
        """Joins every remembered namespace in the new session `session_id`."""
        for namespace_id in self._memberships.new_session(session_id):
            try:
                await self.join_async(stub, session_id, namespace_id)
            except grpc.RpcError as exc:  # its calls join again (or say why not)
                log.warning("kvdepot: could not join namespace %s again: %s", namespace_id, exc)

    # -- unary calls -----------------------------------------------------------------

    def register_memory(
        self,
        layout: depot_pb2.NamespaceLayout,
        rank: int,
        regions: Sequence[depot_pb2.MemoryRegion],
        tensors: Sequence[depot_pb2.KVTensor],
        groups: Sequence[depot_pb2.GroupRefs],
        timeout: float = 30.0,
        *,
        session_id: str | None = None,
        units: int = 1,
    ) -> depot_pb2.RegisterKVResponse:
        """Declares `layout` and registers this rank's KV memory, described by
        `regions` (memfd tokens, CUDA IPC handles or process ranges: see
        `register_kv`, kvdepot.client.cuda_ipc, kvdepot.client.pvm). `session_id`:
        the session the regions' fd tokens were made in (default: the current one).
        `units` > 1: the memory stands for ranks [rank, rank + units), each layer's
        pages of one unit after another's (RegisterKVRequest.unit_count).
        A registration is a join: the namespace is joined again in later sessions."""
        session_id = self.session_id if session_id is None else session_id
        request = _register_request(session_id, layout, rank, regions, tensors, groups, units)
        # A registration follows a session, so the daemon is up; but right after it came
        # back this channel may still wait out its reconnect back-off (at most a second)
        # and would fail the call at once with the old error: wait for it instead, within
        # `timeout`.
        resp = self.stub.RegisterKV(request, timeout=timeout, wait_for_ready=True)
        self._memberships.mark_joined(session_id, layout.id)
        return resp

    def register_kv(
        self,
        layout: depot_pb2.NamespaceLayout,
        rank: int,
        shm: SharedKVBuffer | None,
        tensors: Sequence[depot_pb2.KVTensor],
        groups: Sequence[depot_pb2.GroupRefs],
        timeout: float = 30.0,
        units: int = 1,
    ) -> depot_pb2.RegisterKVResponse:
        """Declares `layout` and registers this rank's KV memory (memfd over SCM_RIGHTS;
        `units`: as `register_memory`'s)."""
        session_id = self.session_id
        regions = [] if shm is None else [_shm_region(self.hello, session_id, shm, timeout)]
        return self.register_memory(
            layout, rank, regions, tensors, groups, timeout, session_id=session_id, units=units
        )

    def unregister_kv(self, registration_id: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        sid = self.session_id
        req = depot_pb2.UnregisterKVRequest(session_id=sid, registration_id=registration_id)
        self.stub.UnregisterKV(req, timeout=timeout)

    def lookup(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> list[bool]:
        self.join(namespace_id, timeout)
        req = depot_pb2.LookupRequest(
            session_id=self.session_id, namespace_id=namespace_id, keys=keys
        )
        return list(self.stub.Lookup(req, timeout=timeout).ready)

    def pin(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> list[bool]:
        self.join(namespace_id, timeout)
        req = depot_pb2.PinRequest(session_id=self.session_id, namespace_id=namespace_id, keys=keys)
        return list(self.stub.Pin(req, timeout=timeout).pinned)

    def unpin(
        self,
        namespace_id: str,
        keys: Sequence[bytes],
        timeout: float = DEFAULT_TIMEOUT,
        wait: bool = False,
        touch: Sequence[bytes] = (),
    ) -> None:
        """Drops one pin per key, then makes the READY rows of `touch` (keys finished
        requests used again, each request's as its jobs name them) the most recently
        used. With wait=False it does not block (fire and forget); pins of a session
        that ends are dropped by the daemon anyway."""
        try:
            req = depot_pb2.UnpinRequest(
                session_id=self.session_id, namespace_id=namespace_id, keys=keys, touch_keys=touch
            )
        except DepotUnavailable:
            return  # the daemon dropped our pins with our session
        if not self.joined(namespace_id, req.session_id):
            return  # pins are made in joined namespaces only: none of ours to drop
        if wait:
            self.stub.Unpin(req, timeout=timeout)
            return
        future = self.stub.Unpin.future(req, timeout=timeout)
        in_flight = self._unpins_in_flight  # set.add/discard: atomic under the GIL
        in_flight.add(future)
        future.add_done_callback(in_flight.discard)  # on grpc's thread, or now if done

    def put(
        self,
        namespace_id: str,
        key: bytes,
        rank: int,
        data: bytes,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> depot_pb2.PutResponse:
        """Stores `rank`'s section of `key` inline (Put). A section larger than
        PUT_PART_BYTES goes in parts (PutParts): the daemon takes no request larger
        than its receive limit, a few MiB."""
        head = depot_pb2.PutRequest(
            session_id=self.session_id, namespace_id=namespace_id, key=key, rank=rank
        )
        if len(data) <= PUT_PART_BYTES:
            head.data = data
            return self.stub.Put(head, timeout=timeout)
        view = memoryview(data)

        def parts() -> Iterator[depot_pb2.PutRequest]:
            head.data = bytes(view[:PUT_PART_BYTES])
            yield head
            for at in range(PUT_PART_BYTES, len(view), PUT_PART_BYTES):
                yield depot_pb2.PutRequest(data=bytes(view[at : at + PUT_PART_BYTES]))

        return self.stub.PutParts(parts(), timeout=timeout)

    def get(
        self, namespace_id: str, key: bytes, rank: int, timeout: float = DEFAULT_TIMEOUT
    ) -> bytes:
        sid = self.session_id
        req = depot_pb2.GetRequest(session_id=sid, namespace_id=namespace_id, key=key, rank=rank)
        return self.stub.Get(req, timeout=timeout).data

    def prefetch(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> depot_pb2.PrefetchResponse:
        """Asks the daemon's remote tier for keys that miss locally (Depot/Prefetch)."""
        self.join(namespace_id, timeout)
        sid = self.session_id
        req = depot_pb2.PrefetchRequest(session_id=sid, namespace_id=namespace_id, keys=keys)
        return self.stub.Prefetch(req, timeout=timeout)

    def open_lane(
        self,
        session_id: str,
        fd_token: str,
        kind: depot_pb2.LaneKind,
        timeout: float,
        batched: bool = False,
    ) -> depot_pb2.OpenJobLaneResponse:
        """Attaches the socket the fd socket took as `fd_token` as a lane of `kind`
        (Depot/OpenJobLane; kvdepot.client.job_lane, kvdepot.client.pin_lane);
        `batched`: the caller reads TransferResults datagrams if the daemon says so."""
        req = depot_pb2.OpenJobLaneRequest(
            session_id=session_id, fd_token=fd_token, kind=kind, batched_results=batched
        )
        # Opened as a session starts, as RegisterKV is: wait for the channel's reconnect
        # back-off rather than fail at once with the error from the downtime.
        return self.stub.OpenJobLane(req, timeout=timeout, wait_for_ready=True)

    # -- the streams' calls (opened here for kvdepot.client.session, .watch, and
    # .transfer_stream, which own and read them) ---------------------------------------

    def open_session_call(
        self, stub: depot_pb2_grpc.DepotStub, ticket: str = ""
    ) -> grpc.aio.UnaryStreamCall:
        """The Session call; `ticket` (kvdepot.client.fdpass.ticket_async) makes the
        session this process's from its open."""
        request = depot_pb2.SessionRequest(
            client_name=self.client_name, pid=os.getpid(), engine_id=self.engine_id
        )
        metadata = hello_metadata(request)
        if ticket:
            metadata.append((TICKET_METADATA, ticket))
        return stub.Session(request, metadata=metadata)

    @property
    def fd_socket_guess(self) -> str:
        """The daemon's fd socket before any hello names it: beside a Unix-socket
        target (`<socket>.fd`, as the daemon makes it); "" for TCP."""
        for prefix in ("unix://", "unix:"):
            if self.target.startswith(prefix):
                return self.target[len(prefix) :] + ".fd"
        return ""

    def open_watch_call(
        self,
        stub: depot_pb2_grpc.DepotStub,
        session_id: str,
        namespace_id: str,
        key_events: bool = False,
    ) -> grpc.aio.UnaryStreamCall:
        return stub.Watch(
            depot_pb2.WatchRequest(
                session_id=session_id, namespace_id=namespace_id, key_events=key_events
            ),
            metadata=session_metadata(session_id),
        )

    def open_transfer_call(
        self, requests: Iterator[depot_pb2.TransferJob], session_id: str
    ) -> grpc.Future:  # also an iterator of TransferResults
        return self.stub.Transfer(requests, metadata=session_metadata(session_id))

    # -- streams ---------------------------------------------------------------------

    def watch(
        self,
        namespace_id: str,
        on_event: Callable[[depot_pb2.WatchEvent], None],
        key_events: bool = False,
    ) -> Watch:
        """Follows the namespace's ready keys; see `Watch`. The namespace is joined
        (remembered at once; the join itself is the stream's first step, so this
        never waits on the daemon). `key_events`: STORED and SNAPSHOT events carry
        the stores' chunk events (WatchRequest.key_events)."""
        self._memberships.remember(namespace_id)
        return Watch(self, self._session, namespace_id, on_event, key_events).start()

    def transfer_stream(
        self, job_lane: bool | None = None, *, open_lane_now: bool = True
    ) -> TransferStream:
        """`job_lane`: None follows KVDEPOT_JOB_LANE (default on); see TransferStream.
        `open_lane_now=False`: never wait for the lane here (a daemon that just
        stopped answering would cost up to 0.5 s); it opens in the background."""
        return TransferStream(self, job_lane, open_lane_now=open_lane_now)
