"""Sessions and watches opened with random identities and cut half-way."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.engine import make_key
from tests.support.fuzz_rig import I64_MAX, I64_MIN, LONG, NS, RawSession, Rig, fuzz_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]


def test_sessions_and_watches_cut_half_way(rig: Rig) -> None:
    @fuzz_settings(150)
    @given(
        st.text(max_size=300),
        st.integers(I64_MIN, I64_MAX),
        st.text(max_size=50),
        st.lists(
            st.sampled_from(["pin", "put_half", "watch", "watch_unknown", "lookup"]), max_size=4
        ),
        st.sampled_from(["cancel", "keep"]),
    )
    def run(name: str, pid: int, engine_id: str, actions: list[str], end: str) -> None:
        s = RawSession.open(rig.stub, name=name, pid=pid, engine_id=engine_id)
        # Namespaces are joined, not named: an inline registration in NS (Put needs
        # one) and an observer join of a namespace nobody declared.
        for layout in (soak.geometry(NS).layout(), pb.NamespaceLayout(id="nowhere")):
            rig.call(rig.stub.RegisterKV, pb.RegisterKVRequest(session_id=s.id, namespace=layout))
        keys = [make_key(c, 0) for c in range(4)]
        for a in actions:
            if a == "pin":
                rig.call(rig.stub.Pin, pb.PinRequest(session_id=s.id, namespace_id=NS, keys=keys))
            elif a == "put_half":  # rank 0 of a fresh row: a reservation of this session
                rig.call(
                    rig.stub.Put,
                    pb.PutRequest(
                        session_id=s.id,
                        namespace_id=NS,
                        key=make_key(pid % 1000, 1, b"half"),
                        rank=0,
                        data=bytes(6144),
                    ),
                )
            elif a in ("watch", "watch_unknown"):
                call = rig.stub.Watch(
                    pb.WatchRequest(
                        session_id=s.id, namespace_id=NS if a == "watch" else "nowhere"
                    ),
                    timeout=10,
                )
                first = next(call)
                assert first.kind == pb.WatchEvent.SNAPSHOT and first.reset
                call.cancel()
            else:
                rig.call(
                    rig.stub.Lookup, pb.LookupRequest(session_id=s.id, namespace_id=NS, keys=keys)
                )
        if end == "cancel":
            s.close()
        rig.check()  # with "keep", the session is still open here
        s.close()

    run()
    rig.final_check()
