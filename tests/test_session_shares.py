"""Shares per owner in `Sessions`, directly (the attacks against a real daemon are
tests/security/test_shares.py): whose sessions make room, fair shares of a uid,
tickets, calls in flight."""

from __future__ import annotations

import random

import pytest

from kvdepot.server import errors
from kvdepot.server.peer import Peer
from kvdepot.server.state.calls_in_flight import MAX_CALLS_PER_ACCOUNT
from kvdepot.server.state.sessions import Sessions


def process(pid: int, uid: int = 1000) -> Peer:
    return Peer(pid, uid, uid, start_time=pid * 10)


def opened(sessions: Sessions, **kw) -> str:
    for old in sessions.make_room(kw.get("owner"), kw.get("opener")):
        sessions.close(old.id)
    return sessions.open("c", 0, "", **kw).id


def test_room_is_made_from_the_openers_own_sessions_never_anothers() -> None:
    s = Sessions(max_sessions=64, max_unattested=4)
    tcp = ("tcp", "10.0.0.7", "")
    engine = opened(s, opener=tcp)
    local = [opened(s) for _ in range(4)]
    for _ in range(100):  # a local caller opening sessions in a loop
        opened(s)
    assert engine in s.sessions  # the TCP engine's session stays
    assert not set(local) & set(s.sessions)  # the caller's own oldest went
    assert sum(x.opener is None for x in s.sessions.values()) == 4


def test_a_ticket_opens_a_session_owned_from_the_start() -> None:
    s = Sessions()
    p = process(7)
    ticket = s.issue_ticket(p)
    owner = s.take_ticket(ticket)
    assert owner == p and s.take_ticket(ticket) is None  # one use
    sid = opened(s, owner=owner)
    assert s.sessions[sid].owner == p
    assert s.attest(sid, p) == []  # the client's attest after the hello: its own
    with pytest.raises(errors.DepotError) as err:
        s.attest(sid, process(8))
    assert err.value.code is errors.Code.PERMISSION_DENIED


def test_a_process_holds_as_many_tickets_as_sessions() -> None:
    s = Sessions(max_per_pid=2)
    p = process(7)
    s.issue_ticket(p)
    s.issue_ticket(p)
    with pytest.raises(errors.DepotError) as err:
        s.issue_ticket(p)
    assert err.value.code is errors.Code.RESOURCE_EXHAUSTED
    assert s.issue_ticket(process(8))  # another process has its own


def test_a_uids_quota_is_shared_fairly_among_its_processes() -> None:
    s = Sessions(max_per_pid=4, max_per_uid=8)
    hogs = [process(1), process(2)]
    first = {h: [opened(s, owner=h) for _ in range(4)] for h in hogs}
    newcomer = process(3)
    sid = opened(s, owner=newcomer)  # fair share 8 // 3 = 2: it may have one
    assert s.sessions[sid].owner == newcomer
    assert first[hogs[0]][0] not in s.sessions  # the largest holder's oldest went
    opened(s, owner=newcomer)  # its second: the other hog's oldest goes
    assert first[hogs[1]][0] not in s.sessions
    with pytest.raises(errors.DepotError) as err:  # a third is over its share
        opened(s, owner=newcomer)
    assert "fair share" in err.value.message
    with pytest.raises(errors.DepotError):  # a hog cannot take its place back
        opened(s, owner=hogs[0])
    assert len(s.sessions) == 8


def test_sessions_of_one_process_are_one_account() -> None:
    s = Sessions()
    p = process(7)
    a, b = opened(s, owner=p), opened(s, owner=p)
    c = opened(s, owner=process(8))
    assert sorted(s.account_sessions(a)) == sorted([a, b])
    assert s.account_sessions(c) == [c]


def test_account_sessions_follow_opens_attests_and_closes() -> None:
    """The grouping kept as sessions change (accounts.py) against a scan of every
    session, after each step of a seeded random run."""
    rng = random.Random(5)
    s = Sessions(max_sessions=64, max_per_pid=64, max_per_uid=64, max_unattested=64)
    peers = [process(pid, uid) for pid, uid in ((1, 1000), (2, 1000), (3, 1001))]
    openers = [None, ("tcp", "10.0.0.7", "")]
    for _ in range(400):
        ids = list(s.sessions)
        step = rng.random()
        if step < 0.45 or not ids:
            opened(s, owner=rng.choice([None, *peers]), opener=rng.choice(openers))
        elif step < 0.7:
            sid = rng.choice(ids)
            if s.sessions[sid].owner is None:
                for old in s.attest(sid, rng.choice(peers)):
                    s.close(old.id)
        else:
            s.close(rng.choice(ids))
        for sid, session in s.sessions.items():
            scan = [o.id for o in s.sessions.values() if o.account == session.account]
            assert sorted(s.account_sessions(sid)) == sorted(scan)
    assert s.account_sessions("gone") == ["gone"]


def test_calls_in_flight_are_counted_per_account() -> None:
    s = Sessions(max_calls_per_uid=MAX_CALLS_PER_ACCOUNT + 10)
    a = opened(s, owner=process(7))
    b = opened(s, owner=process(7))
    held = [s.open_call(a if i % 2 else b) for i in range(MAX_CALLS_PER_ACCOUNT)]
    with pytest.raises(errors.DepotError) as err:  # both sessions: one process
        s.open_call(a)
    assert err.value.code is errors.Code.RESOURCE_EXHAUSTED
    other = opened(s, owner=process(8))  # same uid, another process: 10 more
    more = [s.open_call(other) for _ in range(10)]
    with pytest.raises(errors.DepotError):  # the uid's bound
        s.open_call(other)
    for h in held + more:
        s.close_call(h)
    s.close_call(s.open_call(a))  # all given back
    with pytest.raises(errors.DepotError) as err:
        s.open_call("no such session")
    assert err.value.code is errors.Code.FAILED_PRECONDITION
