"""Namespace membership and the per-session quotas: who may name which namespace.

A namespace id is the only thing that ties a call to a tenant's blocks, so a
call may name only a namespace its session joined (docs/security.md):

- RegisterKV is the join. A worker's registration joins the namespace of its
  layout; a RegisterKV whose layout carries the id alone (no groups) and no
  memory is an observer join (a scheduler: Watch, Lookup, Pin, Unpin, Prefetch;
  nothing mapped, no Put/Get).
- Lookup, Watch, Pin, Unpin, Prefetch and the lanes' datagrams need the join;
  Put and Get need a registration of the namespace (an observer has no rank).
  Anything else is PERMISSION_DENIED, the same answer whether the namespace
  exists or not, so a refusal never tells whether another tenant's id is live.
- Membership lives on the Session and ends with it.

Quotas, beyond which calls get RESOURCE_EXHAUSTED naming the setting: bytes
pinned (--max-pinned-per-session) and bytes of rows reserved for writing
(--max-writing-per-session), each counted over a session and every other session
of its account (its owner process: Session.account) together, and over the whole
pool (--max-pool-held, 75%, or the per-session setting if larger); per session, Watch streams
(--max-watches-per-session) and namespaces joined (MAX_JOINED_NAMESPACES, a
memory bound). Two sessions of one process used to take half the pool each.

A namespace's layout stays in the index while a registration or a block (any
state, including a doomed one whose copy has not ended) uses it; then it is
forgotten, whoever is still a member (a member keeps just the id, and a later
registration declares it again). A namespace of 64 groups x 4,096 layers is
about 10 MB of layout: dropping one must give that back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvdepot.server import errors
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.sizes import pool_share_bytes
from kvdepot.server.state.sessions import Session, Sessions
from kvdepot.server.state.settings import StateConfig

log = logging.getLogger("kvdepot.state")

# Namespaces one session may have joined: memberships are never left (a scheduler
# moves to a fresh namespace at each cache reset), so this bounds their memory.
MAX_JOINED_NAMESPACES = 1024

JOIN_FIRST = "RegisterKV into the namespace first"


def _shown(namespace_id: str) -> str:
    """The caller's own namespace id, for its error messages (bounded in length)."""
    return repr(namespace_id[:80] + ("…" if len(namespace_id) > 80 else ""))


