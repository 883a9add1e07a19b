"""A synchronous, thread-safe client for the kvdepot daemon (no vLLM needed).

    client = DepotClient("unix:///run/kvdepot/kvdepot.sock", client_name="my-engine")
    client.start()                       # never raises: reconnects in the background
    client.wait_connected(5.0)
    reg = client.register_kv(layout, rank=0, shm=buf, tensors=[...], groups=[...])
    stream = client.transfer_stream()
    stream.submit(TransferJob(job_id=1, direction=STORE, registration_id=reg.registration_id, ...))
    stream.wait({1}, timeout=5.0); results = stream.poll()

Failure contract (what an engine relies on): calls made while the daemon is
unreachable fail fast with `DepotUnavailable` or a gRPC error within their
deadline; a Transfer stream that breaks answers every job in flight with a
failed result (`error_code="UNAVAILABLE"`); watchers get a reset (forget every
key) when the daemon goes away and a fresh snapshot when it is back. The session
reconnects by itself with backoff; listeners hear about every new session so
they can re-register (registrations die with the daemon).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any

import grpc

from kvdepot.client.fdpass import FdPassError, attest_async, send_fd
from kvdepot.client.job_lane import LaneKeeper
from kvdepot.client.job_lane import enabled_by_env as job_lane_enabled_by_env
from kvdepot.client.shm import SharedKVBuffer
from kvdepot.client.stream_loop import StreamLoop
from kvdepot.v1 import admin_pb2_grpc, depot_pb2, depot_pb2_grpc

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


class DepotUnavailable(RuntimeError):
    """The daemon is not reachable right now (the client keeps reconnecting)."""


def observer_join(session_id: str, namespace_id: str) -> depot_pb2.RegisterKVRequest:
    """An observer join: a RegisterKV naming the namespace id alone and no memory."""
    return depot_pb2.RegisterKVRequest(
        session_id=session_id, namespace=depot_pb2.NamespaceLayout(id=namespace_id)
    )


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
        self._backoff = (backoff_initial, backoff_max)
        # The daemon sends a keepalive every few seconds; a daemon that says nothing
        # for this long is frozen (SIGSTOP, swapping, a hung loop): treat it as gone.
        self.keepalive_timeout = keepalive_timeout
        self._channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self.stub = depot_pb2_grpc.DepotStub(self._channel)
        # Admin is not on this socket: `admin` opens the operator socket on first use.
        self._admin_channel: grpc.Channel | None = None
        self._admin: admin_pb2_grpc.AdminStub | None = None
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._closed = threading.Event()
        self.hello: depot_pb2.SessionHello | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._disconnect_listeners: list[Callable[[], None]] = []
        # Session and Watch run on the process's stream loop (kvdepot.client.stream_loop),
        # on a channel of their own opened by start() or the first watch();
        # `_session_ready` mirrors `_connected` there; `_stream_tasks` are this
        # client's tasks on the loop, ended by close().
        self._stream_channel: grpc.aio.Channel | None = None
        self._stream_stub: depot_pb2_grpc.DepotStub | None = None
        self._session_ready: asyncio.Event | None = None
        self._session_task: asyncio.Task[None] | None = None
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self._start_lock = threading.Lock()
        self._session_starting = False
        self.sessions_opened = 0
        # Namespaces are joined, not named (the daemon refuses calls naming others):
        # every namespace this client joined (a registration or an observer join),
        # joined again in each new session before the session is used; and those
        # joined in the current session (`_joined_in`).
        self._namespaces: dict[str, None] = {}  # ordered set
        self._joined: set[str] = set()
        self._joined_in = ""

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

    # -- session ---------------------------------------------------------------------

    def start(self) -> DepotClient:
        with self._start_lock:
            if self._session_task is not None or self._session_starting or self._closed.is_set():
                return self
            self._session_starting = True
        try:
            task = self._start_stream(self._session_loop())
        except DepotUnavailable:  # closed meanwhile
            task = None
        with self._start_lock:
            self._session_starting = False
            if not self._closed.is_set():
                self._session_task = task
        return self

    def _start_stream(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Runs `coro` on the stream loop, with the stream channel opened first if
        need be; None where no stream can run (a process forked with streams open:
        kvdepot.client.stream_loop). `_start_lock` is never held while this waits for
        the loop: a session listener runs on the loop, and may start a stream of this
        client too."""
        streams = StreamLoop.shared()
        if not streams.usable:
            coro.close()
            return None
        with self._start_lock:
            need_channel = self._stream_channel is None and not self._closed.is_set()
        if need_channel:
            channel: grpc.aio.Channel | None = streams.open_channel(
                self.target, _STREAM_CHANNEL_OPTIONS
            )
            with self._start_lock:
                if self._stream_channel is None and not self._closed.is_set():
                    self._stream_channel, channel = channel, None
                    self._stream_stub = depot_pb2_grpc.DepotStub(self._stream_channel)
                    self._session_ready = asyncio.Event()
            if channel is not None:  # another thread's won, or the client closed meanwhile
                streams.close_channel(channel, ())
        with self._start_lock:
            if self._closed.is_set():
                coro.close()
                raise DepotUnavailable("this client is closed")
        task = streams.start(coro)
        with self._start_lock:
            if not self._closed.is_set():
                self._stream_tasks.add(task)
                return task
        streams.stop(task)  # close() came while the task was being made
        raise DepotUnavailable("this client is closed")

    def _stop_stream(self, task: asyncio.Task[None]) -> None:
        with self._start_lock:
            if task not in self._stream_tasks:
                return  # close() ended it
            self._stream_tasks.discard(task)
        StreamLoop.shared().stop(task)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def session_id(self) -> str:
        hello = self.hello
        if hello is None or not self.connected:
            raise DepotUnavailable(f"not connected to the kvdepot daemon at {self.target}")
        return hello.session_id

    @property
    def boot_id(self) -> str | None:
        return self.hello.boot_id if self.hello else None

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def add_session_listener(self, fn: Callable[[str], None]) -> None:
        """fn(boot_id) after every (re)connect, on the session thread. Keep it short."""
        with self._lock:
            self._listeners.append(fn)
        if self.connected and self.hello is not None:
            fn(self.hello.boot_id)

    def add_disconnect_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._disconnect_listeners.append(fn)

    async def _session_loop(self) -> None:
        """Keeps a Session open (on the stream loop); a daemon that sends nothing, not
        even its keepalive, for `keepalive_timeout` is frozen (SIGSTOP, swapping, a hung
        loop) and is treated as gone."""
        stub, ready = self._stream_stub, self._session_ready
        assert stub is not None and ready is not None
        delay = self._backoff[0]
        while True:
            call = stub.Session(
                depot_pb2.SessionRequest(
                    client_name=self.client_name, pid=os.getpid(), engine_id=self.engine_id
                )
            )
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(call.read(), self.keepalive_timeout)
                    except TimeoutError:
                        log.warning(
                            "the kvdepot daemon at %s sent nothing for %.1f s; dropping the "
                            "session",
                            self.target,
                            self.keepalive_timeout,
                        )
                        break
                    if event is grpc.aio.EOF:
                        break
                    if event.HasField("hello"):
                        if not await self._attest(event.hello):
                            break  # the daemon refused this process the session: retry
                        # Before anyone sees the session: Watch streams and lanes
                        # restart in it only once their namespaces are joined again.
                        await self._rejoin(stub, event.hello.session_id)
                        delay = self._backoff[0]
                        self._opened(event.hello)
            except grpc.RpcError as exc:
                log.debug("kvdepot session ended: %s", exc.code())
            finally:
                call.cancel()
                # A cancelled task keeps this frame (in its exception's traceback):
                # let go of the call, which holds the connection open.
                del call
                was_connected = self._connected.is_set()
                self._connected.clear()
                ready.clear()
                if was_connected and not self._closed.is_set():
                    log.warning("lost the kvdepot daemon at %s; reconnecting", self.target)
                    for fn in list(self._disconnect_listeners):
                        self._call_listener(fn)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._backoff[1])

    async def _attest(self, hello: depot_pb2.SessionHello) -> bool:
        """Binds the new session to this process on the fd socket (kvdepot.client.fdpass),
        before anyone uses it; False when the daemon refused (the session is ended)."""
        if not hello.fd_socket:
            return True
        try:
            await attest_async(hello.fd_socket, hello.session_id, self.keepalive_timeout)
        except FdPassError as exc:
            if exc.code in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED"):
                log.warning("kvdepot daemon at %s refused the session: %s", self.target, exc)
                return False
            # An older daemon (no attest) or a busy one: the first fd attests instead.
            log.info("kvdepot session %s not attested (%s)", hello.session_id[:8], exc)
        return True

    def _opened(self, hello: depot_pb2.SessionHello) -> None:
        assert self._session_ready is not None
        previous = self.hello.boot_id if self.hello else None
        self.hello = hello
        self.sessions_opened += 1
        self._connected.set()
        self._session_ready.set()
        if previous is not None and previous != hello.boot_id:
            log.warning("kvdepot daemon restarted (boot id %s -> %s)", previous, hello.boot_id)
        log.info("kvdepot session %s… open", hello.session_id[:8])  # the id is a secret
        for fn in list(self._listeners):
            self._call_listener(fn, hello.boot_id)

    @staticmethod
    def _call_listener(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("kvdepot session listener failed")

    def close(self) -> None:
        """Ends the session: the daemon releases everything this client held."""
        with self._start_lock:
            self._closed.set()
            # Dropped here: a finished task (and the stub) would keep the calls, and
            # with them the connection, for as long as this object lives.
            channel, self._stream_channel = self._stream_channel, None
            tasks, self._stream_tasks = self._stream_tasks, set()
            self._stream_stub = self._session_task = None
        if channel is not None:
            # Ends the Session, which the daemon sees at once.
            StreamLoop.shared().close_channel(channel, tasks)
        self._channel.close()
        with self._lock:
            admin_channel, self._admin_channel, self._admin = self._admin_channel, None, None
        if admin_channel is not None:
            admin_channel.close()
        self._connected.clear()

    # -- namespaces ------------------------------------------------------------------

    def joined(self, namespace_id: str, session_id: str) -> bool:
        """Whether `namespace_id` is joined in session `session_id` (no call)."""
        with self._lock:
            return self._joined_in == session_id and namespace_id in self._joined

    def _mark_joined(self, session_id: str, namespace_id: str) -> None:
        with self._lock:
            self._namespaces[namespace_id] = None
            if self._joined_in == session_id:  # not a late answer in an older session
                self._joined.add(namespace_id)

    def join(self, namespace_id: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Joins `namespace_id` as an observer (a RegisterKV of the id alone: Watch,
        Lookup, Pin, Unpin and Prefetch it; no memory, no Put/Get), unless this
        session joined it already. Remembered: every later session joins it again
        before it is used. `watch`, `lookup`, `pin`, `unpin`, `prefetch` and the
        scheduler's lanes join by themselves; call this only to join early."""
        with self._lock:
            self._namespaces[namespace_id] = None
        session_id = self.session_id
        if self.joined(namespace_id, session_id):
            return
        self.stub.RegisterKV(observer_join(session_id, namespace_id), timeout=timeout)
        self._mark_joined(session_id, namespace_id)

    async def _join_async(
        self, stub: depot_pb2_grpc.DepotStub, session_id: str, namespace_id: str
    ) -> None:
        """`join` on the stream loop (a Watch stream's first step)."""
        with self._lock:
            self._namespaces[namespace_id] = None
        if not self.joined(namespace_id, session_id):
            await stub.RegisterKV(
                observer_join(session_id, namespace_id), timeout=self.keepalive_timeout
            )
            self._mark_joined(session_id, namespace_id)

    async def _rejoin(self, stub: depot_pb2_grpc.DepotStub, session_id: str) -> None:
        """Joins every remembered namespace in the new session `session_id`."""
        with self._lock:
            self._joined_in, self._joined = session_id, set()
            namespaces = list(self._namespaces)
        for namespace_id in namespaces:
            try:
                await self._join_async(stub, session_id, namespace_id)
            except grpc.RpcError as exc:  # its calls join again (or say why not)
                log.warning("kvdepot: could not join namespace %s again: %s", namespace_id, exc)

    # -- unary calls -----------------------------------------------------------------

    def register_kv(
        self,
        layout: depot_pb2.NamespaceLayout,
        rank: int,
        shm: SharedKVBuffer | None,
        tensors: Sequence[depot_pb2.KVTensor],
        groups: Sequence[depot_pb2.GroupRefs],
        timeout: float = 30.0,
    ) -> depot_pb2.RegisterKVResponse:
        """Declares `layout` and registers this rank's KV memory (memfd over SCM_RIGHTS)."""
        session_id = self.session_id
        regions = []
        if shm is not None:
            assert self.hello is not None
            if not self.hello.fd_socket:
                raise DepotUnavailable("the daemon takes no fds (no fd socket)")
            token = send_fd(self.hello.fd_socket, session_id, shm.fd, timeout=timeout)
            regions.append(
                depot_pb2.MemoryRegion(
                    shm=depot_pb2.SharedMemoryHandle(fd_token=token, size=shm.size)
                )
            )
        resp = self.stub.RegisterKV(
            depot_pb2.RegisterKVRequest(
                session_id=session_id,
                namespace=layout,
                rank=rank,
                regions=regions,
                tensors=tensors,
                groups=groups,
            ),
            timeout=timeout,
        )
        self._mark_joined(session_id, layout.id)  # a registration is a join
        return resp

    def unregister_kv(self, registration_id: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.stub.UnregisterKV(
            depot_pb2.UnregisterKVRequest(
                session_id=self.session_id, registration_id=registration_id
            ),
            timeout=timeout,
        )

    def lookup(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> list[bool]:
        self.join(namespace_id, timeout)
        resp = self.stub.Lookup(
            depot_pb2.LookupRequest(
                session_id=self.session_id, namespace_id=namespace_id, keys=keys
            ),
            timeout=timeout,
        )
        return list(resp.ready)

    def pin(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> list[bool]:
        self.join(namespace_id, timeout)
        resp = self.stub.Pin(
            depot_pb2.PinRequest(session_id=self.session_id, namespace_id=namespace_id, keys=keys),
            timeout=timeout,
        )
        return list(resp.pinned)

    def unpin(
        self,
        namespace_id: str,
        keys: Sequence[bytes],
        timeout: float = DEFAULT_TIMEOUT,
        wait: bool = False,
    ) -> None:
        """Drops one pin per key. With wait=False it does not block (fire and forget);
        pins of a session that ends are dropped by the daemon anyway."""
        try:
            req = depot_pb2.UnpinRequest(
                session_id=self.session_id, namespace_id=namespace_id, keys=keys
            )
        except DepotUnavailable:
            return  # the daemon dropped our pins with our session
        if not self.joined(namespace_id, req.session_id):
            return  # pins are made in joined namespaces only: none of ours to drop
        if wait:
            self.stub.Unpin(req, timeout=timeout)
        else:
            self.stub.Unpin.future(req, timeout=timeout)

    def put(
        self,
        namespace_id: str,
        key: bytes,
        rank: int,
        data: bytes,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> depot_pb2.PutResponse:
        return self.stub.Put(
            depot_pb2.PutRequest(
                session_id=self.session_id, namespace_id=namespace_id, key=key, rank=rank, data=data
            ),
            timeout=timeout,
        )

    def get(
        self, namespace_id: str, key: bytes, rank: int, timeout: float = DEFAULT_TIMEOUT
    ) -> bytes:
        resp = self.stub.Get(
            depot_pb2.GetRequest(
                session_id=self.session_id, namespace_id=namespace_id, key=key, rank=rank
            ),
            timeout=timeout,
        )
        return resp.data

    def prefetch(
        self, namespace_id: str, keys: Sequence[bytes], timeout: float = DEFAULT_TIMEOUT
    ) -> depot_pb2.PrefetchResponse:
        """Asks the daemon's remote tier for keys that miss locally (Depot/Prefetch)."""
        self.join(namespace_id, timeout)
        return self.stub.Prefetch(
            depot_pb2.PrefetchRequest(
                session_id=self.session_id, namespace_id=namespace_id, keys=keys
            ),
            timeout=timeout,
        )

    # -- streams ---------------------------------------------------------------------

    def watch(self, namespace_id: str, on_event: Callable[[depot_pb2.WatchEvent], None]) -> Watch:
        """Follows the namespace's ready keys; see `Watch`. The namespace is joined
        (remembered at once; the join itself is the stream's first step, so this
        never waits on the daemon)."""
        with self._lock:
            self._namespaces[namespace_id] = None
        return Watch(self, namespace_id, on_event).start()

    def transfer_stream(
        self, job_lane: bool | None = None, *, open_lane_now: bool = True
    ) -> TransferStream:
        """`job_lane`: None follows KVDEPOT_JOB_LANE (default on); see TransferStream.
        `open_lane_now=False`: never wait for the lane here (a daemon that just
        stopped answering would cost up to 0.5 s); it opens in the background."""
        return TransferStream(self, job_lane, open_lane_now=open_lane_now)


class Watch:
    """A background subscription to a namespace's ready keys.

    `on_event` gets the daemon's WatchEvents (a SNAPSHOT with reset=True, more
    SNAPSHOT parts, SNAPSHOT_END, then STORED/REMOVED deltas). When the daemon
    goes away it gets a synthetic SNAPSHOT with reset=True and no keys (forget
    everything), and after a reconnect a fresh snapshot.
    """

    def __init__(
        self,
        client: DepotClient,
        namespace_id: str,
        on_event: Callable[[depot_pb2.WatchEvent], None],
    ) -> None:
        self.client = client
        self.namespace_id = namespace_id
        self.on_event = on_event
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Watch:
        self._task = self.client._start_stream(self._run())
        return self

    async def _run(self) -> None:
        client = self.client
        ready, stub = client._session_ready, client._stream_stub
        assert ready is not None and stub is not None
        while True:
            await ready.wait()
            call = None
            try:
                session_id = client.session_id
                await client._join_async(stub, session_id, self.namespace_id)
                call = stub.Watch(
                    depot_pb2.WatchRequest(session_id=session_id, namespace_id=self.namespace_id)
                )
                async for event in call:
                    self.on_event(event)
            except (grpc.RpcError, DepotUnavailable):
                pass
            except Exception:
                log.exception("kvdepot watch handler failed; resubscribing")
            finally:
                if call is not None:
                    call.cancel()
                call = None  # as in DepotClient._session_loop
            self.on_event(depot_pb2.WatchEvent(kind=depot_pb2.WatchEvent.SNAPSHOT, reset=True))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        """Ends the subscription; `on_event` is not called once this returns."""
        task, self._task = self._task, None
        if task is not None:
            self.client._stop_stream(task)


_STREAM_END = object()


class TransferStream:
    """One bidirectional Transfer stream: submit jobs, collect results.

    `submit` never blocks. Results are kept until `poll` takes them; `wait`
    blocks until the named jobs have results (or the timeout passes). When the
    stream breaks, every job in flight gets a failed result; the next `submit`
    opens a new stream.

    Where the daemon offers one, jobs go on a job lane instead (kvdepot.client.job_lane:
    a Unix socket pair, the same messages, no gRPC and no thread hand-off on the
    way out), opened with the stream (or in the background when the client was not
    connected yet, or after a break); until it is open, for jobs that do not fit
    in a datagram, and with `job_lane=False` or KVDEPOT_JOB_LANE=0, they go on the
    gRPC stream. A lane that breaks fails its jobs in flight like a broken stream.
    """

    def __init__(
        self, client: DepotClient, job_lane: bool | None = None, *, open_lane_now: bool = True
    ) -> None:
        self.client = client
        self._lock = threading.Condition()
        # job id -> generation: > 0 a gRPC stream's, < 0 a lane's (LaneKeeper)
        self._inflight: dict[int, int] = {}
        self._done: dict[int, depot_pb2.TransferResult] = {}
        self._requests: queue.SimpleQueue[object] | None = None
        self._call: grpc.Future | None = None
        self._generation = 0
        wanted = job_lane_enabled_by_env() if job_lane is None else job_lane
        self._lanes = LaneKeeper(client, self._lock, wanted, self._lane_result, self._lane_broke)
        # Connected: open the lane now (a few ms, once) so that every job takes it;
        # later (re)opens happen in the background while jobs use the gRPC stream.
        self._lanes.maybe_open(background=not open_lane_now)

    @property
    def uses_lane(self) -> bool:
        """True while jobs go on a job lane (informational; results arrive alike)."""
        with self._lock:
            return self._lanes.lane is not None

    def _lane_result(self, result: depot_pb2.TransferResult, generation: int) -> None:
        # A job aborted meanwhile already has its (CANCELLED) result.
        if self._inflight.get(result.job_id) == generation:
            del self._inflight[result.job_id]
            self._done[result.job_id] = result
            self._lock.notify_all()

    def _lane_broke(self, generation: int, error: str) -> None:
        for job_id, gen in list(self._inflight.items()):
            if gen == generation:
                self._fail(job_id, error)
        self._lock.notify_all()

    # -- the gRPC stream ---------------------------------------------------------------

    def _requests_iter(self, q: queue.SimpleQueue[object]) -> Iterator[depot_pb2.TransferJob]:
        while True:
            item = q.get()
            if item is _STREAM_END:
                return
            yield item  # type: ignore[misc]

    def _open(self) -> queue.SimpleQueue[object]:
        q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._generation += 1
        generation = self._generation
        call = self._call = self.client.stub.Transfer(self._requests_iter(q))
        threading.Thread(
            target=self._read, args=(call, q, generation), name="kvdepot-transfer", daemon=True
        ).start()
        return q

    def _read(
        self,
        call: Iterable[depot_pb2.TransferResult],
        q: queue.SimpleQueue[object],
        generation: int,
    ) -> None:
        error = "the Transfer stream ended"
        try:
            for result in call:
                with self._lock:
                    self._inflight.pop(result.job_id, None)
                    self._done[result.job_id] = result
                    self._lock.notify_all()
        except grpc.RpcError as exc:
            error = f"the Transfer stream broke: {exc.code() if hasattr(exc, 'code') else exc}"
        with self._lock:
            if self._requests is q:
                self._requests = None
            # Only this generation's jobs were on the broken stream.
            for job_id, gen in list(self._inflight.items()):
                if gen == generation:
                    self._fail(job_id, error)
            self._lock.notify_all()
        q.put(_STREAM_END)  # ends the request-iterator thread gRPC runs

    def _fail(self, job_id: int, error: str, code: str = "UNAVAILABLE") -> None:
        self._inflight.pop(job_id, None)
        self._done[job_id] = depot_pb2.TransferResult(
            job_id=job_id, success=False, error=error, error_code=code
        )

    def abort(self, reason: str = "aborted by the client") -> None:
        """Cancels the stream: every job in flight fails now (error_code CANCELLED).

        The daemon skips the cancelled jobs it has not started; a copy already
        running cannot be stopped and finishes in the daemon, so memory a LOAD
        targets must not be handed out again unless the daemon is known to be
        frozen or gone. The next `submit` opens a new stream (and lane).
        """
        with self._lock:
            call, self._call = self._call, None
            requests, self._requests = self._requests, None
            self._lanes.cancel()
            for job_id in list(self._inflight):
                self._fail(job_id, reason, "CANCELLED")
            self._lock.notify_all()
        if requests is not None:
            requests.put(_STREAM_END)
        if call is not None:
            call.cancel()

    def submit(self, job: depot_pb2.TransferJob) -> None:
        with self._lock:
            if job.job_id in self._inflight or job.job_id in self._done:
                raise ValueError(f"job id {job.job_id} is already in use on this stream")
            try:
                if not job.session_id:
                    job.session_id = self.client.session_id
                if self._lanes.send(job):
                    self._inflight[job.job_id] = self._lanes.generation
                    return
                if self._requests is None:
                    self._requests = self._open()
            except (DepotUnavailable, grpc.RpcError, ValueError) as exc:
                self._fail(job.job_id, f"kvdepot daemon unavailable: {exc}")
                self._lock.notify_all()
                return
            self._inflight[job.job_id] = self._generation
            self._requests.put(job)

    def poll(self) -> list[depot_pb2.TransferResult]:
        with self._lock:
            done, self._done = list(self._done.values()), {}
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Blocks until every job in `job_ids` has a result; False on timeout."""
        ids = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                missing = {j for j in ids if j not in self._done}
                if not missing:
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._lock.wait(remaining)

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Ends the stream (and lane): the daemon answers the jobs it has, then closes."""
        with self._lock:
            self._lanes.finish()
            if self._requests is not None:
                self._requests.put(_STREAM_END)
                self._requests = None
