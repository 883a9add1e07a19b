"""Which lane a client keeps and when it opens one (kvdepot.common.lane_keeping's
LaneKeeping), fed events on a simulated clock: sessions lost and back, calls, opens
that succeed or fail, lanes that break, timers.

`Adapter` does what the client's one adapter does (kvdepot.client.lane_keeper's
LaneKeeper): it asks for a lane for the client's session when a call finds none
(and, for the pin and unpin lanes, when a session starts), does what the keeping
answers (open, arm one timer, nothing), opens for the session of the moment, and
an open succeeds only if that session is still there when it completes. A session
lost breaks its lane (the daemon closed its end). Whatever happens, a session that
is up gets its lane back: a pin lane with no call asking again, a job lane at the
next job. The sockets are covered by tests/test_pin_lane.py and
tests/test_job_lane.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.common.lane_keeping import OPEN, LaneKeeping

RETRY_S = 5.0
OPEN_S = 0.01  # how long an open takes


@dataclass(eq=False)
class Lane:
    """A lane as the adapter holds it: the session it was opened for."""

    session: int
    closed: bool = False


@dataclass
class Adapter:
    """A client lane's adapter over LaneKeeping, on a simulated clock. `pins`: the
    pin and unpin lanes' (reopened at once after a break, asked for when a session
    starts and dropped when it ends); else the job lane's (every call asks)."""

    pins: bool = True
    keeping: LaneKeeping[Lane] = field(init=False)
    now: float = 0.0
    session: int = 0  # the daemon's session id; 0: none (the daemon is away)
    timer_at: float | None = None
    open_done_at: float | None = None
    open_for: int = 0  # the session the open under way was made for
    opens: int = 0
    lanes: list[Lane] = field(default_factory=list)  # every lane opened

    def __post_init__(self) -> None:
        self.keeping = LaneKeeping(RETRY_S, reopen_on_break=self.pins)

    @property
    def lane(self) -> int:
        """The session the lane kept serves (0: none)."""
        return self.keeping.lane.session if self.keeping.lane is not None else 0

    def session_now(self) -> str | None:
        return str(self.session) if self.session else None

    def call(self) -> None:
        """A call (a job, a pin, an unpin) of the current session looks for its lane."""
        if self.session and self.keeping.lane_for(str(self.session)) is None:
            self.do(self.keeping.want(str(self.session), self.now))

    def do(self, action: float | None) -> None:
        if action is None:
            return
        if action == OPEN:
            assert self.open_done_at is None, "two opens at once"
            self.open_done_at, self.open_for = self.now + OPEN_S, self.session
            self.opens += 1
            return
        assert action > 0 and self.timer_at is None, "a second timer"
        self.timer_at = self.now + action

    def break_lane(self, lane: Lane | None) -> None:
        if lane is not None and not lane.closed:
            lane.closed = True
            self.do(self.keeping.broke(lane, self.now))

    def session_lost(self) -> None:
        """The daemon went away: it closed the session's lanes, which break."""
        self.session = 0
        for lane in self.lanes:
            self.break_lane(lane)
        if self.pins:  # on_disconnect: the lane (if one opened meanwhile) is dropped
            dropped = self.keeping.drop()
            if dropped is not None:
                dropped.closed = True

    def session_back(self, session: int) -> None:
        self.session = session
        if self.pins:
            self.call()  # on_session: open_soon

    def advance(self, to: float) -> None:
        """Runs the timer and the open under way, in time order, up to `to`."""
        while True:
            due = [t for t in (self.timer_at, self.open_done_at) if t is not None and t <= to]
            if not due:
                break
            self.now = min(due)
            if self.now == self.open_done_at:
                self.open_done_at = None
                if self.open_for and self.open_for == self.session:
                    lane = Lane(self.open_for)
                    self.lanes.append(lane)
                    close, then = self.keeping.opened(lane, str(lane.session), self.now)
                    if close is not None:
                        close.closed = True
                    self.do(then)
                else:  # no session, or the one it was made for is gone
                    self.do(self.keeping.failed(self.now))
            else:
                self.timer_at = None
                self.do(self.keeping.timer_fired(self.session_now(), self.now))
        self.now = to


