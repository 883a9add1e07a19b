"""The lanes' protocols, without I/O: what may happen on a lane in which state.

A lane is one end of `socketpair(AF_UNIX, SOCK_SEQPACKET)`: one datagram is one
call or one answer, or on a batched job lane several answers
(docs/architecture.md §3, "Job lanes", "Pin lanes", "Unpin lanes"). The objects
here hold each lane's state and ordering rules; they never touch a socket, a
clock or a thread. The socket code on each side is a thin adapter over them: the
client's `kvdepot.client.job_lane` and `kvdepot.client.pin_lane` (blocking and
non-blocking send/recv on the caller's thread), the daemon's
`kvdepot.server.service.job_lane` (non-blocking, on its asyncio loop). The
adapter reports what the socket did (a datagram sent, one received, the peer
gone, a timeout) and does what the protocol answers; an event the state does not
allow raises `LaneProtocolError` (a bug in the adapter, never the peer's doing).

States, h11-style, one table per role (`CLIENT_TRANSITIONS`, `DAEMON_TRANSITIONS`):

- OPEN: calls go and answers come.
- CLOSED_BY_PEER: the peer closed its end (the client's view) or half-closed it
  (the daemon's view). Nothing more is sent by the client; what the peer sent
  before is still read (the daemon answers the jobs it has).
- BROKEN: trust is lost (an answer that does not fit its call, a timeout, a
  socket error): nothing more is read or sent; the adapter drops the lane.
- CLOSED: closed by this side.

The rules the protocols keep (each was once a bug, see `git log` of the lanes):

- `PinCalls`: answers come in the order the calls went; a call gets exactly
  one outcome, its answer or a fall-back (over gRPC) — never another call's
  answer. A peer that closed the lane after refusing a call answered the calls
  before it: those answers are still read, the rest fall back (the daemon
  pinned none of them, so nothing is pinned twice). A timeout breaks the lane:
  a late answer is never read as a later call's.
- `DaemonLane`: while `max_unread` jobs of the lane are running or answered but
  unsent, nothing more is read from it (a client that never reads cannot grow
  the daemon); a half-closed lane answers what runs, then closes; a closed one
  drops what it has not sent. Each answer is sent once, in the order made; a
  batched lane packs a loop turn's answers in as few datagrams as fit. An empty
  datagram read is the peer's end, never a call; a datagram larger than the lane
  reads is refused unparsed. A peer that hung up (closed both ways: an abort,
  its exit or death) is read no more: its calls still queued are never started,
  as nobody reads their answers; an empty datagram read without a hang-up is a
  half-close. A lane that closes still sends the answers made in that turn if
  nothing waits before them and the socket takes them then.

Which lane a client keeps, and when it opens one (reopened after a break, a
request never lost), is kvdepot.common.lane_keeping's `LaneKeeping`.

Standard library only: the protobuf messages are encoded and decoded by the
adapters (the pin answers through the `decode` they hand `PinCalls`); the
daemon's framing (a batch of results as one TransferResults, a damaged job's
job_id) is protobuf's wire format written out at the end of this module.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Sequence

from kvdepot.common.jobs import JobResult

# The largest call datagram a daemon's lane reads (a job lane: less, its largest
# legal job); a larger call goes over gRPC.
MAX_CALL_BYTES = 4 << 20


class LaneState(enum.Enum):
    OPEN = "open"
    CLOSED_BY_PEER = "closed by the peer"
    BROKEN = "broken"
    CLOSED = "closed"


class LaneEvent(enum.Enum):
    SEND = "a datagram sent"
    RECEIVE = "a datagram received"
    PEER_CLOSED = "the peer closed (or half-closed) its end"
    BREAK = "trust lost: a bad datagram, a timeout, a socket error"
    CLOSE = "closed by this side"


class LaneProtocolError(RuntimeError):
    """An event the lane's state does not allow (a bug in the adapter)."""


_OPEN, _BY_PEER, _BROKEN, _CLOSED = (
    LaneState.OPEN,
    LaneState.CLOSED_BY_PEER,
    LaneState.BROKEN,
    LaneState.CLOSED,
)
_SEND, _RECEIVE, _PEER_CLOSED, _BREAK, _CLOSE = LaneEvent

Transitions = dict[LaneState, dict[LaneEvent, LaneState]]

