"""Which lane a client keeps, and when it opens the next: the lane keeper's rules, without I/O.

A client keeps at most one lane of a kind for its current session: a
`TransferStream`'s job lane, a `DepotClient`'s pin lane, its unpin lane
(docs/architecture.md §3, "Lanes come back"). `LaneKeeping` holds that lane (an
opaque handle: the adapter's socket object), the session it was opened for, and
when the next open may start. Its one adapter, kvdepot.client.lane_keeper's
`LaneKeeper`, reports what happened, with the time on its monotonic clock in
seconds, and does what the answer says. An answer of type `Action`:

- `OPEN` (0.0): open a lane now, for the client's session then, and report how
  that ended (`opened` or `failed`);
- a delay > 0: arm one timer, and report `timer_fired` when it does;
- None: nothing (lanes are off, or an open or a timer is under way, and each
  reports its end itself).

The rules (each was once a bug, see `git log` of the lanes):

- One open at a time; after a failed one, none for `retry_s` (a fixed back-off).
- No request is lost: one inside the back-off is deferred to its end (one timer
  covers every request in it), one made while an open is under way is asked again
  when that open ends. A session that comes back always gets its lane back (a
  lane's open failed while the daemon was down, and the session that came back
  within the back-off once lost its unpin lane until the next unpin).
- A lane serves only the session it was opened for: a call of a newer session
  finds none and asks for its own; the older lane is closed when that one opens.
- A lane that breaks (a socket error, the daemon's end, an answer that does not
  fit, a timeout) is forgotten. With `reopen_on_break`, the lane asked for only
  when a session starts and by the calls that find none (pins, unpins), it is
  asked for again at once; without (the job lane, which every job asks for), the
  next call asks. The break of a lane no longer kept (an older session's, one
  dropped) changes nothing.
- A session that ended (`drop`) loses its lane; the next session asks.
- After `stop`, nothing opens, and a lane whose open was under way is closed.

Not thread-safe: the adapter calls it under its lock. Standard library only.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

from kvdepot.common.backoff import Backoff

L = TypeVar("L")

# What the adapter does next: OPEN, a delay before `timer_fired`, or None.
Action = float | None
OPEN = 0.0


class Opened(NamedTuple, Generic[L]):
    """What `opened` answers: a lane to close (the one replaced, or the new one when
    lanes stopped meanwhile), and what to do next (an Action)."""

    close: L | None
    then: Action


class LaneKeeping(Generic[L]):
    """One kind of lane of a client: the one it keeps, and when the next opens."""

    __slots__ = (
        "_asked_for",
        "_deferred",
        "_retry",
        "_retry_at",
        "lane",
        "opening",
        "reopen_on_break",
        "session",
        "wanted",
    )

    def __init__(self, retry_s: float, wanted: bool = True, reopen_on_break: bool = True) -> None:
        self.wanted = wanted  # False: lanes are off (by the user, or the daemon has none)
        self.reopen_on_break = reopen_on_break
        self.lane: L | None = None
        self.session = ""  # the session `lane` was opened for ("" with no lane)
        self.opening = False
        self._retry = Backoff(retry_s, retry_s)  # a fixed wait between tries
        self._retry_at = 0.0
        self._deferred = False  # a timer is armed for the back-off's end
        self._asked_for: str | None = None  # the session that asked while opening

    def lane_for(self, session: str) -> L | None:
        """The lane kept, if it serves `session` (every call asks: a plain read)."""
        return self.lane if self.session == session else None

    def want(self, session: str, now: float) -> Action:
        """`session` wants a lane: it started, or a call of it found none."""
        if not self.wanted or (self.lane is not None and self.session == session):
            return None
        if self.opening:
            self._asked_for = session
            return None
        if now < self._retry_at:
            if self._deferred:
                return None  # the timer armed covers this request too
            self._deferred = True
            return self._retry_at - now
        self.opening = True
        self._asked_for = None
        return OPEN

    def timer_fired(self, session: str | None, now: float) -> Action:
        """The back-off's timer fired; `session`: the client's session now (None: it
        has none, and the session that comes back asks for itself)."""
        self._deferred = False
        return None if session is None else self.want(session, now)

    def opened(self, lane: L, session: str, now: float) -> Opened[L]:
        """The open ended with `lane`, attached to `session`: it is the lane kept now."""
        self.opening = False
        self._retry.reset()
        self._retry_at = 0.0
        asked, self._asked_for = self._asked_for, None
        if not self.wanted:  # stopped meanwhile: nobody will use it
            return Opened(lane, None)
        old = self.lane
        self.lane, self.session = lane, session
        # A session other than this lane's asked meanwhile (a newer one): its own opens.
        then = self.want(asked, now) if asked is not None and asked != session else None
        return Opened(old, then)

    def failed(self, now: float, permanent: bool = False) -> Action:
        """The open failed (`permanent`: the daemon has no lanes, so no more tries).
        A request that came meanwhile is deferred to the back-off's end."""
        self.opening = False
        asked, self._asked_for = self._asked_for, None
        if permanent:
            self.wanted = False
            return None
        self._retry_at = now + self._retry.next_delay()
        return None if asked is None else self.want(asked, now)

    def broke(self, lane: L, now: float) -> Action:
        """`lane` broke (its reader or a caller saw it). The lane kept is forgotten
        and, with `reopen_on_break`, asked for again for its session."""
        if lane is not self.lane:
            return None  # an older lane, already replaced or dropped
        session = self.session
        self.lane, self.session = None, ""
        return self.want(session, now) if self.reopen_on_break else None

    def drop(self) -> L | None:
        """The session ended (or the owner cancelled the lane): the lane kept, to
        close, is forgotten. The next session's calls ask for their own."""
        lane, self.lane, self.session = self.lane, None, ""
        return lane

    def stop(self) -> L | None:
        """No more lanes (the owner closed): the lane kept, to close; requests,
        timers and opens that end later are ignored."""
        self.wanted = False
        self._asked_for = None
        return self.drop()
