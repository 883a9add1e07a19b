"""Job lanes: Transfer jobs over a SOCK_SEQPACKET socket pair, read on the event loop.

A lane is an optional fast path beside the Transfer stream (Depot/OpenJobLane):
the client sends one end of `socketpair(AF_UNIX, SOCK_SEQPACKET)` to the fd
socket and names its token. Then one datagram is one serialized TransferJob and
one datagram back is one serialized TransferResult, or, where the client asked
for it (OpenJobLaneRequest.batched_results), one TransferResults carrying every
result of the lane that became ready in one turn of the loop: one `send` (and
one wake-up of the client's reader) for them all. It skips gRPC's per-message
cost and the client's thread hand-offs; the job itself runs exactly as a
Transfer stream's (the same `answer` coroutine: validation, JobRunner,
expedited handling, error codes).

Contract, per lane (its state, read bound, framing and backlog are a sans-I/O
`DaemonLane`, kvdepot.common.lane_protocol; `Lane` is its socket adapter, and
`JobLane` the kind that runs jobs):
- never blocks the loop: the socket is non-blocking, read with `add_reader`;
  results wait in the lane's outbox until its one flush per loop turn
  (`call_soon`), and datagrams that do not fit in the socket then wait in a
  backlog drained with `add_writer`;
- each job is answered once (results need not come in the order of the jobs);
- bounded: while `max_unread` jobs are running or answered-but-unsent the lane
  is not read (the client's sends then fill the socket and fail with EAGAIN), so
  a client that never reads its results cannot grow the daemon's memory;
- a datagram that is not a TransferJob fails with INVALID_ARGUMENT when its
  job_id can be read, else the lane is closed with a log line;
- the peer closes its end (or dies) or the session ends: the lane closes and
  its jobs not started yet are skipped, exactly as when a Transfer stream is
  cancelled; a half-close (SHUT_WR) instead lets the running jobs finish and
  be answered first, as a Transfer stream's half-close does. Which is which is
  the protocol's rule (`DaemonLane.woke`, `received_end`): the adapter only
  reports the empty datagram and whether poll() says the peer hung up.

A pin lane (kind LANE_PINS, `PinLane`) is the same socket carrying Pin calls: a
scheduler pins its step's loads there, because a unary gRPC call costs a few
tenths of a millisecond warm and over a millisecond more after a quiet spell
(gRPC's threads on both sides wake up), while the step waits. An unpin lane
(LANE_UNPINS, `UnpinLane`) carries the same scheduler's unpins, unanswered: over
gRPC the client's unpin thread took the GIL from the scheduler for about a
millisecond after every step that finished loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvdepot.common.jobs import JobResult
from kvdepot.common.lane_protocol import (
    MAX_CALL_BYTES,
    DaemonLane,
    Flush,
    PeerEnd,
    Received,
    leading_job_id,
)
from kvdepot.server import errors
from kvdepot.server.core.log_limit import LogLimiter, held_note
from kvdepot.server.peer import session_tag, socket_creator
from kvdepot.server.service import bounds
from kvdepot.server.service.codec import JobMessage, read_job, result_to_proto
from kvdepot.server.state import DepotState
from kvdepot.v1 import depot_pb2 as pb

log = logging.getLogger("kvdepot.lane")

MAX_LANES_PER_SESSION = 8
READ_BATCH = 64  # datagrams per wake-up, so one busy lane cannot hold the loop
READ_BYTES = 1 << 20  # nor bytes parsed per wake-up (64 jobs of 4 MiB took ~0.3 s)

Answer = Callable[[JobMessage], Awaitable[pb.TransferResult]]

# One receive buffer for every lane: they are all read on the loop thread.
_RECV_BUFFER = bytearray(MAX_CALL_BYTES + 1)


class Lane:
    """One attached lane's socket adapter (see the module docstring), on the event
    loop: it reads datagrams and sends the answers its `protocol` (a DaemonLane) has
    framed, and closes. What a call does is its kind's: `JobLane`, `PinLane` or
    `UnpinLane` (`_take`, and `_too_large` for a datagram too large to parse)."""

    noun: str  # in log lines

    def __init__(
        self,
        lanes: JobLanes,
        lane_id: int,
        session_id: str,
        sock: socket.socket,
        answer: Answer,
        max_unread: int,
        batched: bool = False,
    ) -> None:
        self.lanes = lanes
        self.id = lane_id
        self.session_id = session_id
        self.sock = sock
        self.fd = sock.fileno()
        self._answer = answer
        # The lane's state, read bound, framing and backlog (batched: TransferResults
        # datagrams, as the client asked; job lanes only), kvdepot.common.lane_protocol;
        # this class is its socket adapter on the loop.
        self.protocol = DaemonLane(max_unread, self.max_datagram_bytes, batched)
        self._loop = asyncio.get_running_loop()
        self._pending: set[asyncio.Task[None]] = set()  # to cancel them on close
        self._reading = False
        self._writing = False
        # Asked at every wake-up (see _hung_up): registered once, not per call.
        self._hangup_poll = select.poll()
        self._hangup_poll.register(self.fd, select.POLLOUT)

    @property
    def closed(self) -> bool:
        return self.protocol.closed

    @property
    def batched(self) -> bool:
        """The lane sends TransferResults datagrams (told to the client when it opens)."""
        return self.protocol.batched

    def start(self) -> None:
        self._resume_reading()

    # -- reading -----------------------------------------------------------------------

    def _resume_reading(self) -> None:
        if not self._reading and self.protocol.may_read():
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def _pause_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def _hung_up(self) -> bool:
        """Both directions shut: the peer closed its end (abort, exit, death)."""
        events = self._hangup_poll.poll(0)
        return any(ev & (select.POLLHUP | select.POLLERR) for _, ev in events)

    def _on_readable(self) -> None:
        protocol = self.protocol
        if protocol.woke(self._hung_up()) is PeerEnd.HUNG_UP:  # its queued calls: skipped
            self.close("the client closed it")
            return
        budget = READ_BYTES
        for _ in range(READ_BATCH):
            if budget <= 0 or not protocol.may_read():
                break
            try:
                n = self.sock.recv_into(_RECV_BUFFER, len(_RECV_BUFFER), socket.MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"reading failed: {exc}")
                return
            kind = protocol.received(n)
            if kind is Received.END:
                self._on_eof()
                return
            budget -= n
            if kind is Received.TOO_LARGE:  # parsing costs by the field: not begun
                self._too_large(bytes(_RECV_BUFFER[:64]), n)
                continue
            self._take(bytes(_RECV_BUFFER[:n]))
        if not protocol.may_read():
            self._pause_reading()  # resumed when results go out (or never: closed)

    @property
    def max_datagram_bytes(self) -> int:
        """The largest datagram this lane parses (told to the client when it opens)."""
        return MAX_CALL_BYTES

    def _take(self, data: bytes) -> None:
        """A call read from the lane: its kind runs it."""
        raise NotImplementedError

    def _too_large(self, head: bytes, size: int) -> None:
        """A call of `size` bytes, larger than the lane parses (`head`: its first bytes)."""
        self.close(
            f"a {self.noun} datagram of {size} bytes is larger than the "
            f"{self.max_datagram_bytes} bytes this lane reads"
        )

    def _on_eof(self) -> None:
        self._pause_reading()
        if self.protocol.received_end(self._hung_up()) is PeerEnd.HUNG_UP:
            self.close("the client closed it")
            return
        self._after_progress()  # half-closed: the protocol answers what runs, then closes

    # -- writing -----------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        """An answer: flushed when the protocol says (a batched lane's once this turn
        of the loop has made every answer it will; another's now)."""
        if self.protocol.closed:
            return
        flush = self.protocol.answer(data)
        if flush is Flush.NOW:
            self._flush()
        elif flush is Flush.END_OF_TURN:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self.protocol.closed:
            return  # the outbox was dropped with the lane
        self.protocol.flush()
        if not self._writing:  # else the writer sends them, behind the backlog
            self._send_datagrams()

    def _send_datagrams(self) -> None:
        """Sends the protocol's datagrams until none is left or the socket is full
        (then the writer callback goes on when it has room)."""
        protocol = self.protocol
        send = self.sock.send
        while (datagram := protocol.next_datagram()) is not None:
            try:
                send(datagram)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._loop.add_writer(self.fd, self._send_datagrams)
                    self._writing = True
                return
            except OSError as exc:
                self.close(f"sending a result failed: {exc}")
                return
            protocol.datagram_sent()
        if self._writing and not self.closed:
            self._loop.remove_writer(self.fd)
            self._writing = False
        self._after_progress()

    def _after_progress(self) -> None:
        if self.protocol.drained:
            self.close("the client half-closed it and every job was answered")
        else:
            self._resume_reading()

    # -- closing -----------------------------------------------------------------------

    def stop_reading(self) -> None:
        """Shutdown: take no more jobs; the running ones finish and are answered."""
        self._pause_reading()
        if not self.closed:
            self.protocol.half_closed()
            self._after_progress()

    async def wait_pending(self, timeout: float) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout)

    def close(self, why: str) -> None:
        """Idempotent. Jobs whose copy has not started are skipped (CopyQueue)."""
        if self.closed:
            return
        protocol = self.protocol
        if protocol.closing():  # answers made this turn: a peer gone refuses them
            with contextlib.suppress(OSError):
                while (datagram := protocol.next_datagram()) is not None:
                    self.sock.send(datagram)
                    protocol.datagram_sent()
        protocol.close()  # and its backlog is dropped
        self._pause_reading()
        if self._writing:
            self._loop.remove_writer(self.fd)
            self._writing = False
        for task in self._pending:
            task.cancel()
        self.sock.close()
        self.lanes.forget(self)
        tag = session_tag(self.session_id)
        held = self.lanes.log_limit.admit(tag, time.monotonic())
        if held is not None:  # rate-limited per session (kvdepot.server.core.log_limit)
            log.info("lane %d of session %s closed: %s%s", self.id, tag, why, held_note(held))