def test_a_session_back_inside_the_back_off_gets_its_lane_at_its_end() -> None:
    """The lost reopen: the open fails while the daemon is away (a 5 s back-off);
    the session comes back 4.6 s later, inside it: the lane opens at its end."""
    a = Adapter()
    a.session_back(1)
    a.advance(1.0)
    assert a.lane == 1
    a.session_lost()  # the lane breaks: reopened at once, and that open fails
    a.advance(1.1)
    assert a.lane == 0 and a.opens == 2
    a.advance(1.1 + 4.6)
    a.session_back(2)
    assert a.timer_at is not None and a.timer_at <= 1.01 + RETRY_S
    a.call()  # more calls inside the back-off: still one timer
    a.advance(1.01 + RETRY_S + OPEN_S)
    assert a.lane == 2 and a.opens == 3


def test_a_request_during_an_open_that_fails_is_deferred_not_dropped() -> None:
    a = Adapter()
    a.session_back(1)
    a.session_lost()  # the open under way was made for session 1: it fails
    a.session_back(2)  # asked while opening
    a.advance(OPEN_S)
    assert a.lane == 0 and a.timer_at == OPEN_S + RETRY_S
    a.advance(OPEN_S + RETRY_S + OPEN_S)
    assert a.lane == 2


def test_a_lane_serves_only_its_session_and_a_newer_one_replaces_it() -> None:
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    assert k.want("1", 0.0) == OPEN
    old = Lane(1)
    assert k.opened(old, "1", 0.01) == (None, None)
    assert k.lane_for("1") is old and k.lane_for("2") is None
    assert k.want("1", 0.02) is None  # served
    assert k.want("2", 0.03) == OPEN  # a newer session's call
    new = Lane(2)
    close, then = k.opened(new, "2", 0.04)
    assert close is old and then is None  # the older lane is closed once this one opens
    assert k.lane_for("2") is new and k.lane_for("1") is None


def test_an_open_for_an_older_session_asks_again_for_the_newer() -> None:
    """The open read session 1; session 2 asked while it ran: the lane opened for 1
    is kept until 2's opens, at once (the open succeeded: no back-off)."""
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    assert k.want("1", 0.0) == OPEN
    assert k.want("2", 0.001) is None  # one open at a time
    lane1 = Lane(1)
    assert k.opened(lane1, "1", 0.01) == (None, OPEN)
    lane2 = Lane(2)
    assert k.opened(lane2, "2", 0.02) == (lane1, None)


@pytest.mark.parametrize("pins", [True, False])
def test_a_broken_lane_is_forgotten_and_asked_for_again_as_its_kind_says(pins: bool) -> None:
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S, reopen_on_break=pins)
    k.want("1", 0.0)
    lane = Lane(1)
    k.opened(lane, "1", 0.01)
    # A pin or unpin lane is asked for again at once (no call may come to ask: an
    # unpin lane is asked for when a session starts); a job lane by the next job.
    assert k.broke(lane, 1.0) == (OPEN if pins else None)
    assert k.lane is None and k.lane_for("1") is None
    assert k.want("1", 1.0) == (None if pins else OPEN)


def test_the_break_of_a_lane_no_longer_kept_changes_nothing() -> None:
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    k.want("1", 0.0)
    old = Lane(1)
    k.opened(old, "1", 0.01)
    k.want("2", 0.02)
    new = Lane(2)
    k.opened(new, "2", 0.03)
    assert k.broke(old, 0.04) is None  # its reader saw the close
    assert k.lane is new and not k.opening
    dropped = Lane(2)
    k.broke(new, 0.05)  # reopened at once
    assert k.opened(dropped, "2", 0.06) == (None, None)
    assert k.drop() is dropped
    assert k.broke(dropped, 0.07) is None and not k.opening  # dropped: its session ended


