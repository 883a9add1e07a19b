"""The lanes' sans-I/O protocols (kvdepot.common.lane_protocol), driven through any
interleaving of calls, answers, peer closes, refusals and timeouts.

The pin lane's client end runs against a model daemon that behaves as the real
one and as Linux's SOCK_SEQPACKET does: calls answered in order; a refused call
closes the lane and drops the calls behind it unread, which the kernel reports
to the client once, as a reset, ahead of the answers already queued; a frozen
daemon answers nothing. Whatever happens, every call gets exactly one outcome
(its own answer, a fall-back to gRPC or a timeout), an answer is never handed to
another call, and no key the daemon pinned falls back to gRPC (pinned twice).
The daemon's end keeps its read bound and answer order under any interleaving.
The adapters' sockets are covered by tests/test_pin_lane.py and
tests/test_job_lane.py against a real daemon.
"""

from __future__ import annotations

import collections
import itertools
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.common.jobs import JobResult
from kvdepot.common.lane_protocol import (
    CLIENT_TRANSITIONS,
    DAEMON_TRANSITIONS,
    RESULTS_DATAGRAM_BYTES,
    ClientLaneProtocol,
    DaemonLane,
    Flush,
    JobCalls,
    LaneEvent,
    LaneProtocol,
    LaneProtocolError,
    LaneState,
    PeerEnd,
    PinCalls,
    Received,
)

# -- the tables -------------------------------------------------------------------------


@pytest.mark.parametrize("table", [CLIENT_TRANSITIONS, DAEMON_TRANSITIONS])
def test_every_event_moves_as_the_table_says_or_raises(table) -> None:
    role = type("Role", (LaneProtocol,), {"__slots__": (), "transitions": table})
    for state, event in itertools.product(LaneState, LaneEvent):
        lane = role()
        lane.state = state
        if state in table and event in table[state]:
            assert lane.event(event) is table[state][event]
        else:
            with pytest.raises(LaneProtocolError, match=re.escape(event.value)):
                lane.event(event)
            assert lane.state is state  # an illegal event changes nothing


def test_close_is_always_allowed_and_final() -> None:
    for table in (CLIENT_TRANSITIONS, DAEMON_TRANSITIONS):
        for state in table:
            assert table[state][LaneEvent.CLOSE] is LaneState.CLOSED
        assert set(table[LaneState.CLOSED].values()) == {LaneState.CLOSED}


def test_the_daemon_per_job_checks_agree_with_its_table() -> None:
    """`received` and `answer` check the state inline (they run per job)."""
    for state in DAEMON_TRANSITIONS:
        row = DAEMON_TRANSITIONS[state]
        lane = DaemonLane(4)
        lane.state = state
        if LaneEvent.RECEIVE in row:
            lane.received(8)
        else:
            with pytest.raises(LaneProtocolError):
                lane.received(8)
        if LaneEvent.SEND in row:
            lane.answer(b"r")
            assert lane.state is row[LaneEvent.SEND]
        else:
            with pytest.raises(LaneProtocolError):
                lane.answer(b"r")


def test_the_client_per_job_check_agrees_with_its_table() -> None:
    """`fits` checks the state inline (it runs per job): a datagram fits exactly where
    the table allows a SEND, and SEND leaves the state as it is."""
    for state in LaneState:
        lane = ClientLaneProtocol(8)
        lane.state = state
        allowed = LaneEvent.SEND in CLIENT_TRANSITIONS.get(state, {})
        assert lane.fits(b"job") is allowed
        if allowed:
            assert CLIENT_TRANSITIONS[state][LaneEvent.SEND] is state


# -- the pin lane, client end, against a model daemon -------------------------------------


def encode_answer(call_id: int, keys: int) -> bytes:
    return call_id.to_bytes(4, "big") + b"\x01" * keys


