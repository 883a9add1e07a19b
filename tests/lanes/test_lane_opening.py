"""When a client lane opens (kvdepot.common.lane_protocol.LaneOpening), driven on a
simulated clock through any interleaving of sessions lost and back, opens that
succeed or fail, and requests.

The adapter modelled here does what the client's do (kvdepot.client.pin_lane's
SessionLane, kvdepot.client.job_lane's LaneKeeper): it asks for a lane when a
session starts and when a call finds none, does what LaneOpening answers (open,
arm one timer, nothing), and an open succeeds only if the session it was made for
is still there when it completes. Whatever happens, a session that is up gets its
lane back within the back-off. The sockets are covered by tests/test_pin_lane.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.common.lane_protocol import LaneOpening

RETRY_S = 5.0
OPEN_S = 0.01  # how long an open takes


@dataclass
class Adapter:
    """A client lane's adapter over LaneOpening, on a simulated clock."""

    opening: LaneOpening = field(default_factory=lambda: LaneOpening(RETRY_S))
    now: float = 0.0
    session: int = 0  # the daemon's session id; 0: none (the daemon is away)
    lane: int = 0  # the session the open lane belongs to; 0: none
    timer_at: float | None = None
    open_done_at: float | None = None
    open_for: int = 0  # the session the open under way was made for
    opens: int = 0

    def request(self) -> None:
        if self.lane and self.lane == self.session:
            return
        self.do(self.opening.request(self.now))

    def do(self, action: float | None) -> None:
        if action is None:
            return
        if action == 0.0:
            assert self.open_done_at is None, "two opens at once"
            self.open_done_at, self.open_for = self.now + OPEN_S, self.session
            self.opens += 1
            return
        assert action > 0 and self.timer_at is None, "a second timer"
        self.timer_at = self.now + action

    def session_lost(self) -> None:
        self.session, self.lane = 0, 0

    def session_back(self, session: int) -> None:
        self.session = session
        self.request()  # the client's on_session

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
                    self.lane = self.open_for
                    if self.opening.opened():
                        self.request()
                else:  # no session, or the one it was made for is gone
                    self.do(self.opening.failed(self.now))
            else:
                self.timer_at = None
                self.opening.timer_fired()
                self.request()
        self.now = to


def test_a_session_back_inside_the_back_off_gets_its_lane_at_its_end() -> None:
    """The lost reopen: the open fails while the daemon is away (a 5 s back-off);
    the session comes back 4.6 s later, inside it: the lane opens at its end."""
    a = Adapter()
    a.session_back(1)
    a.advance(1.0)
    assert a.lane == 1
    a.session_lost()
    a.request()  # a call found no lane: the open fails, no session
    a.advance(1.1)
    assert a.lane == 0 and a.opens == 2
    a.advance(1.1 + 4.6)
    a.session_back(2)
    assert a.timer_at is not None and a.timer_at <= 1.01 + RETRY_S
    a.request()  # more calls inside the back-off: still one timer
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


def test_an_open_for_an_older_session_asks_again() -> None:
    """The open succeeded, but a newer session asked meanwhile (modelled: the lane
    belongs to the session it was made for): the adapter asks again."""
    o = LaneOpening(RETRY_S)
    assert o.request(0.0) == 0.0
    assert o.request(0.001) is None  # the new session's request, while opening
    assert o.opened() is True
    assert o.request(0.002) == 0.0  # at once: the open succeeded, no back-off
    assert o.opened() is False


def test_one_open_at_a_time_and_one_timer_per_back_off() -> None:
    o = LaneOpening(RETRY_S)
    assert o.request(0.0) == 0.0
    assert o.request(0.1) is None  # one open at a time
    assert o.failed(0.2) == 5.0  # asked meanwhile: a timer for the back-off's end
    assert o.request(1.2) is None  # the timer covers it
    o.timer_fired()
    assert o.request(5.2) == 0.0
    assert o.failed(5.25) is None  # nobody asked meanwhile: no timer
    assert o.request(6.5) == 3.75  # inside the back-off: a timer for its end
    o.timer_fired()
    assert o.request(10.25) == 0.0
    assert o.failed(10.5) is None
    assert o.request(15.5) == 0.0  # the back-off is fixed: 5 s again, no more


def test_lanes_off_and_stopped_never_open() -> None:
    off = LaneOpening(RETRY_S, wanted=False)
    assert off.request(0.0) is None
    refused = LaneOpening(RETRY_S)
    assert refused.request(0.0) == 0.0
    refused.request(0.1)  # asked meanwhile
    assert refused.failed(0.2, permanent=True) is None  # the daemon has no lanes
    assert refused.request(100.0) is None and not refused.wanted
    stopped = LaneOpening(RETRY_S)
    assert stopped.request(0.0) == 0.0
    stopped.stop()  # the stream closed while its lane opened
    stopped.opened()
    assert stopped.request(100.0) is None


# The daemon away and back, calls that find no lane, at any times.
steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=7.0), st.sampled_from(["lost", "back", "request"])
    ),
    max_size=30,
)


@settings(max_examples=400, deadline=None)
@given(steps)
def test_a_session_that_comes_back_always_gets_its_lane(script) -> None:
    a = Adapter()
    a.session_back(1)
    sessions = 1
    for dt, what in script:
        a.advance(a.now + dt)
        if what == "lost":
            a.session_lost()
        elif what == "back" and not a.session:
            sessions += 1
            a.session_back(sessions)
        elif what == "request":
            a.request()
    if not a.session:
        sessions += 1
        a.session_back(sessions)
    # Nothing asks any more: within a failing open, a back-off and an open, the lane
    # is there.
    a.advance(a.now + RETRY_S + 3 * OPEN_S)
    assert a.lane == a.session == sessions
    assert a.timer_at is None and a.open_done_at is None