def test_a_break_while_an_open_is_under_way_opens_once() -> None:
    """An older session's lane breaks while the newer session's lane opens: one
    open, whose lane is kept; the break asks nothing more."""
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    k.want("1", 0.0)
    old = Lane(1)
    k.opened(old, "1", 0.01)
    assert k.want("2", 1.0) == OPEN
    assert k.broke(old, 1.001) is None  # asked again for session 1, while opening
    new = Lane(2)
    assert k.opened(new, "2", 1.01) == (None, OPEN)  # 1 asked: its call, if any, checks
    assert k.lane is new


def test_one_open_at_a_time_and_one_timer_per_back_off() -> None:
    k: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    assert k.want("1", 0.0) == OPEN
    assert k.want("1", 0.1) is None  # one open at a time
    assert k.failed(0.2) == 5.0  # asked meanwhile: a timer for the back-off's end
    assert k.want("1", 1.2) is None  # the timer covers it
    assert k.timer_fired("1", 5.2) == OPEN
    assert k.failed(5.25) is None  # nobody asked meanwhile: no timer
    assert k.want("1", 6.5) == 3.75  # inside the back-off: a timer for its end
    assert k.timer_fired(None, 10.25) is None  # no session then: the next one asks
    assert k.want("2", 10.3) == OPEN
    assert k.failed(10.5) is None
    assert k.want("2", 15.5) == OPEN  # the back-off is fixed: 5 s again, no more


def test_lanes_off_and_stopped_never_open() -> None:
    off: LaneKeeping[Lane] = LaneKeeping(RETRY_S, wanted=False)
    assert off.want("1", 0.0) is None
    refused: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    assert refused.want("1", 0.0) == OPEN
    refused.want("1", 0.1)  # asked meanwhile
    assert refused.failed(0.2, permanent=True) is None  # the daemon has no lanes
    assert refused.want("1", 100.0) is None and not refused.wanted
    stopped: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    assert stopped.want("1", 0.0) == OPEN
    assert stopped.stop() is None  # the stream closed while its lane opened
    late = Lane(1)
    assert stopped.opened(late, "1", 0.01) == (late, None)  # closed, never kept
    assert stopped.lane is None and stopped.want("1", 100.0) is None
    kept: LaneKeeping[Lane] = LaneKeeping(RETRY_S)
    kept.want("1", 0.0)
    lane = Lane(1)
    kept.opened(lane, "1", 0.01)
    assert kept.stop() is lane and kept.broke(lane, 0.02) is None


# The daemon away and back, calls that find no lane, lanes that break, at any times.
steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=7.0),
        st.sampled_from(["lost", "back", "call", "break", "break an older"]),
    ),
    max_size=30,
)


@pytest.mark.parametrize("pins", [True, False], ids=["pin lane", "job lane"])
@settings(max_examples=300, deadline=None)
@given(script=steps)
def test_a_session_that_comes_back_always_gets_its_lane(pins: bool, script) -> None:
    a = Adapter(pins=pins)
    a.session_back(1)
    a.call()
    sessions = 1
    for dt, what in script:
        a.advance(a.now + dt)
        if what == "lost":
            a.session_lost()
        elif what == "back" and not a.session:
            sessions += 1
            a.session_back(sessions)
        elif what == "call":
            a.call()
        elif what == "break":  # a socket error on the lane kept
            a.break_lane(a.keeping.lane)
        elif what == "break an older" and len(a.lanes) > 1:
            a.break_lane(a.lanes[-2])
    if not a.session:
        sessions += 1
        a.session_back(sessions)
    if not pins:
        a.call()  # the job lane: the next job asks (pins: the session's start did)
    # Nothing asks any more: within a failing open, a back-off and an open, the lane
    # is there, and the only one open.
    a.advance(a.now + RETRY_S + 3 * OPEN_S)
    assert a.lane == a.session == sessions
    assert a.timer_at is None and a.open_done_at is None
    assert [lane for lane in a.lanes if not lane.closed] == [a.keeping.lane]
