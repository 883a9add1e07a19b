"""Sessions and registrations as the services see them: a facet of `DepotState`.

`SessionRegistry` opens and ends sessions (making room by ending the opener's own
oldest unattested one, or a uid's largest holder's), binds them to processes (the
fd socket's ticket and attest), records registrations and observer joins into
namespaces, and forgets the namespaces no registration and no block uses any more,
in the index and in the crash journal.
The bookkeeping itself is `Sessions` (kvdepot.server.state.sessions) and the
namespace rules `NamespaceAccess` (kvdepot.server.state.namespaces); this facet
keeps them, the index and the event bus consistent.

Owned by `DepotState`, which offers these calls as its own (a method per call);
everything runs on the event loop. Errors are DepotError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.layout import LayoutError, NamespaceLayout, check_namespace_id
from kvdepot.server.core.log_limit import held_note
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.memory import journal_file
from kvdepot.server.peer import Peer, peer_key
from kvdepot.server.state.events import EventBus
from kvdepot.server.state.invariants import mutation
from kvdepot.server.state.namespaces import NamespaceAccess
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.sessions import Session, Sessions

log = logging.getLogger("kvdepot.state")


class SessionRegistry:
    """Open, attest and close sessions; register, observe and unregister.

    `shutting_down()` says whether the daemon refuses new sessions; `journal()` is the
    crash journal (None without --pool-file), whose namespaces follow the index's;
    `verify_invariants` runs after every mutation (`@mutation`).
    """

    def __init__(
        self,
        sessions: Sessions,
        index: BlockIndex,
        bus: EventBus,
        access: NamespaceAccess,
        *,
        shutting_down: Callable[[], bool],
        journal: Callable[[], journal_file.Journal | None],
        verify_invariants: Callable[[], object],
    ) -> None:
        self._sessions = sessions
        self.index = index
        self.bus = bus
        self.access = access
        self._shutting_down = shutting_down
        self._journal = journal
        self.verify_invariants = verify_invariants

    def open_session(
        self,
        client_name: str,
        pid: int,
        engine_id: str,
        *,
        ticket: str = "",
        opener: Hashable | None = None,
    ) -> Session:
        """A new session: owned from the start by the process a live `ticket` names
        (Sessions.issue_ticket), else not owned yet, opened by `opener` (a TCP peer;
        None on the Unix socket). Room is made by ending the opener's own oldest
        session not owned yet, or one over its fair share of a uid (Sessions.make_room)."""
        if self._shutting_down():
            raise errors.unavailable("the daemon is shutting down: reconnect in a moment")
        owner = self._sessions.take_ticket(ticket)
        self._end(self._sessions.make_room(owner, opener))
        return self._sessions.open(client_name, pid, engine_id, owner=owner, opener=opener)

    def _end(self, sessions: Iterable[Session]) -> None:
        """Ends sessions the quotas took back (make_room, owner_room), saying why."""
        for old in sessions:
            self.close_session(old.id)
            if old.owner is None:
                reason = (
                    "this session was ended to make room for another of the same client: it "
                    "never attested on the fd socket (kvdepot's client does; see "
                    "kvdepot.client.fdpass.attest)"
                )
            else:
                reason = (
                    f"this session was ended to make room for another process of uid "
                    f"{old.owner.uid}: {old.owner} held more than its fair share of the "
                    f"uid's sessions (--max-sessions-per-uid)"
                )
            old.revoke(errors.exhausted(reason))

    def attest(self, session_id: str, peer: Peer) -> None:
        """The fd socket's identity check (kvdepot.server.fd_receiver; on the loop):
        binds the session to `peer` or checks it is the owner. A session over its
        owner's quota is ended (the error says which limit)."""
        try:
            self._end(self._sessions.attest(session_id, peer))
        except errors.DepotError as exc:
            if exc.code is errors.Code.RESOURCE_EXHAUSTED:
                s = self._sessions.sessions.get(session_id)
                self.close_session(session_id)
                if s is not None:
                    s.revoke(exc)
            raise

    def issue_ticket(self, peer: Peer) -> str:
        """The fd socket's "ticket" message (on the loop): see Sessions.issue_ticket."""
        return self._sessions.issue_ticket(peer)

    @mutation
    def close_session(self, session_id: str) -> None:
        """Releases everything the session held: registrations, pins, rows, fds."""
        closed = self._sessions.close(session_id)
        if closed is None:
            return
        s, registrations, fds = closed
        pins, rows = self.index.release_owner(session_id)
        self.bus.end_session(session_id)  # its Watch streams end with it
        self.forget_unused(s.namespaces)
        held = self._sessions.log_limit.admit(peer_key(s.owner), time.monotonic())
        if held is None:  # rate-limited per peer (kvdepot.server.core.log_limit)
            return
        log.info(
            "session %s (%r, pid %d) closed: released %d registration(s), %d pin(s), "
            "%d unfinished block row(s), %d pending fd(s)%s",
            s.tag,
            s.client_name,
            s.pid,
            registrations,
            pins,
            rows,
            fds,
            held_note(held),
        )

    def session(self, session_id: str) -> Session:
        return self._sessions.get(session_id)

    def declare(self, layout: NamespaceLayout) -> None:
        self.index.declare_namespace(layout)

    @mutation
    def register(
        self,
        session_id: str,
        layout: NamespaceLayout,
        rank: int,
        regions: Sequence[tuple[MemoryPath | str, object]],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
        units: int = 1,
    ) -> Registration:
        """Declares the namespace, maps the memory and records the registration
        (regions: (memory path, handle)); `units`: the ranks [rank, rank + units) it
        stands for (a canonical namespace's units, RegisterKVRequest.unit_count)."""
        session = self.session(session_id)
        if not 0 <= rank < layout.world_size:
            raise errors.invalid(f"rank {rank} out of range [0, {layout.world_size})")
        if not 1 <= units <= layout.world_size - rank:
            raise errors.invalid(
                f"unit_count {units} from rank {rank} reaches past the namespace's "
                f"{layout.world_size} ranks"
            )
        if units > 1 and not regions:
            raise errors.invalid(
                "unit_count > 1 needs memory regions: an inline registration (Put/Get) "
                "stands for one rank"
            )
        self.access.check_room(session, layout.id)
        self.declare(layout)
        try:
            reg = self._sessions.register(
                session_id,
                layout,
                rank,
                [(MemoryPath(k), h) for k, h in regions],
                tensors,
                groups,
                units,
            )
        except BaseException:
            self.forget_unused([layout.id])  # declared for nothing
            raise
        self.access.join(session, layout.id)  # a registration is the join
        return reg

    def observe(self, session_id: str, namespace_id: str) -> None:
        """An observer join (RegisterKV naming the namespace id alone): the session
        may Watch, Lookup, Pin, Unpin and Prefetch it; nothing is mapped or declared."""
        try:
            check_namespace_id(namespace_id)
        except LayoutError as exc:
            raise errors.invalid(f"namespace layout: {exc}") from None
        self.access.join(self.session(session_id), namespace_id)

    @mutation
    def unregister(self, session_id: str, registration_id: int) -> None:
        reg = self._sessions.registrations.get(registration_id)
        self._sessions.unregister(session_id, registration_id)
        if reg is not None:
            self.forget_unused([reg.layout.id])

    def forget_unused(self, candidates: Iterable[str] | None = None) -> None:
        """Forgets the namespaces (of `candidates`, or all) that no registration and
        no block uses (state.namespaces), in the index and the journal."""
        journal = self._journal()
        for namespace_id in self.access.forget_unused(candidates):
            if journal is not None:
                journal.drop_namespace(namespace_id)