@dataclass
class ModelDaemon:
    """One lane's daemon end and the kernel between them."""

    inbox: collections.deque[tuple[int, int, bool]] = field(default_factory=collections.deque)
    outbox: collections.deque[bytes] = field(default_factory=collections.deque)
    closed: bool = False
    reset_pending: bool = False  # closed with calls unread: reported once, as a reset
    frozen: bool = False

    def step(self, pinned: set[int]) -> None:
        """Takes the next call: pins it and answers, or refuses it and closes."""
        call_id, keys, refuse = self.inbox.popleft()
        if refuse:
            self.close()
        else:
            pinned.add(call_id)
            self.outbox.append(encode_answer(call_id, keys))

    def close(self) -> None:
        self.reset_pending = bool(self.inbox)
        self.inbox.clear()  # dropped unread: never pinned
        self.closed = True


class PinClient:
    """Drives PinCalls exactly as kvdepot.client.pin_lane.PinLane does its socket."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.outcome: dict[int, str] = {}
        self.pinned_by_daemon: set[int] = set()
        self.decoded: list[int] = []
        self._open()

    def _open(self) -> None:
        self.daemon = ModelDaemon()
        self.calls = PinCalls(1 << 16, self._decode)
        self.owed_ids: collections.deque[int] = collections.deque()

    def _decode(self, data: bytes) -> list[bool]:
        self.decoded.append(int.from_bytes(data[:4], "big"))
        return [True] * (len(data) - 4)

    def _settle(self, call_id: int, outcome: str) -> None:
        assert call_id not in self.outcome, f"call {call_id}: a second outcome {outcome}"
        self.outcome[call_id] = outcome

    def send(self, keys: int, refuse: bool) -> None:
        call_id = next(self.ids)
        if not PinCalls.goes_on_lane(keys):  # nothing to pin: answered without the lane
            self._settle(call_id, "empty")
            return
        if not self.calls.fits(b"x" * (keys + 1)):  # not OPEN: the call goes over gRPC
            self._settle(call_id, "fallback")
            return
        if self.daemon.closed:  # the send fails: EPIPE
            self.calls.send_refused()
            self._settle(call_id, "fallback")
            self._drop_if_spent()
            return
        self.daemon.inbox.append((call_id, keys, refuse))
        self.calls.call_sent(keys)
        self.owed_ids.append(call_id)

    def answers(self) -> None:
        calls, daemon = self.calls, self.daemon
        while calls.owed:
            if daemon.closed and daemon.reset_pending:  # ConnectionResetError, once
                daemon.reset_pending = False
                assert calls.read_failed(reset=True)  # read again: the answers before it
                reply = daemon.outbox.popleft() if daemon.outbox else b""
            elif daemon.outbox:
                reply = daemon.outbox.popleft()
            elif daemon.closed:
                reply = b""  # EOF
            elif daemon.frozen:  # TimeoutError
                calls.timed_out()
                for call_id in self.owed_ids:
                    self._settle(call_id, "timeout")
                self.owed_ids.clear()
                break
            else:
                daemon.step(self.pinned_by_daemon)  # the recv waits while it works
                continue
            expected = self.owed_ids.popleft()
            before = len(self.decoded)
            got = calls.receive(reply)
            if got is None:
                for call_id in (expected, *self.owed_ids):
                    self._settle(call_id, "fallback")
                self.owed_ids.clear()
                break
            assert self.decoded[before:] == [expected], "an answer handed to another call"
            self._settle(expected, "answered")
        self._drop_if_spent()

    def _drop_if_spent(self) -> None:
        if not self.calls.usable and not self.calls.owed:
            self.calls.close()
            self._open()  # reopened in the background: a new lane, a new daemon end

    def finish(self) -> None:
        self.daemon.frozen = False
        self.answers()
        # Every key the daemon pinned was answered or timed out, never sent to gRPC.
        sent = set(range(1, next(self.ids)))
        assert set(self.outcome) == sent, "a call without an outcome"
        for call_id, outcome in self.outcome.items():
            if outcome == "fallback":
                assert call_id not in self.pinned_by_daemon, f"call {call_id} pinned twice"
            if outcome == "answered":
                assert call_id in self.pinned_by_daemon


ops = st.one_of(
    st.tuples(st.just("send"), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("daemon_step")),
    st.tuples(st.just("daemon_close")),
    st.tuples(st.just("freeze"), st.booleans()),
    st.tuples(st.just("answers")),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(ops, max_size=40))
def test_pin_calls_keep_every_call_to_one_outcome_of_its_own(script) -> None:
    client = PinClient()
    for op in script:
        daemon = client.daemon
        if op[0] == "send":
            client.send(op[1], refuse=op[2])
        elif op[0] == "daemon_step" and daemon.inbox and not daemon.closed and not daemon.frozen:
            daemon.step(client.pinned_by_daemon)
        elif op[0] == "daemon_close" and not daemon.closed:
            daemon.close()
        elif op[0] == "freeze":
            daemon.frozen = op[1]
        elif op[0] == "answers":
            client.answers()
    client.finish()


def test_answers_before_a_refusal_are_read_after_the_reset() -> None:
    """The bug of 7838590: the daemon refused the second of three calls and closed
    the lane with the third unread; the client must still read the first's answer."""
    client = PinClient()
    client.send(2, refuse=False)
    client.send(1, refuse=True)
    client.send(2, refuse=False)
    daemon = client.daemon
    daemon.step(client.pinned_by_daemon)
    daemon.step(client.pinned_by_daemon)  # refused: closes, the third dropped unread
    assert daemon.closed and daemon.reset_pending
    client.answers()
    assert client.outcome == {1: "answered", 2: "fallback", 3: "fallback"}
    client.finish()


