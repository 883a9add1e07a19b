"""The client's end of a job lane: Transfer jobs as datagrams on a Unix socket pair.

`ClientLane.open(client)` makes `socketpair(AF_UNIX, SOCK_SEQPACKET)`, sends one
end to the daemon's fd socket (kvdepot.client.fdpass) and attaches it with
Depot/OpenJobLane. Then one datagram is one serialized TransferJob (sent from
the caller's thread, never blocking) and one datagram back one serialized
TransferResults: every result the daemon had ready for the lane at one turn of its
loop (asked for with OpenJobLaneRequest.batched_results; a daemon that does not
say it batches sends one TransferResult a datagram, read as such). The reader
thread files a datagram's results under one lock hold. `TransferStream` uses a
lane when it can and the gRPC stream otherwise; see
kvdepot.server.service.job_lane for the daemon's side.

Set KVDEPOT_JOB_LANE=0 in the environment (or pass `job_lane=False` to
DepotClient) to keep every job on the gRPC stream.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from kvdepot.client.fdpass import FdPassError, send_fd
from kvdepot.client.job_codec import result_from_bytes, results_from_bytes
from kvdepot.common.jobs import JobResult
from kvdepot.common.lane_protocol import ClientLaneProtocol, JobCalls, LaneOpening
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.client")

ENV = "KVDEPOT_JOB_LANE"
# Socket buffers: a 1024-key job (~50 KiB) fits many times over. The kernel caps
# them at net.core.{w,r}mem_max; a job larger than what it allows goes on gRPC.
BUFFER_BYTES = 4 << 20
OPEN_TIMEOUT = 5.0  # in the background
# The first open runs inside transfer_stream(), maybe on an engine's hot path (a new
# stream after the daemon stopped answering): a healthy daemon needs a few ms.
SYNC_OPEN_TIMEOUT = 0.5


def enabled_by_env() -> bool:
    """False when KVDEPOT_JOB_LANE is 0/false/no/off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class LaneOwner(Protocol):
    """What a lane asks of its client (DepotClient, which makes every RPC); any thread."""

    @property
    def hello(self) -> depot_pb2.SessionHello | None: ...

    @property
    def connected(self) -> bool: ...

    @property
    def session_id(self) -> str: ...

    def open_lane(
        self,
        session_id: str,
        fd_token: str,
        kind: depot_pb2.LaneKind,
        timeout: float,
        batched: bool = False,
    ) -> depot_pb2.OpenJobLaneResponse: ...


class LaneUnavailable(RuntimeError):
    """No lane now. `permanent`: the daemon has none (older daemon, no fd socket), or
    the client closed."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class ClientLane:
    """An attached lane: the socket adapter over its `protocol` (a job lane's JobCalls,
    an unpin lane's ClientLaneProtocol, or the pin lane's PinCalls), which says what
    may go and what came. `send` from any thread; `recv` from one reader thread."""

    def __init__(
        self,
        sock: socket.socket,
        lane_id: int,
        max_job_bytes: int,
        batched: bool = False,
        kind: depot_pb2.LaneKind = depot_pb2.LANE_TRANSFER_JOBS,
    ) -> None:
        self.sock = sock
        self.lane_id = lane_id
        self.max_job_bytes = max_job_bytes
        # `batched`: the daemon sends TransferResults datagrams (it said so at the open).
        self.protocol: ClientLaneProtocol = (
            JobCalls(max_job_bytes, batched, result_from_bytes, results_from_bytes)
            if kind == depot_pb2.LANE_TRANSFER_JOBS
            else ClientLaneProtocol(max_job_bytes)
        )

    @classmethod
    def open(
        cls,
        client: LaneOwner,
        session_id: str,
        timeout: float = OPEN_TIMEOUT,
        kind: depot_pb2.LaneKind = depot_pb2.LANE_TRANSFER_JOBS,
    ) -> ClientLane:
        hello = client.hello
        if hello is None or not hello.fd_socket:
            raise LaneUnavailable("the daemon takes no fds (no fd socket)", permanent=True)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            for s in (mine, theirs):
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    s.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
            try:
                token = send_fd(hello.fd_socket, session_id, theirs.fileno(), timeout=timeout)
            except FdPassError as exc:
                raise LaneUnavailable(f"the fd socket refused the lane: {exc}") from None
            finally:
                theirs.close()  # the daemon has its own copy now (or none)
            # Job lanes ask for batched results; the daemon's answer says if it sends them.
            batched = kind == depot_pb2.LANE_TRANSFER_JOBS
            try:
                resp = client.open_lane(session_id, token, kind, timeout, batched)
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel!"
                # The client closed while a background thread opened this lane.
                raise LaneUnavailable("the client is closed", permanent=True) from None
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                details = exc.details() if hasattr(exc, "details") else str(exc)
                raise LaneUnavailable(
                    f"OpenJobLane: {code}: {details}",
                    permanent=code == grpc.StatusCode.UNIMPLEMENTED,
                ) from None
        except BaseException:
            mine.close()
            raise
        return cls(mine, resp.lane_id, resp.max_job_bytes, resp.batched_results, kind)

    def send(self, data: bytes) -> bool:
        """Sends one job datagram without blocking. False: it did not go (the lane
        is full, or the job is larger than a datagram may be): send it elsewhere.
        Raises OSError when the lane is broken: the caller tells the protocol what
        that means for its calls."""
        if not self.protocol.fits(data):
            return False
        try:
            self.sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            # Larger than the socket buffers allow, or than the kernel could allocate
            # now (a datagram is one allocation): this job only goes elsewhere.
            if exc.errno in (errno.EMSGSIZE, errno.ENOBUFS):
                return False
            raise
        return True

    def recv(self) -> list[JobResult] | None:
        """Blocks for the next datagram's results (a job lane's); None when the lane
        ended. Raises OSError, or the codec's error for a datagram that is no result."""
        calls = self.protocol
        assert isinstance(calls, JobCalls), "recv reads a job lane's results"
        return calls.receive(self.sock.recv(calls.answer_bytes))

    def finish(self) -> None:
        """Half-close: the daemon answers the jobs it has, then closes the lane."""
        self.protocol.close()  # nothing more goes
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def cancel(self) -> None:
        """Closes both ways: the daemon skips the jobs it has not started. The reader
        thread's `recv` returns (None) and it closes the socket."""
        self.protocol.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.protocol.close()
        self.sock.close()


