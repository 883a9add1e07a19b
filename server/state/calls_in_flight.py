"""Depot calls in flight, counted per account and per uid of owned sessions
(kvdepot.server.state.sessions, "Shares per owner"): every Depot call but Session,
from its headers to its end (kvdepot.server.service.call_caps). On the event loop,
owned by `Sessions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING

from kvdepot.server import errors

if TYPE_CHECKING:
    from kvdepot.server.state.sessions import Session

# Depot calls one account may have in flight at once (streams, and unary calls from
# their headers on), by default (--max-calls-per-pid): a worker needs a few; the
# server's concurrent-call limit (bounds.RPCS_PER_SESSION x --max-sessions, 4,096) is
# everyone's, so no account may come near it.
MAX_CALLS_PER_ACCOUNT = 256


class CallsInFlight:
    def __init__(self, max_per_account: int, max_per_uid: int) -> None:
        self.max_per_account = max_per_account
        self.max_per_uid = max_per_uid
        self._calls: Counter[Hashable] = Counter()
        self._uid_calls: Counter[int] = Counter()

    def open(self, session: Session) -> tuple[Hashable, int | None]:
        """Counts one more call of `session` against its account (`max_per_account`)
        and its owner's uid (`max_per_uid`); RESOURCE_EXHAUSTED beyond, nothing
        counted. Give the result to `close`."""
        account = session.account
        uid = session.owner.uid if session.owner is not None else None
        if self._calls[account] >= self.max_per_account:
            raise errors.exhausted(
                f"{session.owner or 'this client'} has {self._calls[account]} calls in "
                f"flight, the most one process may (--max-calls-per-pid, "
                f"KVDEPOT_MAX_CALLS_PER_PID): end idle streams, or wait for answers"
            )
        if uid is not None and self._uid_calls[uid] >= self.max_per_uid:
            raise errors.exhausted(
                f"uid {uid} has {self._uid_calls[uid]} calls in flight, the most one user "
                f"may (--max-calls-per-uid, KVDEPOT_MAX_CALLS_PER_UID)"
            )
        self._calls[account] += 1
        if uid is not None:
            self._uid_calls[uid] += 1
        return account, uid

    def close(self, held: tuple[Hashable, int | None]) -> None:
        account, uid = held
        self._calls[account] -= 1
        if self._calls[account] <= 0:
            del self._calls[account]
        if uid is not None:
            self._uid_calls[uid] -= 1
            if self._uid_calls[uid] <= 0:
                del self._uid_calls[uid]