def test_a_read_error_other_than_a_reset_falls_back_every_call_owed() -> None:
    calls = PinCalls(1 << 16, lambda data: [True] * len(data))
    calls.call_sent(1)
    calls.call_sent(1)
    assert not calls.read_failed(reset=False)  # the adapter reads it as b""
    assert calls.receive(b"") is None and calls.owed == 0
    assert calls.state is LaneState.BROKEN


def test_an_answer_that_does_not_fit_its_call_is_never_handed_out() -> None:
    calls = PinCalls(1 << 16, lambda data: [True] * len(data))
    calls.call_sent(2)
    calls.call_sent(1)
    assert calls.receive(b"\x01") is None  # one flag for a call of two keys
    assert calls.state is LaneState.BROKEN and calls.owed == 0  # both fall back
    with pytest.raises(LaneProtocolError):
        calls.call_sent(1)  # a broken lane takes no call


def test_an_answer_that_does_not_parse_breaks_the_lane() -> None:
    def decode(data: bytes) -> list[bool]:
        raise ValueError("not a PinResponse")

    calls = PinCalls(1 << 16, decode)
    calls.call_sent(1)
    assert calls.receive(b"junk") is None and calls.state is LaneState.BROKEN


def test_an_answer_with_no_call_owed_is_a_protocol_error() -> None:
    calls = PinCalls(1 << 16, lambda data: [True])
    with pytest.raises(LaneProtocolError, match="no call owed"):
        calls.receive(b"\x01")


def test_a_lane_closed_by_this_side_answers_nothing_more() -> None:
    """The session ended (another thread closed the lane) while answers were owed."""
    calls = PinCalls(1 << 16, lambda data: [True])
    calls.call_sent(1)
    calls.close()
    assert calls.receive(b"\x01") is None and calls.owed == 0


def test_send_limits_of_a_client_lane() -> None:
    calls = PinCalls(8, lambda data: [])
    assert calls.fits(b"x" * 8)
    assert not calls.fits(b"")  # would read as the end of the lane
    assert not calls.fits(b"x" * 9)  # larger than the daemon reads


def test_a_pin_call_of_no_keys_never_goes_on_the_lane() -> None:
    """Its answer, an empty PinResponse, would be an empty datagram: read as the
    daemon's end, it broke the lane and sent the calls behind it to gRPC."""
    calls = PinCalls(1 << 16, lambda data: [True] * len(data))
    assert not PinCalls.goes_on_lane(0) and PinCalls.goes_on_lane(1)
    with pytest.raises(LaneProtocolError, match="no keys"):
        calls.call_sent(0)
    assert calls.owed == 0 and calls.usable  # refused before it counted
    calls.call_sent(1)
    calls.call_sent(1)
    assert calls.receive(b"") is None  # what such an answer would read as
    assert calls.state is LaneState.BROKEN and calls.owed == 0