class JobLane(Lane):
    """A lane of Transfer jobs: one TransferJob datagram in, its TransferResult out
    when the job is done (batched: several in one TransferResults datagram), each
    job run as a Transfer stream's (`answer`)."""

    noun = "job"

    @property
    def max_datagram_bytes(self) -> int:
        """A job's largest legal size (from --max-job-keys and --max-job-blocks)."""
        return self.lanes.max_job_bytes

    def _too_large(self, head: bytes, size: int) -> None:
        self._reject(
            head,
            f"a job datagram of {size} bytes is larger than the {self.max_datagram_bytes} "
            f"bytes this lane reads (a job: its largest legal size, from --max-job-keys "
            f"and --max-job-blocks): split it",
        )

    def _take(self, data: bytes) -> None:
        try:  # its lists counted before they are decoded (codec.read_job)
            job = read_job(data, self.lanes.state.job_limits)
        except Exception as exc:  # DecodeError, or anything a parser may raise
            self._reject(data, f"the datagram is not a valid kvdepot.v1.TransferJob: {exc}")
            return
        if job.session_id and job.session_id != self.session_id:
            # A lane runs its own session's jobs only (the lane is the owner's).
            self.lanes.state.deny(
                f"a job naming another session on a lane of session {session_tag(self.session_id)}"
            )
            refused = JobResult(
                job.job_id,
                False,
                error="a job lane runs jobs of its own session only",
                error_code="PERMISSION_DENIED",
            )
            self._send(result_to_proto(refused).SerializeToString())
            return
        # As the lane's session's job: `answer` refuses it (PERMISSION_DENIED) when
        # that session has not joined the namespace of the registration it names.
        job.session_id = self.session_id
        self.lanes.lane_jobs += 1
        self.protocol.started()
        task = self._loop.create_task(self._run(job))
        self._pending.add(task)
        task.add_done_callback(self._job_done)

    def _reject(self, data: bytes, why: str) -> None:
        job_id = leading_job_id(data)
        if job_id is None:
            self.close(f"{why}; no job_id could be read from it")
            return
        rejected = JobResult(job_id, False, error=why, error_code="INVALID_ARGUMENT")
        self._send(result_to_proto(rejected).SerializeToString())

    async def _run(self, job: JobMessage) -> None:
        result = await self._answer(job)
        if not self.closed:
            self._send(result.SerializeToString())

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._pending.discard(task)
        self.protocol.finished()
        if not task.cancelled() and task.exception() is not None:
            log.error("lane %d: a job failed unexpectedly", self.id, exc_info=task.exception())
        self._after_progress()