def follow_opening(
    action: float | None, open_: Callable[[], None], wait_ended: Callable[[], None], name: str
) -> None:
    """Does what a LaneOpening answered: 0.0, `open_` on a thread named `name`; a
    delay, `wait_ended` on a timer thread after it; None, nothing."""
    if action is None:
        return
    if action == 0.0:
        threading.Thread(target=open_, name=name, daemon=True).start()
        return
    timer = threading.Timer(action, wait_ended)
    timer.daemon = True
    timer.start()


class LaneKeeper:
    """The lane of one TransferStream: opens it in the background, reads its results
    on a thread of its own, reopens it after a break (when: its LaneOpening's rule,
    not before `retry_s` after a failed try, and a request inside that wait is
    deferred to its end).

    Shares the stream's lock (a Condition); methods without a leading underscore
    are called with it held. Lane generations are negative, so that they never
    collide with the stream's (positive) gRPC stream generations.
    """

    def __init__(
        self,
        client: LaneOwner,
        lock: threading.Condition,
        wanted: bool,
        deliver: Callable[[JobResult, int], None],
        broken: Callable[[int, str], None],
        retry_s: float = 5.0,
    ) -> None:
        self.client = client
        self.lock = lock
        self.deliver = deliver  # (result, generation): a result came
        self.broken = broken  # (generation, why): fail that lane's jobs in flight
        self.opening = LaneOpening(retry_s, wanted)
        self.lane: ClientLane | None = None
        self.generation = 0
        self._fallback_logged = False

    def maybe_open(self, background: bool = True) -> None:
        """Starts opening a lane if one is wanted and none is open: in the background,
        or (background=False, called WITHOUT the lock) now, so that every job of a
        new stream takes the same path."""
        with contextlib.nullcontext() if background else self.lock:
            if self.lane is not None or not self.client.connected:
                return
            action = self.opening.request(time.monotonic())
        if action == 0.0 and not background:
            self._open(SYNC_OPEN_TIMEOUT)
        else:
            follow_opening(action, self._open, self._wait_ended, "kvdepot-lane-open")

    def _wait_ended(self) -> None:
        with self.lock:
            self.opening.timer_fired()
            self.maybe_open()

    def send(self, job: depot_pb2.TransferJob) -> bool:
        """True if the job went on the lane (its generation is `self.generation`)."""
        lane = self.lane
        if lane is None:
            self.maybe_open()
            return False
        try:
            return lane.send(job.SerializeToString())
        except OSError:
            # Broken: its reader fails the jobs in flight on it; this one goes elsewhere.
            lane.protocol.broke()
            self.lane = None
            lane.cancel()
            return False

    def cancel(self) -> None:
        """abort(): the daemon skips the lane's jobs not started; the next send reopens."""
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.cancel()

    def finish(self) -> None:
        """close(): the daemon answers the lane's jobs, then closes it; no new lane."""
        self.opening.stop()
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.finish()

    def _open(self, timeout: float = OPEN_TIMEOUT) -> None:
        try:
            lane = ClientLane.open(self.client, self.client.session_id, timeout)
        except (LaneUnavailable, OSError, RuntimeError) as exc:  # RuntimeError: no session
            permanent = isinstance(exc, LaneUnavailable) and exc.permanent
            with self.lock:
                action = self.opening.failed(time.monotonic(), permanent)
                if not self._fallback_logged:
                    self._fallback_logged = True
                    log.info("kvdepot: no job lane (%s); jobs use the Transfer stream", exc)
            follow_opening(action, self._open, self._wait_ended, "kvdepot-lane-open")
            return
        with self.lock:
            self.opening.opened()
            if not self.opening.wanted:  # the stream closed meanwhile
                lane.close()
                return
            self.generation -= 1
            self.lane, generation = lane, self.generation
        threading.Thread(
            target=self._read, args=(lane, generation), name="kvdepot-lane", daemon=True
        ).start()

    def _read(self, lane: ClientLane, generation: int) -> None:
        error = "the job lane closed"
        try:
            while True:
                results = lane.recv()
                if results is None:  # the protocol saw the daemon's end
                    break
                with self.lock:
                    for result in results:
                        self.deliver(result, generation)
        except Exception as exc:  # OSError, or a result that does not parse
            lane.protocol.broke()
            error = f"the job lane broke: {exc}"
        with self.lock:
            if self.lane is lane:
                self.lane = None
            self.broken(generation, error)
        lane.close()
