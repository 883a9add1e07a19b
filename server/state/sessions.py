"""Sessions and registrations: who is connected, and which memory they registered.

A session is one engine process's connection (Depot/Session stream); what it
holds (registrations, pins, unfinished block rows, fds sent but not yet
claimed) is released when it ends. A registration maps one rank's KV memory
through one memory path (kvdepot.server.memory.paths.MemoryPathPlugin): shared
memory (an fd claimed from the fd socket and sealed against shrinking) is there
from the start; the others (CUDA IPC, process memory) plug in the same way, with
`add_memory_path`.

A session id is a bearer secret (128 random bits) of the process that opened it;
logs and listings show its first 8 hex digits only (`session_tag`). The first
process that speaks for it on the fd socket (kvdepot.server.fd_receiver: an
attest, or its first fd) becomes its `owner`, a kernel identity; fds, lanes and
pvm registrations from any other process are refused with PERMISSION_DENIED and
counted (`permission_denied`). A process may also attest before it opens: it asks
the fd socket for a ticket (one use, seconds long), and a Session call naming the
ticket opens a session the ticket's process owns from the start.

Shares per owner. A session's `account` is whom its quotas charge: its owner
process (its uid and gid where the daemon cannot see processes apart); before an
owner, the transport's word where it has one (a TCP peer's host and certificate:
`opener`); else the one account of everyone not identified yet. Quotas: owned
sessions per process and per uid, the uid's shared fairly (a process below its fair
share of the uid's quota takes the place of the oldest session of the uid's largest
holder); sessions not owned yet, per opener (`max_unattested` each), whose oldest is
ended to make room for a new one of the *same* opener, never another's; calls in
flight per account and per uid (`open_call`: --max-calls-per-pid, -per-uid).
Refusals are logged in words, rate-limited per peer. Pins and rows being written are
counted per account (kvdepot.server.state.namespaces; sessions by account: accounts.py).

A registration ends (UnregisterKV, or its session ends) at once for clients,
but its regions stay mapped while copies still use them (`in_use`), so a late
copy never touches unmapped memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.layout import NamespaceLayout
from kvdepot.server.core.log_limit import LogLimiter, held_note
from kvdepot.server.core.memory_map import LayerRef, MemoryMap, TensorView
from kvdepot.server.memory.copy_engine import CopyEngine, CpuCopyEngine
from kvdepot.server.memory.paths import MemoryPathPlugin, PassedFd, SharedMemoryPath
from kvdepot.server.memory.regions import MappedRegion
from kvdepot.server.peer import UNATTESTED, Peer, peer_key, session_tag
from kvdepot.server.resources import Headroom, ResourceLow
from kvdepot.server.sizes import format_size
from kvdepot.server.state.accounts import Accounts
from kvdepot.server.state.calls_in_flight import MAX_CALLS_PER_ACCOUNT, CallsInFlight
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.tickets import SessionTickets

log = logging.getLogger("kvdepot.state")


class ForeignToken(Exception):
    """An fd_token sent for another session than the one that presents it (raised by
    FdSource.claim_pending; the session counts it as a PERMISSION_DENIED)."""


class FdSource(Protocol):
    """The fd socket (kvdepot.server.fd_receiver.FdReceiver), as the state uses it:
    the daemon attaches one (DepotState.attach_fd_receiver); the state never imports it."""

    def claim(self, token: str, session_id: str) -> int: ...
    def claim_pending(self, token: str, session_id: str) -> PassedFd: ...
    def drop_session(self, session_id: str) -> int: ...
    def expire(self) -> int: ...
    def close(self) -> None: ...


@dataclass
class Session:
    id: str
    client_name: str
    pid: int
    engine_id: str
    opened: float
    registrations: set[int] = field(default_factory=set)
    # Namespaces this session joined (RegisterKV; kvdepot.server.state.namespaces):
    # the only ones its calls may name. Forgotten with the session.
    namespaces: set[str] = field(default_factory=set)
    watches: int = 0  # Watch streams open now (--max-watches-per-session)
    # The process the kernel named on the fd socket (None: not attested yet).
    owner: Peer | None = None
    # Who opened it, as the transport says at open (a TCP peer: ("tcp", host, cert));
    # None on the Unix socket, which names nobody (the fd socket does, by attest).
    opener: Hashable | None = None
    # Set when the daemon ends the session itself (evicted, over quota): the
    # Session stream then ends with `end_reason`.
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end_reason: errors.DepotError | None = None

    @property
    def tag(self) -> str:
        return session_tag(self.id)

    @property
    def account(self) -> Hashable:
        """Whom the session's shares are charged to (see the module docstring)."""
        if self.owner is None and self.opener is not None:
            return self.opener
        return peer_key(self.owner)

    def revoke(self, reason: errors.DepotError) -> None:
        self.end_reason = reason
        self.ended.set()