# The client's end: it sends calls (jobs, pins, unpins) and reads answers.
CLIENT_TRANSITIONS: Transitions = {
    _OPEN: {
        _SEND: _OPEN,
        _RECEIVE: _OPEN,
        _PEER_CLOSED: _BY_PEER,
        _BREAK: _BROKEN,
        _CLOSE: _CLOSED,
    },
    # The peer's answers sent before it closed are still read; nothing more goes.
    _BY_PEER: {_RECEIVE: _BY_PEER, _PEER_CLOSED: _BY_PEER, _BREAK: _BROKEN, _CLOSE: _CLOSED},
    _BROKEN: {_PEER_CLOSED: _BROKEN, _BREAK: _BROKEN, _CLOSE: _CLOSED},
    _CLOSED: {_PEER_CLOSED: _CLOSED, _BREAK: _CLOSED, _CLOSE: _CLOSED},
}

# The daemon's end: it reads calls and sends answers. A half-closed lane
# (CLOSED_BY_PEER) is read no more but still answered; a broken one is closed.
DAEMON_TRANSITIONS: Transitions = {
    _OPEN: {
        _SEND: _OPEN,
        _RECEIVE: _OPEN,
        _PEER_CLOSED: _BY_PEER,
        _BREAK: _CLOSED,
        _CLOSE: _CLOSED,
    },
    _BY_PEER: {_SEND: _BY_PEER, _PEER_CLOSED: _BY_PEER, _BREAK: _CLOSED, _CLOSE: _CLOSED},
    _CLOSED: {_BREAK: _CLOSED, _CLOSE: _CLOSED},
}


class LaneProtocol:
    """A lane's state, moved only through its role's transition table."""

    __slots__ = ("state",)
    transitions: Transitions = CLIENT_TRANSITIONS

    def __init__(self) -> None:
        self.state = LaneState.OPEN

    def event(self, event: LaneEvent) -> LaneState:
        """Moves to the state the table names; raises LaneProtocolError if none."""
        try:
            self.state = self.transitions[self.state][event]
        except KeyError:
            raise LaneProtocolError(
                f"{event.value} is not allowed on a lane that is {self.state.value}"
            ) from None
        return self.state

    @property
    def usable(self) -> bool:
        """New calls may go on this lane."""
        return self.state is LaneState.OPEN

    def close(self) -> None:
        self.event(LaneEvent.CLOSE)


class ClientLaneProtocol(LaneProtocol):
    """The client's end of a job or unpin lane: calls out, without per-call answers
    to match (the job lane's results name their job; unpins are not answered)."""

    __slots__ = ("max_datagram",)

    def __init__(self, max_datagram: int) -> None:
        super().__init__()
        self.max_datagram = max_datagram

    def fits(self, data: bytes) -> bool:
        """Whether `data` may go on the lane now (SEND is allowed when OPEN only and
        leaves it OPEN: the job lane's hot path asks this and reports no more).
        False: send it elsewhere (gRPC). An empty datagram would read as the end of
        the lane; a larger one than the daemon reads is refused by it."""
        return self.state is LaneState.OPEN and 0 < len(data) <= self.max_datagram

    def peer_closed(self) -> None:
        """The socket reported the peer's end closed (EOF, EPIPE, ECONNRESET)."""
        self.event(LaneEvent.PEER_CLOSED)

    def broke(self) -> None:
        self.event(LaneEvent.BREAK)


class JobCalls(ClientLaneProtocol):
    """The client's end of a job lane: TransferJob datagrams out, results back (each
    names its job: the stream matches them, not the lane). A batched lane's datagram
    is one TransferResults (`pack_results`), another's one TransferResult;
    `decode_batch` and `decode_one` (the client's codec) read them.

    An empty datagram is the daemon's end, never an answer: SOCK_SEQPACKET reads the
    peer's shutdown as a datagram of no bytes (and so nothing sends one: `fits`)."""

    __slots__ = ("_decode", "answer_bytes")

    def __init__(
        self,
        max_datagram: int,
        batched: bool,
        decode_one: Callable[[bytes], JobResult],
        decode_batch: Callable[[bytes], list[JobResult]],
    ) -> None:
        super().__init__(max_datagram)
        # The receive size: a batched datagram is at most RESULTS_DATAGRAM_BYTES unless
        # one result alone is larger, read with room to spare; a result alone is a few
        # hundred bytes at most.
        self.answer_bytes = 2 * RESULTS_DATAGRAM_BYTES if batched else 1 << 16
        self._decode = decode_batch if batched else lambda data: [decode_one(data)]

    def receive(self, data: bytes) -> list[JobResult] | None:
        """The results in a datagram read; None: the lane ended (`data` is empty). A
        datagram that does not decode breaks the lane, and its error is raised."""
        if not data:
            self.event(LaneEvent.PEER_CLOSED)
            return None
        try:
            return self._decode(data)
        except Exception:
            self.event(LaneEvent.BREAK)
            raise


