"""The client's end of a job lane: Transfer jobs as datagrams on a Unix socket pair.

`ClientLane.open(client)` makes `socketpair(AF_UNIX, SOCK_SEQPACKET)`, sends one
end to the daemon's fd socket (kvdepot.client.fdpass) and attaches it with
Depot/OpenJobLane. Then one datagram is one serialized TransferJob (sent from
the caller's thread, never blocking) and one datagram back one serialized
TransferResults: every result the daemon had ready for the lane at one turn of its
loop (asked for with OpenJobLaneRequest.batched_results; a daemon that does not
say it batches sends one TransferResult a datagram, read as such). The reader
(`read_results`, on the lane's own thread) hands on a datagram's results at once.
`TransferStream` uses a lane when it can and the gRPC stream otherwise; its
lane is kept (opened, reopened, dropped) by kvdepot.client.lane_keeper's
`LaneKeeper`, as the pin and unpin lanes are (kvdepot.client.pin_lane: the same
`ClientLane`, opened with another LaneKind). See kvdepot.server.service.job_lane
for the daemon's side.

Set KVDEPOT_JOB_LANE=0 in the environment (or pass `job_lane=False` to
DepotClient) to keep every job on the gRPC stream.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc

from kvdepot.client.fdpass import FdPassError, send_fd
from kvdepot.client.job_codec import result_from_bytes, results_from_bytes
from kvdepot.common.jobs import JobResult
from kvdepot.common.lane_protocol import ClientLaneProtocol, JobCalls, PinCalls
from kvdepot.v1 import depot_pb2

ENV = "KVDEPOT_JOB_LANE"
# Socket buffers: a 1024-key job (~50 KiB) fits many times over. The kernel caps
# them at net.core.{w,r}mem_max; a job larger than what it allows goes on gRPC.
BUFFER_BYTES = 4 << 20
OPEN_TIMEOUT = 5.0  # in the background
# The first open runs inside transfer_stream(), maybe on an engine's hot path (a new
# stream after the daemon stopped answering): a healthy daemon needs a few ms.
SYNC_OPEN_TIMEOUT = 0.5


def _pinned_flags(answer: bytes) -> Sequence[bool]:
    """A pin lane's answer, as PinCalls reads it (raises on one that is no PinResponse)."""
    return depot_pb2.PinResponse.FromString(answer).pinned


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
    the pin lane's PinCalls, an unpin lane's ClientLaneProtocol), which says what
    may go and what came. `send` from any thread; `recv` from one reader thread.
    Kept by a kvdepot.client.lane_keeper.LaneKeeper."""

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
        self.protocol: ClientLaneProtocol
        if kind == depot_pb2.LANE_TRANSFER_JOBS:
            self.protocol = JobCalls(max_job_bytes, batched, result_from_bytes, results_from_bytes)
        elif kind == depot_pb2.LANE_PINS:
            self.protocol = PinCalls(max_job_bytes, _pinned_flags)
        else:  # unpins: no answers
            self.protocol = ClientLaneProtocol(max_job_bytes)

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


def read_results(lane: ClientLane, deliver: Callable[[list[JobResult]], None]) -> str:
    """A job lane's reader (its keeper runs it on the lane's own thread): hands each
    datagram's results to `deliver` until the lane ends, and says why it ended."""
    try:
        while True:
            results = lane.recv()
            if results is None:  # the protocol saw the daemon's end
                return "the job lane closed"
            deliver(results)
    except Exception as exc:  # OSError, or a result that does not parse
        lane.protocol.broke()
        return f"the job lane broke: {exc}"
