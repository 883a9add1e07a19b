"""Session ids by account: whom each open session's shares are charged to.

The quotas read an account's sessions on every store call (`Sessions.account_sessions`,
for --max-writing-per-session) and every Pin; a scan of every open session there cost
the job path a time proportional to the sessions open. `Accounts` keeps them grouped
instead, updated as sessions open, attest (their account changes from the opener's, or
the unattested one, to the owner's) and close. Plain object, on the event loop; owned by
`Sessions` (kvdepot.server.state.sessions).
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Accounts"]


class Accounts:
    def __init__(self) -> None:
        # In the order they joined (a dict as an ordered set).
        self._ids: dict[Hashable, dict[str, None]] = {}

    def join(self, account: Hashable, session_id: str) -> None:
        self._ids.setdefault(account, {})[session_id] = None

    def leave(self, account: Hashable, session_id: str) -> None:
        mates = self._ids[account]
        del mates[session_id]
        if not mates:
            del self._ids[account]

    def members(self, account: Hashable) -> list[str]:
        """The ids of the sessions charged to `account`, oldest first."""
        return list(self._ids.get(account, ()))

    def __len__(self) -> int:
        """Accounts with a session open."""
        return len(self._ids)