class PinCalls(ClientLaneProtocol):
    """The client's end of a pin lane: PinRequest calls out, one PinResponse per
    call back, in order. `decode(answer)` is the answer's per-key pinned flags
    (it raises on a datagram that is no PinResponse)."""

    __slots__ = ("_decode", "_owed")

    def __init__(self, max_datagram: int, decode: Callable[[bytes], Sequence[bool]]) -> None:
        super().__init__(max_datagram)
        self._decode = decode
        self._owed: collections.deque[int] = collections.deque()  # key counts, oldest first

    @staticmethod
    def goes_on_lane(keys: int) -> bool:
        """Whether a call of `keys` keys is sent at all: a call of none is answered at
        once (nothing pinned), as its answer, an empty PinResponse, would be an empty
        datagram, which reads as the daemon closing the lane."""
        return keys > 0

    @property
    def owed(self) -> int:
        """Calls sent and not answered (nor given up)."""
        return len(self._owed)

    def answer_bytes(self) -> int:
        """The receive size for the oldest call's answer: a PinResponse is one byte
        per key (packed bools) and a few of framing."""
        return self._owed[0] + 64

    def call_sent(self, keys: int) -> None:
        """One call of `keys` keys went; its answer is read after those owed before."""
        if not self.goes_on_lane(keys):
            raise LaneProtocolError("a pin call of no keys was sent: its answer reads as EOF")
        self.event(LaneEvent.SEND)
        self._owed.append(keys)

    def send_refused(self) -> None:
        """A send found the lane closed by the peer. With answers owed, they are
        still to be read (the peer answered them before it closed); without, the
        lane is of no more use."""
        self.event(LaneEvent.PEER_CLOSED)
        if not self._owed:
            self.event(LaneEvent.BREAK)

    def receive(self, data: bytes) -> list[bool] | None:
        """The oldest owed call's answer, from `data` (b"": the peer closed, as no
        answer is empty: `goes_on_lane`). None: no answer for it (the peer closed, or
        `data` does not fit the call): the lane is broken and that call and every
        later one fall back."""
        if self.state is LaneState.CLOSED:
            # Closed by this side meanwhile (its session ended, on another thread):
            # whatever is read now is no answer to trust.
            self._owed.clear()
            return None
        if not self._owed:
            raise LaneProtocolError("an answer was read with no call owed one")
        self.event(LaneEvent.RECEIVE)
        n = self._owed.popleft()
        try:
            pinned = list(self._decode(data)) if data else None
        except Exception:  # DecodeError: never hand it to the caller
            pinned = None
        if pinned is None or len(pinned) != n:  # closed, or not this call's answer
            self.give_up()
            return None
        if not self._owed and self.state is LaneState.CLOSED_BY_PEER:
            self.event(LaneEvent.BREAK)  # every answer read: the lane is spent
        return pinned

    def read_failed(self, reset: bool) -> bool:
        """Reading the next answer raised. `reset` (ECONNRESET): the daemon closed the
        lane with calls of ours unread (it refused one); Linux reports that once, ahead
        of the answers it sent before, which are still there: True, read again. Any
        other error: False, and the oldest call owed reads as no answer (`receive`
        of b"": it and every later one fall back)."""
        if reset:
            self.event(LaneEvent.PEER_CLOSED)
            return True
        return False

    def timed_out(self) -> None:
        """The answers did not come in time: a late one must never be read as a
        later call's, so the lane breaks and the calls owed fall back."""
        self.give_up()

    def broke(self) -> None:
        self.give_up()

    def give_up(self) -> None:
        """The calls owed get no answer here (they fall back); the lane is broken."""
        self._owed.clear()
        self.event(LaneEvent.BREAK)


class Flush(enum.Enum):
    """When the adapter flushes a daemon lane's outbox after an answer joined it."""

    NOW = "now: the lane sends each answer as it is made"
    END_OF_TURN = "once, when this turn of the loop has made every answer it will"