class NamespaceAccess:
    """Membership checks and quotas over the sessions and the index (on the loop)."""

    def __init__(self, config: StateConfig, index: BlockIndex, sessions: Sessions) -> None:
        self._index = index
        self._sessions = sessions
        pool = config.pool_size
        self.max_pinned = pool_share_bytes(config.max_pinned_per_session, pool)
        self.max_writing = pool_share_bytes(config.max_writing_per_session, pool)
        # What every session together may hold pinned, and (apart) in rows being
        # written, unless a per-owner setting allows more: what is left stays for the
        # rows that others store and load, whoever holds the rest.
        self.pool_held = pool_share_bytes(config.max_pool_held, pool)
        self.pool_pinned = max(self.max_pinned, self.pool_held)
        self.pool_writing = max(self.max_writing, self.pool_held)
        self.max_watches = config.max_watches_per_session

    # -- membership ------------------------------------------------------------------

    @staticmethod
    def check_room(session: Session, namespace_id: str) -> None:
        """RESOURCE_EXHAUSTED when joining `namespace_id` would pass the session's cap."""
        if namespace_id not in session.namespaces and (
            len(session.namespaces) >= MAX_JOINED_NAMESPACES
        ):
            raise errors.exhausted(
                f"this session joined {len(session.namespaces)} namespaces, the most one "
                f"session may (MAX_JOINED_NAMESPACES): open a new session"
            )

    def join(self, session: Session, namespace_id: str) -> None:
        self.check_room(session, namespace_id)
        session.namespaces.add(namespace_id)

    def member(self, session_id: str, namespace_id: str) -> Session:
        """The session, if it joined `namespace_id`; else PERMISSION_DENIED."""
        s = self._sessions.get(session_id)
        if namespace_id not in s.namespaces:
            raise errors.denied(
                f"this session has not joined namespace {_shown(namespace_id)}: "
                f"{JOIN_FIRST} (a scheduler joins as an observer: a layout of the id alone, "
                f"no groups, no memory)"
            )
        return s

    def registered(self, session_id: str, namespace_id: str) -> Session:
        """The session, if it holds a registration of `namespace_id` (Put, Get)."""
        s = self.member(session_id, namespace_id)
        regs = self._sessions.registrations
        if not any(regs[r].layout.id == namespace_id for r in s.registrations if r in regs):
            raise errors.denied(
                f"this session joined namespace {_shown(namespace_id)} as an observer, which "
                f"maps no memory: Put and Get need a RegisterKV with the namespace's layout"
            )
        return s

    # -- quotas ----------------------------------------------------------------------

    def open_watch(self, session: Session) -> None:
        if session.watches >= self.max_watches:
            raise errors.exhausted(
                f"this session has {session.watches} Watch streams open, the most one session "
                f"may (--max-watches-per-session, KVDEPOT_MAX_WATCHES_PER_SESSION): end one"
            )
        session.watches += 1

    @staticmethod
    def close_watch(session: Session) -> None:
        session.watches -= 1

    def check_pinned(self, session_id: str) -> None:
        """RESOURCE_EXHAUSTED when the session's account (its process's sessions
        together) holds more pinned than --max-pinned-per-session, or the pool more
        than `pool_pinned`."""
        index = self._index
        held = sum(map(index.owner_pinned_bytes, self._sessions.account_sessions(session_id)))
        if held > self.max_pinned:
            raise errors.exhausted(
                f"this Pin would hold {held} bytes pinned by this process's sessions, more "
                f"than one process may ({self.max_pinned}; --max-pinned-per-session, "
                f"KVDEPOT_MAX_PINNED_PER_SESSION, counts a process's sessions together): "
                f"unpin loaded blocks first"
            )
        if index.pinned_bytes > self.pool_pinned:
            raise errors.exhausted(
                f"this Pin would hold {index.pinned_bytes} bytes of the pool pinned, more than "
                f"every client together may ({self.pool_pinned}: --max-pool-held, "
                f"KVDEPOT_MAX_POOL_HELD, or --max-pinned-per-session if larger): retry when "
                f"others unpin"
            )

    def writing_room(self, session_id: str) -> int:
        """Bytes of rows the session may still reserve for writing: what its account
        has left of --max-writing-per-session, and the pool of `pool_writing`; 0 or
        less: its stores are dropped. The index asks it only when a store's rows would
        not fit under `writing_floor`."""
        index = self._index
        mine = sum(map(index.owner_writing_bytes, self._sessions.account_sessions(session_id)))
        return min(self.max_writing - mine, self.pool_writing - index.writing_bytes())

    @property
    def writing_floor(self) -> int:
        """The index's floor under `writing_room` (BlockIndex.writing_floor): an
        account's rows and the sessions' rows being written are each at most every
        WRITING row, so writing_room is never below this less their bytes."""
        return min(self.max_writing, self.pool_writing)

    # -- forgetting ------------------------------------------------------------------

    def forget_unused(self, candidates: Iterable[str] | None = None) -> list[str]:
        """Forgets the namespaces (of `candidates`, or all) that no registration and
        no block uses; returns their ids."""
        index = self._index
        ids = list(index.namespaces) if candidates is None else list(candidates)
        if not ids:
            return []
        in_use = {reg.layout.id for reg in self._sessions.registrations.values()}
        gone = [ns_id for ns_id in ids if ns_id not in in_use and index.forget_namespace(ns_id)]
        if gone:
            log.info("forgot %d namespace(s) that no registration or block uses", len(gone))
        return gone
