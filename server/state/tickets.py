"""Session tickets: a process attests on the fd socket before it opens a session, and
the ticket it gets opens one it owns from the start (kvdepot.server.state.sessions,
"Shares per owner").

A ticket is one use and lives TICKET_SECONDS; a process may hold as many unused ones
as it may hold sessions; past MAX_TICKETS in all (a memory bound), the largest
holder's oldest is forgotten. On the event loop, owned by `Sessions`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Hashable

from kvdepot.server import errors
from kvdepot.server.peer import Peer, peer_key

TICKET_SECONDS = 10.0  # a ticket not used by then is forgotten
MAX_TICKETS = 1024  # unused tickets of every process together (a memory bound)


class SessionTickets:
    def __init__(self, max_per_process: int) -> None:
        self.max_per_process = max_per_process  # --max-sessions-per-pid
        # token -> (process, expiry)
        self._tickets: dict[str, tuple[Peer, float]] = {}

    def issue(self, peer: Peer) -> str:
        """A one-use ticket that opens a session `peer` owns; RESOURCE_EXHAUSTED when
        `peer` holds its share of unused ones already."""
        now = time.monotonic()
        self._tickets = {t: v for t, v in self._tickets.items() if v[1] > now}
        me = peer_key(peer)
        held: dict[Hashable, list[str]] = {}
        for t, (p, _) in self._tickets.items():  # oldest first
            held.setdefault(peer_key(p), []).append(t)
        if len(held.get(me, ())) >= self.max_per_process:
            raise errors.exhausted(
                f"{peer} holds {self.max_per_process} unused session tickets: open sessions "
                f"with them first"
            )
        if len(self._tickets) >= MAX_TICKETS:  # many processes: the largest holder's go
            del self._tickets[max(held.values(), key=len)[0]]
        token = secrets.token_hex(16)
        self._tickets[token] = (peer, now + TICKET_SECONDS)
        return token

    def take(self, token: str) -> Peer | None:
        """The process a live ticket names (the ticket is used up); None if none."""
        entry = self._tickets.pop(token, None) if token else None
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]