class Received(enum.Enum):
    """What a datagram read by the daemon is (`DaemonLane.received`)."""

    CALL = "a call: the adapter parses and runs it"
    TOO_LARGE = "larger than the lane reads: refused unparsed (`leading_job_id`)"
    END = "the empty datagram: the peer shut its end (half-closed, or hung up)"


class PeerEnd(enum.Enum):
    """What the peer's end means for a daemon lane (`DaemonLane.woke`, `received_end`)."""

    HUNG_UP = "closed both ways (an abort, exit, death): close now, skip calls not started"
    HALF_CLOSED = "shut for writing: the lane answers what runs, then closes"


class DaemonLane(LaneProtocol):
    """The daemon's end of a lane (jobs, pins or unpins), on its event loop.

    Calls: the adapter reads a datagram only while `may_read` and tells `received`
    its size, which says what it is (a call, one too large to parse, the peer's
    end). Reads are bounded: `may_read` is False while `max_unread` calls are
    running (`started`, not yet `finished`) or answered but unsent.

    Answers: `answer` puts one in the outbox and says when the adapter flushes
    (`Flush`: at once, or on a batched lane once per loop turn); `flush` frames the
    outbox as datagrams (one answer each, or on a batched lane several packed as
    one TransferResults, `pack_results`) behind those still unsent, and the adapter
    sends `next_datagram` until the socket refuses one, reporting each with
    `datagram_sent`. The datagrams go once each, in the order the answers were made.
    """

    __slots__ = ("backlog", "batched", "max_datagram", "max_unread", "outbox", "running", "unsent")
    transitions = DAEMON_TRANSITIONS

    def __init__(
        self, max_unread: int, max_datagram: int = MAX_CALL_BYTES, batched: bool = False
    ) -> None:
        super().__init__()
        self.max_unread = max_unread
        self.max_datagram = max_datagram  # the largest datagram parsed
        self.batched = batched  # answers packed as TransferResults (job lanes that asked)
        self.running = 0
        self.unsent = 0
        self.outbox: list[bytes] = []  # answers made this turn, not framed yet
        # Framed datagrams not sent yet (the socket was full), oldest first, each with
        # how many answers it carries.
        self.backlog: collections.deque[tuple[bytes, int]] = collections.deque()

    def may_read(self) -> bool:
        return self.state is LaneState.OPEN and self.running + self.unsent < self.max_unread

    def received(self, size: int) -> Received:
        """A datagram of `size` bytes was read (the adapter reads only while
        `may_read`; an empty one is the peer's end, whatever the bound). RECEIVE
        keeps an OPEN lane OPEN: checked here without the table, as this runs per
        job."""
        if size == 0:
            return Received.END
        if not self.may_read():
            raise LaneProtocolError(
                f"a datagram was read from a lane that is {self.state.value}, with "
                f"{self.running} running and {self.unsent} unsent of {self.max_unread}"
            )
        return Received.TOO_LARGE if size > self.max_datagram else Received.CALL

    def started(self) -> None:
        self.running += 1

    def finished(self) -> None:
        self.running -= 1

    def answer(self, data: bytes) -> Flush | None:
        """`data` joins the outbox. The flush the adapter makes for it: None when one
        is due already (the outbox held an answer). SEND keeps the state as it is
        where allowed (OPEN, CLOSED_BY_PEER): checked here without the table, as
        this runs per job."""
        if self.state is LaneState.CLOSED:
            self.event(LaneEvent.SEND)  # raises: nothing goes on a closed lane
        self.outbox.append(data)
        self.unsent += 1
        if len(self.outbox) > 1:
            return None
        return Flush.END_OF_TURN if self.batched else Flush.NOW

    def flush(self) -> None:
        """The outbox's answers, framed as this lane's datagrams, go behind the
        datagrams not sent yet; the outbox is empty after."""
        answers, self.outbox = self.outbox, []
        if self.batched:
            self.backlog += pack_results(answers)
        elif len(answers) == 1:  # an unbatched lane flushes each answer as it is made
            self.backlog.append((answers[0], 1))
        else:
            self.backlog += [(a, 1) for a in answers]

    def next_datagram(self) -> bytes | None:
        """The datagram to send now (it stays the next one until `datagram_sent`);
        None when none waits or the lane is closed."""
        return self.backlog[0][0] if self.backlog and self.state is not LaneState.CLOSED else None

    def datagram_sent(self) -> None:
        """The socket took `next_datagram`."""
        self.unsent -= self.backlog.popleft()[1]

    def half_closed(self) -> None:
        """The peer will send nothing more: answer what runs, then close."""
        self.event(LaneEvent.PEER_CLOSED)

    def woke(self, hung_up: bool) -> PeerEnd | None:
        """The socket woke the reader; `hung_up`: it also reports the peer closed both
        ways (POLLHUP). HUNG_UP: the adapter closes the lane unread, so that the calls
        queued are never started (as a cancelled Transfer stream's: nobody would read
        their answers). None: read."""
        return PeerEnd.HUNG_UP if hung_up else None

    def received_end(self, hung_up: bool) -> PeerEnd:
        """`received` said END (the empty datagram); `hung_up`: as `woke`'s. HUNG_UP:
        the adapter closes the lane, skipping the calls not started. HALF_CLOSED:
        the peer awaits its answers: the lane is read no more and answers what runs
        (`drained` says when to close)."""
        if hung_up:
            return PeerEnd.HUNG_UP
        self.half_closed()
        return PeerEnd.HALF_CLOSED

    def closing(self) -> bool:
        """The adapter is about to `close`. True: it sends `next_datagram` while the
        socket takes one (errors ignored): the answers made this turn, framed now,
        as no datagram waits before them (a lane closed for a bad datagram still
        answers the calls before it; a backlog means the socket is full)."""
        if not self.outbox or self.backlog or self.state is LaneState.CLOSED:
            return False
        self.flush()
        return True

    @property
    def drained(self) -> bool:
        """Half-closed and everything answered and sent: time to close."""
        return self.state is LaneState.CLOSED_BY_PEER and not self.running and not self.unsent

    @property
    def closed(self) -> bool:
        return self.state is LaneState.CLOSED

    def close(self) -> None:
        """Closed: what is unsent is dropped (nobody reads it)."""
        self.event(LaneEvent.CLOSE)
        self.backlog.clear()
        self.outbox.clear()
        self.unsent = 0