class PinLane(Lane):
    """A lane of Pin calls: one PinRequest datagram in, one PinResponse out, in
    order, answered on the loop at once (a pin is index work only). A request for
    another session, or one the daemon refuses, closes the lane: the client then
    asks over gRPC's Pin, whose status says why."""

    noun = "pin"  # its calls are bounded by --max-batch-keys, not by a job's size

    def _take(self, data: bytes) -> None:
        try:
            req = pb.PinRequest.FromString(data)
            if req.session_id != self.session_id:
                raise errors.invalid("a pin lane pins for its own session only")
            # The repeated field itself, as over gRPC: its length is checked before a
            # key is read (--max-batch-keys).
            pinned = self.lanes.state.pin(self.session_id, req.namespace_id, req.keys)
        except Exception as exc:  # DecodeError, DepotError, or a bug: gRPC answers
            why = exc.message if isinstance(exc, errors.DepotError) else str(exc)
            self.close(f"a pin was refused ({why}); the client asks over gRPC")
            return
        self.lanes.lane_pins += 1
        self._send(pb.PinResponse(pinned=pinned).SerializeToString())


class UnpinLane(Lane):
    """A lane of Unpin calls: UnpinRequest datagrams in, applied on the loop in
    order, nothing out (the client's unpin thread never waits). An unpin the daemon
    refuses (a namespace it no longer has, say) is logged and the lane goes on, so
    that the unpins queued behind it are not lost; a datagram that is not an
    UnpinRequest of the lane's session, or names a namespace that session did not
    join, closes the lane."""

    noun = "unpin"

    def _take(self, data: bytes) -> None:
        try:
            req = pb.UnpinRequest.FromString(data)
        except Exception as exc:  # DecodeError
            self.close(f"a datagram is not an UnpinRequest ({exc})")
            return
        if req.session_id != self.session_id:
            self.close("an unpin lane unpins for its own session only")
            return
        try:
            self.lanes.state.unpin(self.session_id, req.namespace_id, req.keys, req.touch_keys)
        except Exception as exc:
            refusal = errors.as_depot_error(exc)
            if refusal is None:  # a bug: the lane cannot be trusted to go on
                log.exception("unpin lane %d failed", self.id)
                self.close(f"an unpin failed ({exc}); the client unpins over gRPC")
                return
            if refusal.code is errors.Code.PERMISSION_DENIED:
                # A namespace the lane's session never joined: not a stale unpin
                # but a client naming someone else's namespace.
                self.close(f"an unpin was refused ({refusal.message})")
                return
            tag = session_tag(self.session_id)
            held = self.lanes.log_limit.admit(tag, time.monotonic())
            if held is not None:
                log.warning(
                    "unpin lane %d of session %s: an unpin of %d keys was refused (%s)%s",
                    self.id,
                    tag,
                    len(req.keys),
                    refusal.message,
                    held_note(held),
                )
            return
        self.lanes.lane_unpins += 1