# -- the job lane, client end -------------------------------------------------------------


def job_calls(batched: bool) -> JobCalls:
    """Results as one byte per job_id; a batch is several, one each."""
    return JobCalls(
        1 << 16,
        batched,
        decode_one=lambda data: JobResult(int.from_bytes(data, "big"), True),
        decode_batch=lambda data: [JobResult(b, True) for b in data],
    )


@pytest.mark.parametrize("batched", [False, True])
def test_an_empty_datagram_is_the_daemons_end_never_a_result(batched: bool) -> None:
    calls = job_calls(batched)
    got = calls.receive(b"\x07")
    assert got is not None and [r.job_id for r in got] == [7]
    assert calls.receive(b"") is None
    assert calls.state is LaneState.CLOSED_BY_PEER and not calls.usable
    assert not calls.fits(b"job")  # nothing more goes: the stream sends it over gRPC


def test_a_batched_job_lane_reads_every_result_of_a_datagram_in_a_larger_buffer() -> None:
    assert job_calls(True).answer_bytes > RESULTS_DATAGRAM_BYTES  # a full batch fits
    got = job_calls(True).receive(b"\x01\x02\x03")
    assert got is not None and [r.job_id for r in got] == [1, 2, 3]


def test_a_datagram_that_is_no_result_breaks_the_job_lane() -> None:
    def decode(data: bytes) -> JobResult:
        raise ValueError("not a TransferResult")

    calls = JobCalls(1 << 16, False, decode, lambda data: [])
    with pytest.raises(ValueError, match="not a TransferResult"):
        calls.receive(b"junk")
    assert calls.state is LaneState.BROKEN and not calls.fits(b"job")


def test_a_job_lane_closed_by_this_side_reads_its_end_quietly() -> None:
    """cancel() shuts the socket both ways: the reader's recv then returns b""."""
    calls = job_calls(True)
    calls.close()
    assert calls.receive(b"") is None and calls.state is LaneState.CLOSED


# -- the daemon's end -------------------------------------------------------------------


daemon_ops = st.one_of(
    st.tuples(st.just("datagram"), st.booleans()),  # True: a pin, answered at once
    st.tuples(st.just("finish")),
    st.tuples(st.just("turn")),  # the loop's turn ends: a batched lane's flush runs
    st.tuples(st.just("client_reads"), st.integers(0, 5)),
    st.tuples(st.just("writable")),  # the loop's writer callback, some time after a read
    st.tuples(st.just("half_close")),
    st.tuples(st.just("close")),
)