# -- framing: protobuf's wire format, by hand (this module is standard library only) ----

# A batched job lane's datagram carries results up to this size (a result alone may be
# larger: it goes alone); the client reads with a buffer of twice this.
RESULTS_DATAGRAM_BYTES = 1 << 16
# The tag of TransferResults.results (field 1, length-delimited): a batch is its
# results' bytes, each behind this tag and its length, with no message built.
_RESULTS_TAG = b"\x0a"
_UINT64 = (1 << 64) - 1


def _varint_bytes(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); IndexError when cut short, ValueError past 10 bytes
    (as protobuf's decoder: the value is kept to 64 bits)."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result & _UINT64, pos
        shift += 7
        if shift >= 64:
            raise ValueError("a varint of more than 10 bytes")


def pack_results(answers: list[bytes]) -> list[tuple[bytes, int]]:
    """Serialized TransferResults as TransferResults datagrams of at most
    RESULTS_DATAGRAM_BYTES (a larger result alone in its own), each with how
    many results it carries."""
    datagrams: list[tuple[bytes, int]] = []
    parts: list[bytes] = []
    size = count = 0
    for data in answers:
        length = _varint_bytes(len(data))
        item = 1 + len(length) + len(data)
        if count and size + item > RESULTS_DATAGRAM_BYTES:
            datagrams.append((b"".join(parts), count))
            parts, size, count = [], 0, 0
        parts += (_RESULTS_TAG, length, data)
        size += item
        count += 1
    if count:
        datagrams.append((b"".join(parts), count))
    return datagrams


def leading_job_id(data: bytes) -> int | None:
    """The job_id (field 1, varint) of a TransferJob datagram that does not parse as a
    whole, read from the well-formed fields before the damage; None if there is
    none (the lane cannot say which job failed)."""
    pos, end = 0, len(data)
    try:
        while pos < end:
            tag, pos = _read_varint(data, pos)
            field, wire_type = tag >> 3, tag & 7
            value = None
            if wire_type == 0:  # varint
                value, pos = _read_varint(data, pos)
            elif wire_type == 1:  # fixed64
                pos += 8
            elif wire_type == 5:  # fixed32
                pos += 4
            elif wire_type == 2:  # length-delimited
                size, pos = _read_varint(data, pos)
                pos += size
            else:  # a group (no field of a TransferJob) or no wire type: the damage
                return None
            if pos > end:  # cut short
                return None
            if field == 1 and value is not None:
                return value
    except (IndexError, ValueError):  # the damage: no job_id before it
        return None
    return None
