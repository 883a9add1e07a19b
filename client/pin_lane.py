"""A scheduler's pin and unpin lanes: Pin and Unpin calls as datagrams on Unix socket pairs.

The step's one Pin call is the only wait on the daemon in vLLM's scheduler step.
Over gRPC a unary call costs about half a millisecond when warm, and over a
millisecond more after a quiet spell (gRPC's threads wake up on both sides),
every step that has hits. Over a lane (kvdepot.client.job_lane's socket pair,
opened with kind LANE_PINS) it is one datagram each way, answered on the
daemon's loop.

`PinLane.pin` returns None whenever the lane cannot answer: none is open yet
(it opens in the background when a session starts), the daemon has no lanes,
or the lane broke or was closed by a daemon that refused the pin. The caller
then pins over gRPC, whose status says why a pin was refused. A pin that
times out on the lane raises `PinTimeout`, and the lane is dropped (a late
answer must never be read as the next call's) and reopened in the background.
KVDEPOT_JOB_LANE=0 keeps pins on gRPC too. Pins may also be pipelined: the
scheduler `send`s its step's loads in parts as vLLM prepares them, so that the
daemon pins while the step goes on, and reads every answer at the step's end
(`answers`).

`UnpinLane.unpin` sends a batch of unpins (kind LANE_UNPINS) without waiting for
an answer. The scheduler's unpin thread uses it: a gRPC Unpin call kept that
thread busy, holding the GIL the scheduler needs, for about a millisecond after
every step that completed loads; a datagram costs it tens of microseconds. It
returns the keys the lane could not take, and the caller unpins those over gRPC.

The rules of which answer belongs to which call, and when a lane is spent, are
the pin lane's sans-I/O protocol (`PinCalls`, kvdepot.common.lane_protocol); the
classes here are its socket adapters. Each lane is kept by the client's one
`LaneKeeper` (kvdepot.client.lane_keeper, over kvdepot.common.lane_keeping's
rules): opened when a session starts and when a call finds none, reopened at once
after a break, not before a fixed `retry_s` after a failed open; a request inside
that wait is deferred to its end, never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvdepot.client.job_lane import ClientLane, LaneOwner, enabled_by_env
from kvdepot.client.lane_keeper import LaneKeeper
from kvdepot.common.lane_protocol import PinCalls
from kvdepot.v1 import depot_pb2

# A vLLM key is 36 bytes: 1024 of them make a datagram of about 40 KB, within the
# socket buffers the kernel allows by default (net.core.wmem_max) and the daemon's
# per-call key limit.
UNPIN_KEYS_PER_DATAGRAM = 1024


class PinLaneOwner(LaneOwner, Protocol):
    """What the pin and unpin lanes ask of their client beyond a lane's."""

    def joined(self, namespace_id: str, session_id: str) -> bool: ...


class PinTimeout(TimeoutError):
    """The daemon did not answer a pin on the lane within the deadline."""


class KeptLane:
    """A lane of one kind for the client's current session, kept by a `LaneKeeper`
    (kvdepot.client.lane_keeper): asked for when a session starts (`open_soon`) and
    by a call that finds none, dropped when the session ends, reopened after a
    break, not before `retry_s` after a failed open."""

    kind: depot_pb2.LaneKind
    noun: str  # in log lines

    def __init__(self, client: PinLaneOwner, retry_s: float = 5.0) -> None:
        self._client = client
        self.keeper = LaneKeeper(
            client, self.kind, self.noun, wanted=enabled_by_env(), retry_s=retry_s
        )

    @property
    def open(self) -> bool:
        return self.keeper.open

    def open_soon(self) -> None:
        """A lane for the current session, opened in the background (its session
        started), unless one is open or lanes are off."""
        self.keeper.want()

    def drop(self) -> None:
        """Forgets the lane (its session ended: the daemon closed its end)."""
        self.keeper.drop()


