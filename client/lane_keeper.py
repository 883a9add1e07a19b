"""The client's one lane keeper: a lane of one kind kept open for the current session.

Every client lane is kept by a `LaneKeeper`: a `TransferStream`'s job lane, a
`DepotClient`'s pin lane and unpin lane (kvdepot.client.pin_lane). Which lane is
kept and when one opens (one open at a time, a fixed back-off after a failed one,
no request lost, a lane only for the session it was opened for, reopened after a
break) is the sans-I/O `LaneKeeping` of kvdepot.common.lane_keeping; the keeper
does what it answers: opens a lane (kvdepot.client.job_lane's `ClientLane.open`) on
a thread of its own, arms one timer, closes the lanes it no longer keeps, and runs
a kind's reader (the job lane's results) on a thread per lane.

The per-kind differences are parameters: the lane's `kind` and `noun`, the `lock`
(the job lane shares its stream's), a `reader` with its `lost` callback, and
`reopen_on_break`.

Threads: any. Every method takes the keeper's lock, a re-entrant one (a
`threading.RLock`, or the `threading.Condition` the owner passes, whose lock is
one), so an owner may call it with that lock held; opens and the reader run on
threads of their own, never under it. `lane_for` is the calls' path: a plain
read, and a request only when no lane serves the session.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from kvdepot.client.job_lane import OPEN_TIMEOUT, ClientLane, LaneOwner, LaneUnavailable
from kvdepot.common.lane_keeping import OPEN, Action, LaneKeeping
from kvdepot.v1 import depot_pb2

log = logging.getLogger("kvdepot.client")

# Reads a lane until it ends (on the lane's own thread; `generation` numbers the
# lane: -1, -2, ... in the order they open) and returns why it ended.
Reader = Callable[[ClientLane, int], str]


class LaneKeeper:
    """One lane of one `kind`, kept open for the client's current session."""

    def __init__(
        self,
        client: LaneOwner,
        kind: depot_pb2.LaneKind,
        noun: str,
        *,
        wanted: bool,
        retry_s: float = 5.0,
        lock: AbstractContextManager[Any] | None = None,
        reader: Reader | None = None,
        lost: Callable[[int, str], None] | None = None,
        reopen_on_break: bool = True,
    ) -> None:
        self.client = client
        self.kind = kind
        self.noun = noun  # in log lines and thread names
        self.keeping: LaneKeeping[ClientLane] = LaneKeeping(retry_s, wanted, reopen_on_break)
        self.lock: AbstractContextManager[Any] = lock if lock is not None else threading.RLock()
        self._reader = reader
        # (generation, why): the lane of that generation ended (under the lock).
        self._lost = lost
        self.generation = 0  # the last lane's
        self._fallback_logged = False

    @property
    def lane(self) -> ClientLane | None:
        """The lane kept (of the session it was opened for), if any."""
        return self.keeping.lane

    @property
    def open(self) -> bool:
        return self.keeping.lane is not None

    def lane_for(self, session_id: str) -> ClientLane | None:
        """The lane, if it serves `session_id` (a call's); else None, and one is asked
        for the client's session now (a call of an older session never replaces it)."""
        lane = self.keeping.lane_for(session_id)
        if lane is None:
            self.want()
        return lane

    def want(self, wait_s: float | None = None) -> None:
        """A lane for the client's session now, if it has one (its session started, or
        a call found none). `wait_s`: an open it answers runs now, on this thread,
        within that time (called WITHOUT the lock held: a new stream's first jobs then
        take the lane)."""
        with self.lock:
            session = self._session_now()
            if session is None:
                return  # no session: the next one asks
            action = self.keeping.want(session, time.monotonic())
        if action == OPEN and wait_s is not None:
            self._open(wait_s)
        else:
            self._follow(action)

    def send(self, lane: ClientLane, data: bytes) -> bool:
        """Sends one datagram on `lane` (from `lane_for`) without blocking. False: it
        did not go (full, too large, or the lane broke: then it is dropped, `broke`):
        send it elsewhere."""
        try:
            return lane.send(data)
        except OSError:
            lane.protocol.broke()
            self.broke(lane)
            return False

    def broke(self, lane: ClientLane) -> None:
        """A caller found `lane` broken (a send error, a timeout, an answer that does
        not fit): it is closed, and asked for again as the keeping says."""
        with self.lock:
            action = self.keeping.broke(lane, time.monotonic())
        self._discard(lane)
        self._follow(action)

    def drop(self) -> None:
        """Forgets the lane: its session ended, or its owner aborted (closed both
        ways: the daemon skips the jobs it has not started). The next call asks."""
        with self.lock:
            lane = self.keeping.drop()
        if lane is not None:
            self._discard(lane)

    def finish(self) -> None:
        """The owner closed: no lane opens any more; the one kept is half-closed (the
        daemon answers what it has, then closes it)."""
        with self.lock:
            lane = self.keeping.stop()
        if lane is not None:
            lane.finish()

    # -- opening -----------------------------------------------------------------------

    def _session_now(self) -> str | None:
        hello = self.client.hello
        return hello.session_id if hello is not None and self.client.connected else None

    def _follow(self, action: Action) -> None:
        """Does what the keeping answered: OPEN, on a thread; a delay, one timer."""
        if action is None:
            return
        if action == OPEN:
            threading.Thread(
                target=self._open, name=f"kvdepot-{self.noun}-lane-open", daemon=True
            ).start()
            return
        timer = threading.Timer(action, self._timer_fired)
        timer.daemon = True
        timer.start()

    def _timer_fired(self) -> None:
        with self.lock:
            action = self.keeping.timer_fired(self._session_now(), time.monotonic())
        self._follow(action)

    def _open(self, timeout: float = OPEN_TIMEOUT) -> None:
        try:
            session_id = self.client.session_id
            lane = ClientLane.open(self.client, session_id, timeout, self.kind)
        except (LaneUnavailable, OSError, RuntimeError) as exc:  # RuntimeError: no session
            permanent = isinstance(exc, LaneUnavailable) and exc.permanent
            with self.lock:
                action = self.keeping.failed(time.monotonic(), permanent)
                logged, self._fallback_logged = self._fallback_logged, True
            if not logged:
                log.info("kvdepot: no %s lane (%s); %ss use gRPC", self.noun, exc, self.noun)
            self._follow(action)
            return
        with self.lock:
            close, then = self.keeping.opened(lane, session_id, time.monotonic())
            if close is lane:  # lanes stopped meanwhile: never used
                lane.close()
                return
            self.generation -= 1
            generation = self.generation
        if close is not None:
            self._discard(close)  # an older session's lane
        if self._reader is not None:
            threading.Thread(
                target=self._read,
                args=(lane, generation),
                name=f"kvdepot-{self.noun}-lane",
                daemon=True,
            ).start()
        self._follow(then)

    # -- a kept lane's end ---------------------------------------------------------------

    def _discard(self, lane: ClientLane) -> None:
        """A lane no longer kept, or broken. With a reader, closed both ways: its reader
        wakes with the end and closes the socket; else closed here."""
        if self._reader is not None:
            lane.cancel()
        else:
            lane.close()

    def _read(self, lane: ClientLane, generation: int) -> None:
        assert self._reader is not None
        why = self._reader(lane, generation)
        with self.lock:
            action = self.keeping.broke(lane, time.monotonic())
            if self._lost is not None:
                self._lost(generation, why)
        lane.close()
        self._follow(action)