def _owned_by(session: Any, passed: Any) -> bool:
    """The fd's sender is the session's attested owner (the fd socket checks it
    when the fd arrives; checked again here, as the lane outlives that message)."""
    return session.owner is not None and session.owner.same_process(passed.peer)


class JobLanes:
    """Every open lane of the daemon, by session; the figures Admin shows."""

    def __init__(self, state: DepotState, answer: Answer, max_unread: int) -> None:
        self.state = state
        self._answer = answer
        self._max_unread = max_unread
        self._ids = itertools.count(1)
        self._lanes: dict[int, Lane] = {}
        self.lane_jobs = 0  # jobs that came by a lane, since start
        self.lane_pins = 0  # pin calls that came by a pin lane, since start
        self.lane_unpins = 0  # unpin calls that came by an unpin lane, since start
        self.log_limit = LogLimiter()  # lane lines, rate-limited per session
        # The largest job datagram a job lane parses: its largest legal job (bounds.py).
        cfg = state.config
        self.max_job_bytes = min(
            MAX_CALL_BYTES, bounds.max_job_bytes(cfg.max_job_keys, cfg.max_job_blocks)
        )

    def open(
        self,
        session_id: str,
        fd_token: str,
        kind: int = pb.LANE_TRANSFER_JOBS,
        batched_results: bool = False,
    ) -> Lane:
        """Attaches the socket behind `fd_token` as a lane of `kind` (a LaneKind);
        raises a DepotError with why not. `batched_results`: the client reads
        TransferResults datagrams (honoured on job lanes; `lane.batched` says)."""
        cls = _LANE_CLASSES.get(kind)
        if cls is None:
            raise errors.invalid(
                f"unknown lane kind {kind}: LANE_TRANSFER_JOBS (0), LANE_PINS (1) or "
                f"LANE_UNPINS (2)"
            )
        st = self.state
        if st.shutting_down:
            raise errors.unavailable("the daemon is shutting down")
        session = st.session(session_id)
        if self.count(session_id) >= MAX_LANES_PER_SESSION:
            raise errors.exhausted(
                f"session {session.tag} has {MAX_LANES_PER_SESSION} job lanes open, the most "
                f"allowed: close one (or use the Transfer stream)"
            )
        # The fd socket took the fd only from the session's owner (kernel identity);
        # a token of another session is PERMISSION_DENIED, counted.
        passed = st.claim_passed(fd_token, session_id)
        fd = passed.fd
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise errors.invalid(f"the job lane's fd is not a socket: {exc}") from None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.close()
            raise errors.invalid(
                "the job lane's fd must be one end of socketpair(AF_UNIX, SOCK_SEQPACKET)"
            )
        creator = socket_creator(sock)
        if creator is None or creator[0] != passed.peer.pid or not _owned_by(session, passed):
            sock.close()
            raise st.deny(
                f"the lane of session {session.tag} must be an unnamed socketpair made by "
                f"the session's own process (this one names pid "
                f"{creator[0] if creator else 'none'}, sent by {passed.peer})"
            )
        sock.setblocking(False)
        batched = batched_results and cls is JobLane
        lane = cls(self, next(self._ids), session_id, sock, self._answer, self._max_unread, batched)
        self._lanes[lane.id] = lane
        lane.start()
        held = self.log_limit.admit(session.tag, time.monotonic())
        if held is not None:
            log.info(
                "%s lane %d of session %s open%s", cls.noun, lane.id, session.tag, held_note(held)
            )
        return lane

    def forget(self, lane: Lane) -> None:
        self._lanes.pop(lane.id, None)

    def count(self, session_id: str) -> int:
        return sum(lane.session_id == session_id for lane in self._lanes.values())

    def close_session(self, session_id: str) -> None:
        for lane in [x for x in self._lanes.values() if x.session_id == session_id]:
            lane.close("its session ended")

    async def shutdown(self, grace: float) -> None:
        """Stops reading every lane, answers the jobs running (within `grace`), closes."""
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop_reading()
        await asyncio.gather(*(lane.wait_pending(grace) for lane in lanes))
        for lane in lanes:
            lane.close("the daemon is shutting down")

    def stats_fields(self) -> dict[str, int]:
        """Admin/GetStats' lane fields (see admin.proto)."""
        return {
            "job_lanes_open": len(self._lanes),
            "lane_jobs": self.lane_jobs,
            "lane_pins": self.lane_pins,
            "lane_unpins": self.lane_unpins,
        }


_LANE_CLASSES: dict[int, type[Lane]] = {
    pb.LANE_TRANSFER_JOBS: JobLane,
    pb.LANE_PINS: PinLane,
    pb.LANE_UNPINS: UnpinLane,
}