def unframe(datagram: bytes, batched: bool) -> list[bytes]:
    """The answers in a datagram, as the client's reader finds them: a batched lane's
    is a TransferResults (field 1, length-delimited, per answer; the answers here are
    shorter than 128 bytes: a one-byte length)."""
    if not batched:
        return [datagram]
    answers, pos = [], 0
    while pos < len(datagram):
        assert datagram[pos] == 0x0A and datagram[pos + 1] < 0x80
        end = pos + 2 + datagram[pos + 1]
        answers.append(datagram[pos + 2 : end])
        pos = end
    return answers


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 6), st.integers(0, 4), st.booleans(), st.lists(daemon_ops, max_size=60))
def test_daemon_lane_stays_within_its_bound_and_answers_each_call_once(
    max_unread: int, socket_room: int, batched: bool, script
) -> None:
    """Drives DaemonLane as kvdepot.server.service.job_lane.JobLane does its socket:
    it reads only while `may_read`; an answer goes into the outbox, flushed when
    `answer` says (at once, or on a batched lane at the end of the loop's turn: one
    datagram for all); the flushed datagrams go while the socket has room, and the
    rest when the writer callback runs, in order, never ahead of older ones. Every
    answer reaches the client once, in the order made, unless the lane closed first."""
    lane = DaemonLane(max_unread, batched=batched)
    waiting = collections.deque(range(1000))  # the client's calls, in its socket
    running: collections.deque[int] = collections.deque()
    answered: list[int] = []  # what the client read, in order
    in_socket: collections.deque[bytes] = collections.deque()  # datagrams
    produced: list[int] = []  # answers in the order the daemon made them
    flush_due = False
    writing = False

    def after_progress() -> None:
        if lane.drained:
            lane.close()

    def send_datagrams() -> None:
        nonlocal writing
        while (datagram := lane.next_datagram()) is not None:
            if len(in_socket) >= socket_room:
                writing = True
                return
            in_socket.append(datagram)
            lane.datagram_sent()
        writing = False
        after_progress()

    def flush() -> None:
        lane.flush()
        if not writing:
            send_datagrams()

    def answer(call: int) -> None:
        nonlocal flush_due
        produced.append(call)
        due = lane.answer(call.to_bytes(4, "big"))
        assert due is (None if flush_due else Flush.END_OF_TURN if batched else Flush.NOW)
        if due is Flush.NOW:
            flush()
        elif due is Flush.END_OF_TURN:
            flush_due = True

    for op in script:
        if op[0] == "datagram" and lane.may_read():
            assert lane.received(8) is Received.CALL
            call = waiting.popleft()
            if op[1]:
                answer(call)
            else:
                lane.started()
                running.append(call)
        elif op[0] == "finish" and running:
            call = running.popleft()
            lane.finished()
            if not lane.closed:
                answer(call)
            after_progress()
        elif op[0] == "turn" and flush_due:
            flush_due = False
            if not lane.closed:
                flush()
        elif op[0] == "client_reads":
            for _ in range(min(op[1], len(in_socket))):
                for data in unframe(in_socket.popleft(), batched):
                    answered.append(int.from_bytes(data, "big"))
        elif op[0] == "writable" and writing:
            send_datagrams()
        elif op[0] == "half_close" and not lane.closed:
            lane.half_closed()
            after_progress()
        elif op[0] == "close" and not lane.closed:
            lane.close()
            flush_due = False
        assert lane.running + lane.unsent <= max_unread, "read past the bound"
        in_outbox = len(lane.outbox) + sum(count for _, count in lane.backlog)
        assert lane.unsent == in_outbox, "unsent answers miscounted"
        assert answered == produced[: len(answered)], "answers out of order, lost or doubled"
        if lane.closed:
            assert not lane.backlog and not lane.outbox and not lane.may_read()
            assert lane.next_datagram() is None
    if lane.state is LaneState.OPEN:
        assert lane.may_read() == (lane.running + lane.unsent < max_unread)


def test_an_answer_waits_behind_the_backlog_even_when_the_socket_has_room() -> None:
    """The writer callback runs some time after the client read: a datagram made in
    between must not overtake the ones queued before it (a flush frames it behind them)."""
    lane = DaemonLane(4, batched=True)
    for _ in range(3):
        lane.received(8)
        lane.started()
        lane.finished()
    assert lane.answer(b"1") is Flush.END_OF_TURN  # the first in the outbox
    assert lane.answer(b"2") is None  # the same flush takes it
    lane.flush()
    assert lane.unsent == 2 and not lane.outbox
    assert lane.next_datagram() == b"\n\x011\n\x012"  # one TransferResults; the socket is full
    assert lane.answer(b"3") is Flush.END_OF_TURN
    lane.flush()  # the writer is on: it goes after "12"
    assert list(lane.backlog) == [(b"\n\x011\n\x012", 2), (b"\n\x013", 1)]
    assert lane.unsent == 3 and lane.may_read()
    lane.received(8)
    lane.started()
    assert not lane.may_read()  # 3 unsent + 1 running: the bound of 4
    lane.finished()
    lane.datagram_sent()
    assert lane.next_datagram() == b"\n\x013" and lane.unsent == 1
    lane.datagram_sent()
    assert lane.unsent == 0 and lane.may_read() and lane.next_datagram() is None


def test_an_unbatched_lane_sends_each_answer_alone_and_now() -> None:
    """A pin lane's answers, and an older client's job results: one datagram each, as
    made (a pin's caller waits for it)."""
    lane = DaemonLane(4)
    assert lane.answer(b"a") is Flush.NOW
    lane.flush()
    assert lane.answer(b"b") is Flush.NOW
    lane.flush()
    assert list(lane.backlog) == [(b"a", 1), (b"b", 1)]