class PinLane(KeptLane):
    """The pin lane of one DepotClient, used from one thread at a time (vLLM's
    scheduler thread). Pins may be pipelined: `send` several calls, then read all
    their answers with one `answers`; `pin` is one call and its answer."""

    kind = depot_pb2.LANE_PINS
    noun = "pin"

    def __init__(self, client: PinLaneOwner, retry_s: float = 5.0) -> None:
        super().__init__(client, retry_s)
        self.lane_pins = 0  # pins answered on the lane (tests, benchmarks)
        # The lane the calls owed an answer went on (None: none owed). Its PinCalls
        # protocol counts them; a new lane takes calls only once they are read.
        self._sent_on: ClientLane | None = None

    def send(
        self,
        session_id: str,
        namespace_id: str,
        keys: Sequence[bytes],
        payload: bytes | None = None,
    ) -> bool:
        """Sends one pin call and returns at once; the next `answers` reads its answer.
        False: it did not go (no lane for this session, a call too large for a
        datagram, answers still owed on an earlier lane, a broken lane, a namespace
        this session has not joined yet): pin those keys over gRPC. `payload`:
        `encode_pin_keys(keys)`, when the caller sends the same keys to several shards."""
        if not PinCalls.goes_on_lane(len(keys)):
            return True  # nothing to pin: answered at once, nothing sent
        lane = self.keeper.lane_for(session_id)
        if lane is None or (self._sent_on is not None and lane is not self._sent_on):
            return False
        if not self._client.joined(namespace_id, session_id):
            return False  # the daemon would refuse it (and close the lane): gRPC joins first
        calls = _calls(lane)
        header = depot_pb2.PinRequest(session_id=session_id, namespace_id=namespace_id)
        data = header.SerializeToString() + (encode_pin_keys(keys) if payload is None else payload)
        try:
            # Never blocks (`answers` leaves a timeout on the socket, under which a full
            # buffer would be waited for): the step's only wait is for the answers.
            lane.sock.settimeout(0.0)
            if not lane.send(data):  # too large, or the daemon is behind: gRPC, this once
                return False
        except OSError:
            # Closed by the daemon, which may have refused an earlier call: the answers
            # it gave before are still to be read (PinCalls keeps the lane for them).
            calls.send_refused()
            if not calls.owed:
                self.keeper.broke(lane)
            return False
        calls.call_sent(len(keys))
        self._sent_on = lane
        return True

    def answers(self, timeout: float) -> list[bool]:
        """Per key of the calls sent since the last `answers`, in the order sent,
        whether it was pinned. Fewer keys than were sent when the lane could not
        answer them all (the daemon refused a call and closed the lane, dropping the
        calls behind it; or the lane broke): the daemon did not pin the rest, so pin
        those over gRPC. Raises `PinTimeout` when the answers are not all in within
        `timeout` seconds, and drops the lane (a late answer must never be read as a
        later call's)."""
        lane, self._sent_on = self._sent_on, None
        pinned: list[bool] = []
        if lane is None:
            return pinned
        calls = _calls(lane)
        deadline = time.monotonic() + timeout
        while calls.owed:
            size = calls.answer_bytes()
            try:
                lane.sock.settimeout(max(deadline - time.monotonic(), 1e-6))
                reply = lane.sock.recv(size)
            except TimeoutError:
                calls.timed_out()
                self.keeper.broke(lane)
                raise PinTimeout(
                    f"no answer on the pin lane within {timeout * 1e3:.0f} ms"
                ) from None
            except OSError as exc:  # a reset: the answers before it are still there
                reset = isinstance(exc, ConnectionResetError)
                reply = _recv_or_nothing(lane, size) if calls.read_failed(reset) else b""
            got = calls.receive(reply)
            if got is None:  # closed, broken, or not this call's answer: the rest fall back
                break
            pinned += got
            self.lane_pins += 1
        if not calls.usable:
            self.keeper.broke(lane)
        return pinned

    def pin(
        self, session_id: str, namespace_id: str, keys: Sequence[bytes], timeout: float
    ) -> list[bool] | None:
        """Per key, whether it was pinned; None: ask over gRPC instead. Not for use
        while calls sent with `send` wait for their answers."""
        if self._sent_on is not None or not self.send(session_id, namespace_id, keys):
            return None
        pinned = self.answers(timeout)
        return pinned if len(pinned) == len(keys) else None