class Sessions:
    """Every session and registration, and the memory paths that map regions."""

    def __init__(
        self,
        max_sessions: int = 256,
        max_registrations: int = 64,
        headroom: Headroom | None = None,
        *,
        max_per_pid: int = 16,
        max_per_uid: int = 128,
        max_unattested: int = 32,
        max_calls_per_account: int = MAX_CALLS_PER_ACCOUNT,
        max_calls_per_uid: int = 1024,
    ) -> None:
        """Limits: open sessions, registrations per session (--max-sessions,
        --max-registrations-per-session), the process's fds and mappings (`headroom`;
        None: unchecked), beyond them RESOURCE_EXHAUSTED; attested sessions per process
        and per uid (--max-sessions-per-pid, -per-uid), unowned ones per opener
        (--max-unattested-sessions), calls in flight per account and per uid
        (--max-calls-per-pid, -per-uid). See the module docstring."""
        self.max_sessions = max_sessions
        self.max_registrations = max_registrations
        self.headroom = headroom
        self.max_per_pid = max_per_pid
        self.max_per_uid = max_per_uid
        self.max_unattested = max_unattested
        self._tickets = SessionTickets(max_per_pid)  # the fd socket's (issue_ticket)
        self._calls = CallsInFlight(max_calls_per_account, max_calls_per_uid)  # open_call
        self.permission_denied = 0  # identity refusals (Admin/GetStats)
        # Lines about what clients do (sessions, refusals), rate-limited per peer.
        self.log_limit = LogLimiter()
        self.sessions: dict[str, Session] = {}
        self._accounts = Accounts()  # their ids by account (account_sessions)
        self.registrations: dict[int, Registration] = {}
        # Registration ids start at a random point per boot: a client still holding an
        # id from before a restart must get FAILED_PRECONDITION, never another
        # registration's memory (wrong KV). Below 2**53 so JSON tools show them exactly.
        self._next_registration = (secrets.randbits(32) << 20) + 1
        self.cpu_engine = CpuCopyEngine()
        self.fd_source: FdSource | None = None
        self._paths: dict[MemoryPath, MemoryPathPlugin[Any]] = {
            MemoryPath.SHM: SharedMemoryPath(self, self.cpu_engine)
        }

    # -- memory paths ----------------------------------------------------------------

    def add_memory_path(self, path: MemoryPathPlugin[Any]) -> None:
        """Serves registrations of `path.kind` with `path` (shm and inline are built in)."""
        kind = MemoryPath(path.kind)
        if kind in (MemoryPath.SHM, MemoryPath.INLINE):
            raise ValueError(f"memory path {kind} is built in")
        self._paths[kind] = path

    def memory_path(self, kind: MemoryPath) -> MemoryPathPlugin[Any] | None:
        """The path serving `kind` (None: this daemon has none)."""
        return self._paths.get(MemoryPath(kind))

    def _open_region(
        self, kind: MemoryPath, handle: object, session: Session
    ) -> tuple[MappedRegion, CopyEngine]:
        path = self._paths.get(kind)
        if path is None:
            raise errors.invalid(
                f"memory path {kind.value!r} is not available in this daemon (no CUDA device, "
                f"or built without it): use shared memory or inline Put/Get"
            )
        return path.open(handle, session.id)

    # -- the fd socket's fds (kvdepot.server.memory.paths.PassedFds) --------------------

    def takes_fds(self) -> bool:
        return self.fd_source is not None

    def claim_passed(self, token: str, session_id: str) -> PassedFd:
        """The fd_receiver's PendingFd behind `token` (fd and sender; the caller
        closes the fd). A token of another session is PERMISSION_DENIED, counted."""
        if self.fd_source is None:
            raise errors.precondition("this daemon takes no fds (no fd socket)")
        try:
            return self.fd_source.claim_pending(token, session_id)
        except ForeignToken as exc:
            raise self.deny(str(exc)) from None
        except KeyError as exc:
            raise errors.invalid(exc.args[0]) from None

    def deny(self, message: str, key: Hashable = "refused") -> errors.DepotError:
        """A PERMISSION_DENIED for an identity refusal, counted (raise it); logged,
        rate-limited per `key` (the peer, where the caller knows it)."""
        self.permission_denied += 1
        held = self.log_limit.admit(key, time.monotonic())
        if held is not None:
            log.warning("refused: %s%s", message, held_note(held))
        return errors.denied(message)

    # -- identity and shares ---------------------------------------------------------

    def refuse(self, key: Hashable, error: errors.DepotError) -> errors.DepotError:
        """`error` (raise it), logged in words, rate-limited per `key` (the peer)."""
        held = self.log_limit.admit(key, time.monotonic())
        if held is not None:
            log.warning("refused: %s%s", error.message, held_note(held))
        return error

    def attest(self, session_id: str, peer: Peer) -> list[Session]:
        """Binds the session to `peer` (its first speaker on the fd socket), or checks
        that `peer` is its owner. PERMISSION_DENIED (counted) for another process;
        RESOURCE_EXHAUSTED when `peer` already holds its quota of sessions. Returns
        the sessions the caller must end to make room (`owner_room`)."""
        s = self.get(session_id)
        if s.owner is not None:
            if not s.owner.same_process(peer):
                raise self.deny(
                    f"session {s.tag} belongs to another process; {peer} may use only "
                    f"sessions it opened",
                    peer_key(peer),
                )
            return []
        ends = self.owner_room(peer)
        self._accounts.leave(s.account, s.id)
        s.owner = peer  # its account changes
        self._accounts.join(s.account, s.id)
        held = self.log_limit.admit(peer_key(peer), time.monotonic())
        if held is not None:
            log.info("session %s attested by %s%s", s.tag, peer, held_note(held))
        return ends

    def owner_room(self, peer: Peer) -> list[Session]:
        """Sessions to end so that `peer` may own one more: none within its quotas.
        Past the process's quota: RESOURCE_EXHAUSTED. Past the uid's: the uid's quota
        is shared fairly among its processes that hold sessions (the newcomer
        counted): a process below its share takes the place of the oldest session of
        the process holding the most (which is above its share); otherwise
        RESOURCE_EXHAUSTED. Refusals are logged, rate-limited per peer."""
        held: dict[Hashable, list[Session]] = {}
        for x in self.sessions.values():
            if x.owner is not None and x.owner.uid == peer.uid:
                held.setdefault(peer_key(x.owner), []).append(x)
        me = peer_key(peer)
        mine = len(held.get(me, ()))
        # Processes the daemon cannot see apart (a sidecar's clients) count per uid only.
        if peer.visible and mine >= self.max_per_pid:
            raise self.refuse(
                me,
                errors.exhausted(
                    f"{peer} already holds {mine} sessions, the most one process may "
                    f"(--max-sessions-per-pid, KVDEPOT_MAX_SESSIONS_PER_PID): reuse one client"
                ),
            )
        theirs = sum(len(v) for v in held.values())
        if theirs < self.max_per_uid:
            return []
        fair = max(1, self.max_per_uid // (len(held) + (me not in held)))
        hog = max(held.values(), key=len)
        if mine + 1 > fair or len(hog) <= fair or hog is held.get(me):
            raise self.refuse(
                me,
                errors.exhausted(
                    f"uid {peer.uid} already holds {theirs} sessions, the most one user may "
                    f"(--max-sessions-per-uid, KVDEPOT_MAX_SESSIONS_PER_UID), and {peer} "
                    f"holds {mine}, its fair share of them ({fair}) or more"
                ),
            )
        oldest = min(hog, key=lambda x: x.opened)
        held_lines = self.log_limit.admit(peer_key(oldest.owner), time.monotonic())
        if held_lines is not None:
            log.warning(
                "uid %d holds its quota of %d sessions: ending session %s of %s, which holds "
                "%d (over its fair share of %d), for %s, which holds %d%s",
                peer.uid,
                self.max_per_uid,
                oldest.tag,
                oldest.owner,
                len(hog),
                fair,
                peer,
                mine,
                held_note(held_lines),
            )
        return [oldest]

    def make_room(self, owner: Peer | None = None, opener: Hashable | None = None) -> list[Session]:
        """Sessions to end so that one more, opened by `owner` (a ticket's process) or
        else `opener` (the transport's word; None: nobody identified), may open.
        An owner: `owner_room`. Otherwise the newcomer's own oldest session not owned
        yet, when its opener holds `max_unattested` of them or the table is full;
        never another opener's. RESOURCE_EXHAUSTED when no room can be made."""
        if owner is not None:
            ends = self.owner_room(owner)
            if ends or len(self.sessions) < self.max_sessions:
                return ends
            mine: list[Session] = []
            key = peer_key(owner)
        else:
            key = opener if opener is not None else UNATTESTED
            mine = [s for s in self.sessions.values() if s.owner is None and s.account == key]
            if len(mine) < self.max_unattested and len(self.sessions) < self.max_sessions:
                return []
        if not mine:
            raise self.refuse(
                key,
                errors.exhausted(
                    f"{len(self.sessions)} sessions are open, the most this daemon allows "
                    f"(--max-sessions, KVDEPOT_MAX_SESSIONS): end idle engines or raise the "
                    f"limit"
                ),
            )
        return [min(mine, key=lambda s: s.opened)]

    def issue_ticket(self, peer: Peer) -> str:
        """A one-use ticket that opens a session `peer` owns (the fd socket's "ticket"
        message, on the loop): kvdepot.server.state.tickets; RESOURCE_EXHAUSTED
        (logged) when `peer` holds its share."""
        try:
            return self._tickets.issue(peer)
        except errors.DepotError as exc:
            raise self.refuse(peer_key(peer), exc) from None

    def take_ticket(self, token: str) -> Peer | None:
        """The process a live ticket names (the ticket is used up); None if none."""
        return self._tickets.take(token)

    def open_call(self, session_id: str) -> tuple[Hashable, int | None]:
        """Counts one more Depot call in flight (a stream, or a unary call from its
        headers on) of `session_id` against its account and its owner's uid
        (kvdepot.server.state.calls_in_flight): FAILED_PRECONDITION for no session,
        RESOURCE_EXHAUSTED (logged) beyond. Give the result to `close_call`."""
        session = self.get(session_id)
        try:
            return self._calls.open(session)
        except errors.DepotError as exc:
            raise self.refuse(session.account, exc) from None

    def close_call(self, held: tuple[Hashable, int | None]) -> None:
        self._calls.close(held)

    def account_sessions(self, session_id: str) -> list[str]:
        """The ids of the sessions charged to `session_id`'s account (its own included;
        just it if it is not open)."""
        s = self.sessions.get(session_id)
        return [session_id] if s is None else self._accounts.members(s.account)

    # -- sessions --------------------------------------------------------------------

    def open(
        self,
        client_name: str,
        pid: int,
        engine_id: str,
        *,
        owner: Peer | None = None,
        opener: Hashable | None = None,
    ) -> Session:
        """A new session (call `make_room` first; `pid` is the client's claim, shown
        to operators only; `owner` and `opener` as for `make_room`)."""
        if len(self.sessions) >= self.max_sessions:
            raise errors.exhausted(
                f"{len(self.sessions)} sessions are open, the most this daemon allows "
                f"(--max-sessions, KVDEPOT_MAX_SESSIONS): end idle engines or raise the limit"
            )
        s = Session(
            secrets.token_hex(16),
            client_name[:200],
            pid,
            engine_id[:200],
            time.monotonic(),
            owner=owner,
            opener=opener,
        )
        self.sessions[s.id] = s
        self._accounts.join(s.account, s.id)
        # One key for every open: who opens is not known yet (any pid may be claimed).
        held = self.log_limit.admit("session opened", time.monotonic())
        if held is not None:
            log.info(
                "session %s opened by %r (says pid %d%s)%s",
                s.tag,
                s.client_name,
                pid,
                f"; owned by {owner}" if owner is not None else "",
                held_note(held),
            )
        return s

    def get(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise errors.precondition(
                f"unknown session {session_tag(session_id)!r}…: open a Session first and pass "
                f"its id (after a daemon restart every session is gone: reconnect)"
            )
        return s

    def close(self, session_id: str) -> tuple[Session, int, int] | None:
        """Forgets the session and ends its registrations; returns (session,
        registrations ended, pending fds closed), or None if it was not open.
        The caller releases its pins and rows in the index."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            return None
        self._accounts.leave(s.account, s.id)
        registrations = len(s.registrations)
        for reg_id in list(s.registrations):
            self._end(self.registrations[reg_id])
        fds = self.fd_source.drop_session(session_id) if self.fd_source else 0
        return s, registrations, fds

    # -- registrations ---------------------------------------------------------------

    def register(
        self,
        session_id: str,
        layout: NamespaceLayout,
        rank: int,
        regions: Sequence[tuple[MemoryPath, object]],
        tensors: Sequence[TensorView],
        groups: Sequence[Sequence[LayerRef]],
        units: int = 1,
    ) -> Registration:
        """Maps the memory and records the registration (regions: (kind, handle)).
        The caller has checked the rank (and `units`, the ranks from it the
        registration stands for) and declared the namespace."""
        session = self.get(session_id)
        if len(session.registrations) >= self.max_registrations:
            raise errors.exhausted(
                f"this session holds {len(session.registrations)} registrations, the most "
                f"one session may hold (--max-registrations-per-session, "
                f"KVDEPOT_MAX_REGISTRATIONS_PER_SESSION): UnregisterKV the ones no longer used"
            )
        if self.headroom is not None and regions:
            share = self.headroom.fds_per_client
            held = sum(len(self.registrations[r].regions) for r in session.registrations)
            if share is not None and held + len(regions) > share:
                raise errors.exhausted(
                    f"this session's registrations hold {held} fds; one session may hold "
                    f"at most {share}, half of the daemon's open-file limit "
                    f"({self.headroom.nofile}, RLIMIT_NOFILE) above --fd-reserve "
                    f"({self.headroom.fd_reserve}), so others can register too: "
                    f"UnregisterKV the ones no longer used, or raise LimitNOFILE"
                )
            try:  # each mapped region holds one fd and at least one mapping
                self.headroom.check_fds(len(regions), f"{len(regions)} more region(s)")
                self.headroom.check_mappings(len(regions), f"{len(regions)} more region(s)")
            except ResourceLow as exc:
                raise errors.exhausted(str(exc)) from None
        kinds = {MemoryPath(kind) for kind, _ in regions}
        if len(kinds) > 1:
            raise errors.invalid(
                f"one registration uses one memory path, got {sorted(k.value for k in kinds)}"
            )
        mapped: list[MappedRegion] = []
        engine: CopyEngine | None = None
        try:
            for kind, handle in regions:
                region, engine = self._open_region(MemoryPath(kind), handle, session)
                mapped.append(region)
            memory = None
            more_units: list[MemoryMap] = []
            if mapped:
                sizes = [r.size for r in mapped]
                memory = MemoryMap.build(layout, sizes, tensors, groups)
                for k in range(1, units):  # unit k: k pages after the first in each layer
                    shifted = [
                        [replace(r, page_offset=r.page_offset + k * r.page_bytes) for r in refs]
                        for refs in groups
                    ]
                    more_units.append(MemoryMap.build(layout, sizes, tensors, shifted))
            elif tensors:
                raise errors.invalid("tensors given without any memory region to hold them")
        except BaseException:
            for r in mapped:
                r.close()
            raise
        reg = Registration(
            id=self._next_registration,
            session_id=session_id,
            layout=layout,
            rank=rank,
            memory_path=next(iter(kinds)) if kinds else MemoryPath.INLINE,
            regions=mapped,
            memory=memory,
            engine=engine,
            registered_bytes=sum(r.size for r in mapped),
            copy_device=engine.copy_device(mapped) if engine is not None else None,
            more_units=tuple(more_units),
        )
        self._next_registration += 1
        self.registrations[reg.id] = reg
        session.registrations.add(reg.id)
        log.info(
            "registration %d: session %s rank %s of namespace %s over %s (%s)",
            reg.id,
            session_tag(session_id),
            rank if units == 1 else f"{rank}-{rank + units - 1}",
            layout.id,
            reg.memory_path.value,
            format_size(reg.registered_bytes),
        )
        return reg

    def registration(self, session_id: str, registration_id: int) -> Registration:
        self.get(session_id)
        reg = self.registrations.get(registration_id)
        if reg is None or reg.session_id != session_id or reg.closing:
            raise errors.precondition(
                f"registration {registration_id} is not registered in this session: call "
                f"RegisterKV first (and again after a daemon restart)"
            )
        return reg

    def unregister(self, session_id: str, registration_id: int) -> None:
        self._end(self.registration(session_id, registration_id))

    @contextlib.contextmanager
    def in_use(self, reg: Registration) -> Iterator[None]:
        """Keeps `reg`'s regions mapped for the length of one copy."""
        reg.inflight += 1
        try:
            yield
        finally:
            self.end_use(reg)

    @staticmethod
    def begin_use(reg: Registration) -> None:
        """`in_use` in two calls, without a generator (the job path, once a job): keeps
        `reg`'s regions mapped until the matching `end_use`, which the caller makes
        in a `finally`."""
        reg.inflight += 1

    def end_use(self, reg: Registration) -> None:
        reg.inflight -= 1
        if reg.closing and reg.inflight == 0:
            self._drop(reg)

    def _end(self, reg: Registration) -> None:
        reg.closing = True
        session = self.sessions.get(reg.session_id)
        if session is not None:
            session.registrations.discard(reg.id)
        if reg.inflight == 0:
            self._drop(reg)

    def _drop(self, reg: Registration) -> None:
        self.registrations.pop(reg.id, None)
        reg.close_regions()

    def close_all(self, unmap: bool = True) -> None:
        """Unmaps every registration (shutdown, after the copy threads stopped).
        `unmap=False` (a copy thread would not stop) leaves the regions mapped
        until the process exits, so that copy cannot fault."""
        if unmap:
            for reg in list(self.registrations.values()):
                reg.close_regions()