def test_what_a_datagram_read_is() -> None:
    """An empty datagram is the peer's end (SOCK_SEQPACKET's EOF), read even at the
    bound; one larger than the lane parses is refused unparsed, and counts."""
    lane = DaemonLane(1, max_datagram=100)
    assert lane.received(100) is Received.CALL
    assert lane.received(101) is Received.TOO_LARGE
    lane.started()
    assert not lane.may_read()
    assert lane.received(0) is Received.END  # the reader saw EOF: never a call
    with pytest.raises(LaneProtocolError, match="1 running"):
        lane.received(1)


def test_daemon_lane_refuses_a_read_past_its_bound() -> None:
    lane = DaemonLane(1)
    lane.received(8)
    lane.started()
    with pytest.raises(LaneProtocolError, match="1 running"):
        lane.received(8)
    lane.half_closed()
    with pytest.raises(LaneProtocolError):
        lane.received(8)  # half-closed: nothing more is read
    lane.finished()
    assert lane.answer(b"r") and not lane.drained  # answered, not sent yet
    lane.flush()
    lane.datagram_sent()
    assert lane.drained


def test_daemon_lane_sends_nothing_once_closed() -> None:
    lane = DaemonLane(4)
    lane.answer(b"a")
    lane.flush()
    lane.answer(b"b")
    lane.close()
    assert not lane.backlog and not lane.outbox and lane.unsent == 0
    assert lane.next_datagram() is None
    with pytest.raises(LaneProtocolError):
        lane.answer(b"b")


# -- the peer's end, on the daemon's side --------------------------------------------------


def test_a_hung_up_peer_is_never_read_again() -> None:
    """The socket woke the reader and the peer closed both ways (an abort, its exit or
    death): the lane closes unread, so the calls it queued are never started; without
    a hang-up the reader reads."""
    lane = DaemonLane(4)
    assert lane.woke(hung_up=False) is None and lane.state is LaneState.OPEN
    assert lane.woke(hung_up=True) is PeerEnd.HUNG_UP


def test_an_empty_datagram_with_the_peer_hung_up_closes_without_answering() -> None:
    lane = DaemonLane(4)
    lane.received(8)
    lane.started()
    assert lane.received(0) is Received.END
    assert lane.received_end(hung_up=True) is PeerEnd.HUNG_UP
    lane.close()  # what the adapter does: the running call's answer is dropped
    lane.finished()
    assert lane.closed and lane.next_datagram() is None


def test_an_empty_datagram_without_a_hang_up_is_a_half_close() -> None:
    """The client shut its end for writing (TransferStream.close): the calls running
    are answered, then the lane closes; nothing more is read."""
    lane = DaemonLane(4, batched=True)
    for _ in range(2):
        lane.received(8)
        lane.started()
    assert lane.received(0) is Received.END
    assert lane.received_end(hung_up=False) is PeerEnd.HALF_CLOSED
    assert lane.state is LaneState.CLOSED_BY_PEER and not lane.may_read()
    assert not lane.drained  # two calls run
    for answer in (b"1", b"2"):
        lane.finished()
        lane.answer(answer)
    assert not lane.drained  # answered, not sent
    lane.flush()
    assert lane.next_datagram() == b"\n\x011\n\x012"
    lane.datagram_sent()
    assert lane.drained  # the adapter closes it now


def test_a_closing_lane_sends_this_turns_answers_unless_the_socket_is_full() -> None:
    """A lane closed for a bad datagram still answers the calls before it, if nothing
    waits before those answers; behind a backlog (a full socket) they are dropped."""
    lane = DaemonLane(4, batched=True)
    assert not lane.closing()  # nothing to send
    lane.answer(b"1")
    assert lane.closing()
    assert lane.next_datagram() == b"\n\x011" and not lane.outbox
    full = DaemonLane(4)
    full.answer(b"a")
    full.flush()  # the socket refused it: it waits in the backlog
    full.answer(b"b")
    assert not full.closing()
    full.close()
    assert full.next_datagram() is None