def encode_pin_keys(keys: Sequence[bytes]) -> bytes:
    """A PinRequest's keys on the wire, apart from its header: protobuf reads fields
    in any order, so header + keys is one PinRequest, and keys sent to several shards
    are encoded once."""
    return depot_pb2.PinRequest(keys=keys).SerializeToString()


def _calls(lane: ClientLane) -> PinCalls:
    calls = lane.protocol
    assert isinstance(calls, PinCalls), "a pin lane's protocol is PinCalls (ClientLane)"
    return calls


def _recv_or_nothing(lane: ClientLane, size: int) -> bytes:
    try:
        return lane.sock.recv(size)
    except OSError:
        return b""


def tail_first_parts(n: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of `n` keys cut in parts of at most `size`, the last part first: a
    touch sent in parts keeps a request's head the youngest (the daemon makes each
    part's rows young as it comes)."""
    for end in range(n, 0, -size):
        yield max(0, end - size), end


class UnpinLane(KeptLane):
    """The unpin lane of one DepotClient. `unpin` is called from one thread at a time
    (the scheduler's unpin thread)."""

    kind = depot_pb2.LANE_UNPINS
    noun = "unpin"

    def __init__(self, client: PinLaneOwner, retry_s: float = 5.0) -> None:
        super().__init__(client, retry_s)
        self.lane_unpins = 0  # unpin calls sent on the lane (tests, benchmarks)
        self.lane_touches = 0  # touch datagrams sent on the lane (tests, benchmarks)

    def unpin(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> Sequence[bytes]:
        """Sends the unpins without waiting for an answer, in datagrams of at most
        `UNPIN_KEYS_PER_DATAGRAM` keys (fewer if the daemon's call limit is lower).
        Returns the keys that did not go (none when all went): unpin those over
        gRPC, and only those (a key unpinned twice would drop another request's pin)."""
        lane = self.keeper.lane_for(session_id)
        if lane is None or not self._client.joined(namespace_id, session_id):
            return keys  # not joined: the daemon would close the lane
        per_datagram = self._keys_per_datagram()
        for start in range(0, len(keys), per_datagram):
            data = depot_pb2.UnpinRequest(
                session_id=session_id,
                namespace_id=namespace_id,
                keys=keys[start : start + per_datagram],
            ).SerializeToString()
            if not self.keeper.send(lane, data):
                return keys[start:]
            self.lane_unpins += 1
        return ()

    def touch(self, session_id: str, namespace_id: str, keys: Sequence[bytes]) -> Sequence[bytes]:
        """Sends `keys` (finished requests' chunks used again: UnpinRequest.touch_keys)
        without waiting, the last datagram's worth first, so that a request's head
        stays the youngest however its keys are cut. Returns the keys that did not go."""
        lane = self.keeper.lane_for(session_id)
        if lane is None or not self._client.joined(namespace_id, session_id):
            return keys
        for start, end in tail_first_parts(len(keys), self._keys_per_datagram()):
            data = depot_pb2.UnpinRequest(
                session_id=session_id, namespace_id=namespace_id, touch_keys=keys[start:end]
            ).SerializeToString()
            if not self.keeper.send(lane, data):
                return keys[:end]
            self.lane_touches += 1
        return ()

    def _keys_per_datagram(self) -> int:
        per_datagram = UNPIN_KEYS_PER_DATAGRAM
        hello = self._client.hello
        if hello is not None and hello.max_job_keys:
            # The daemon refuses a call of more than 16 jobs' keys.
            per_datagram = min(per_datagram, hello.max_job_keys * 16)
        return per_datagram
