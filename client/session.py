"""`SessionKeeper`: one DepotClient's Session, kept open and reopened on the stream loop.

A `DepotClient` owns one keeper. The keeper owns the client's `grpc.aio` channel (made
on the process's stream loop, kvdepot.client.stream_loop, on first use), the tasks this
client runs there (the Session loop and its Watch streams, kvdepot.client.watch), and
what the Session says: `hello`, `keepalive` (the last one: the pool's usage),
`connected`, `sessions_opened`, and
`DepotUnavailable`, what a call raises while there is none. Beside it, `Memberships`:
the namespaces the client joined, joined again in every new session. It calls the session
listeners after every (re)connect and the disconnect listeners after every loss. The
calls themselves are the client's (`DepotClient` is the one place RPCs are made): the
keeper asks it to open the Session stream and to join its namespaces again, and binds
each new session to this process on the fd socket (kvdepot.client.fdpass) before
anyone sees it.

Threads:
- `start`, `start_stream`, `stop_stream`, `close`, `wait_connected` and the properties:
  any thread. `_start_lock` is never held while they wait for the loop: a session
  listener runs on the loop and may start a stream of this client (a Watch), and with
  the lock held across that wait the two threads deadlocked.
- The Session loop, `ready` and every listener: the loop thread, shared by every client
  of the process, so listeners must be short and never wait for the loop.
- Fork: in a child forked while its parent had streams open the loop is not usable:
  `start_stream` runs nothing there and the client stays down (every call fails fast
  with DepotUnavailable) instead of hanging (docs/architecture.md §3, 'Fork').
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import grpc

from kvdepot.client.fdpass import FdPassError, attest_async, ticket_async
from kvdepot.client.stream_loop import StreamLoop
from kvdepot.common.backoff import Backoff
from kvdepot.v1 import depot_pb2, depot_pb2_grpc

log = logging.getLogger("kvdepot.client")


class DepotUnavailable(RuntimeError):
    """The daemon is not reachable right now (the client keeps reconnecting)."""


class Memberships:
    """The namespaces a client joined: every one it ever joined (a registration or an
    observer join), which each new session joins again before it is used, and those
    joined in the current session. Namespaces are joined, not named: the daemon
    refuses calls naming others. Any thread, and the loop (its own lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._remembered: dict[str, None] = {}  # ordered set
        self._joined: set[str] = set()
        self._joined_in = ""

    def remember(self, namespace_id: str) -> None:
        with self._lock:
            self._remembered[namespace_id] = None

    def joined(self, namespace_id: str, session_id: str) -> bool:
        with self._lock:
            return self._joined_in == session_id and namespace_id in self._joined

    def mark_joined(self, session_id: str, namespace_id: str) -> None:
        with self._lock:
            self._remembered[namespace_id] = None
            if self._joined_in == session_id:  # not a late answer in an older session
                self._joined.add(namespace_id)

    def new_session(self, session_id: str) -> list[str]:
        """Forgets the joins of the last session; returns every namespace to join again."""
        with self._lock:
            self._joined_in, self._joined = session_id, set()
            return list(self._remembered)


class SessionOwner(Protocol):
    """What a keeper asks of its client (DepotClient, which makes every RPC): the
    calls below run on the stream loop thread."""

    target: str
    keepalive_timeout: float

    @property
    def fd_socket_guess(self) -> str: ...

    def open_session_call(
        self, stub: depot_pb2_grpc.DepotStub, ticket: str = ""
    ) -> grpc.aio.UnaryStreamCall: ...

    async def rejoin(self, stub: depot_pb2_grpc.DepotStub, session_id: str) -> None: ...


class SessionKeeper:
    """The Session stream of one client and the client's tasks on the stream loop."""

    def __init__(
        self,
        client: SessionOwner,
        channel_options: Sequence[tuple[str, Any]],
        backoff_initial: float,
        backoff_max: float,
    ) -> None:
        self._client = client
        self._channel_options = tuple(channel_options)
        self._backoff = (backoff_initial, backoff_max)
        self.hello: depot_pb2.SessionHello | None = None
        # The last keepalive of the open session (None until one came): replaced whole
        # on the loop thread, read from any.
        self.keepalive: depot_pb2.SessionKeepalive | None = None
        self.sessions_opened = 0
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._listeners_lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []
        self._disconnect_listeners: list[Callable[[], None]] = []
        # Made by the first start_stream, under `_start_lock`: the channel, its stub
        # and `ready`, which mirrors `connected` on the loop. `_tasks` are this
        # client's tasks on the loop, ended by close().
        self._start_lock = threading.Lock()
        self._channel: grpc.aio.Channel | None = None
        self.stub: depot_pb2_grpc.DepotStub | None = None
        self.ready: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._session_task: asyncio.Task[None] | None = None
        self._starting = False

    # -- state -----------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        return self._connected.wait(timeout)

    def add_listener(self, fn: Callable[[str], None]) -> None:
        """fn(boot_id) after every (re)connect, on the loop thread; at once if connected."""
        with self._listeners_lock:
            self._listeners.append(fn)
        if self.connected and self.hello is not None:
            fn(self.hello.boot_id)

    def add_disconnect_listener(self, fn: Callable[[], None]) -> None:
        with self._listeners_lock:
            self._disconnect_listeners.append(fn)

    # -- tasks on the stream loop ----------------------------------------------------

    def start(self) -> None:
        """Starts the Session loop (once; never raises, never waits for the daemon)."""
        with self._start_lock:
            if self._session_task is not None or self._starting or self._closed.is_set():
                return
            self._starting = True
        try:
            task = self.start_stream(self._run())
        except DepotUnavailable:  # closed meanwhile
            task = None
        with self._start_lock:
            self._starting = False
            if not self._closed.is_set():
                self._session_task = task

    def start_stream(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Runs `coro` on the stream loop, with the channel opened first if need be;
        None where no stream can run (a forked process). Raises DepotUnavailable once
        the client is closed. Never holds `_start_lock` while it waits for the loop."""
        streams = StreamLoop.shared()
        if not streams.usable:
            coro.close()
            return None
        with self._start_lock:
            need_channel = self._channel is None and not self._closed.is_set()
        if need_channel:
            channel: grpc.aio.Channel | None = streams.open_channel(
                self._client.target, self._channel_options
            )
            with self._start_lock:
                if self._channel is None and not self._closed.is_set():
                    self._channel, channel = channel, None
                    self.stub = depot_pb2_grpc.DepotStub(self._channel)
                    self.ready = asyncio.Event()
            if channel is not None:  # another thread's won, or the client closed meanwhile
                streams.close_channel(channel, ())
        with self._start_lock:
            if self._closed.is_set():
                coro.close()
                raise DepotUnavailable("this client is closed")
        task = streams.start(coro)
        with self._start_lock:
            if not self._closed.is_set():
                self._tasks.add(task)
                return task
        streams.stop(task)  # close() came while the task was being made
        raise DepotUnavailable("this client is closed")

    def stop_stream(self, task: asyncio.Task[None]) -> None:
        with self._start_lock:
            if task not in self._tasks:
                return  # close() ended it
            self._tasks.discard(task)
        StreamLoop.shared().stop(task)

    def close(self) -> None:
        """Ends the Session (the daemon sees it at once) and every stream of the client."""
        with self._start_lock:
            self._closed.set()
            # Dropped here: a finished task (and the stub) would keep the calls, and
            # with them the connection, for as long as this object lives.
            channel, self._channel = self._channel, None
            tasks, self._tasks = self._tasks, set()
            self.stub = self._session_task = None
        if channel is not None:
            StreamLoop.shared().close_channel(channel, tasks)

    def mark_down(self) -> None:
        """After close(): the client reads as disconnected."""
        self._connected.clear()

    # -- the Session loop (on the stream loop) -----------------------------------------

    async def _run(self) -> None:
        """Keeps a Session open; a daemon that sends nothing, not even its keepalive,
        for `keepalive_timeout` is frozen (SIGSTOP, swapping, a hung loop) and is
        treated as gone."""
        client = self._client
        stub, ready = self.stub, self.ready
        assert stub is not None and ready is not None
        backoff = Backoff(*self._backoff, jitter=True)
        while True:
            call = client.open_session_call(stub, await self._ticket())
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(call.read(), client.keepalive_timeout)
                    except TimeoutError:
                        log.warning(
                            "the kvdepot daemon at %s sent nothing for %.1f s; dropping the "
                            "session",
                            client.target,
                            client.keepalive_timeout,
                        )
                        break
                    if event is grpc.aio.EOF:
                        break
                    if event.HasField("hello"):
                        if not await self._attest(event.hello):
                            break  # the daemon refused this process the session: retry
                        # Before anyone sees the session: Watch streams and lanes
                        # restart in it only once their namespaces are joined again.
                        await client.rejoin(stub, event.hello.session_id)
                        backoff.reset()
                        self._opened(event.hello)
                    elif event.HasField("keepalive"):
                        self.keepalive = event.keepalive
            except grpc.RpcError as exc:
                log.debug("kvdepot session ended: %s", exc.code())
            finally:
                call.cancel()
                # A cancelled task keeps this frame (in its exception's traceback):
                # let go of the call, which holds the connection open.
                del call
                was_connected = self._connected.is_set()
                self._connected.clear()
                self.keepalive = None
                ready.clear()
                if was_connected and not self._closed.is_set():
                    log.warning("lost the kvdepot daemon at %s; reconnecting", client.target)
                    for fn in list(self._disconnect_listeners):
                        self._call_listener(fn)
            await asyncio.sleep(backoff.next_delay())

    async def _ticket(self) -> str:
        """A ticket from the fd socket (the last hello's, else the one beside the
        target) so the session is this process's from its open; "" when there is
        none to be had (TCP, an older daemon): the session then attests after."""
        client = self._client
        path = self.hello.fd_socket if self.hello is not None else client.fd_socket_guess
        if not path:
            return ""
        try:
            return await ticket_async(path, client.keepalive_timeout)
        except FdPassError as exc:
            log.debug("kvdepot session ticket not had (%s)", exc)
            return ""

    async def _attest(self, hello: depot_pb2.SessionHello) -> bool:
        """Binds the new session to this process on the fd socket (kvdepot.client.fdpass),
        before anyone uses it; False when the daemon refused (the session is ended)."""
        if not hello.fd_socket:
            return True
        client = self._client
        try:
            await attest_async(hello.fd_socket, hello.session_id, client.keepalive_timeout)
        except FdPassError as exc:
            if exc.code in ("PERMISSION_DENIED", "RESOURCE_EXHAUSTED"):
                log.warning("kvdepot daemon at %s refused the session: %s", client.target, exc)
                return False
            # An older daemon (no attest) or a busy one: the first fd attests instead.
            log.info("kvdepot session %s not attested (%s)", hello.session_id[:8], exc)
        return True

    def _opened(self, hello: depot_pb2.SessionHello) -> None:
        assert self.ready is not None
        previous = self.hello.boot_id if self.hello else None
        self.hello = hello
        self.sessions_opened += 1
        self._connected.set()
        self.ready.set()
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
