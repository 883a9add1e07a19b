"""Every unary Depot and Admin call with random and malformed requests."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import depot_pb2 as pb
from tests.support.fuzz_rig import LONG, NS, U32, U64, Rig, fuzz_settings
from tests.support.fuzz_strategies import (
    any_key,
    extremes,
    key_lists,
    layouts,
    namespaces,
    ranks,
    section_sizes,
    sessions,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]


@st.composite
def unary_calls(draw: st.DrawFn) -> tuple[str, str, Any]:
    """(service, method, request) with the home session as "HOME"."""
    s, ns, keys = draw(sessions), draw(namespaces), draw(key_lists)
    key, rank = draw(any_key), draw(ranks)
    method = draw(
        st.sampled_from(
            [
                "Lookup",
                "Pin",
                "Unpin",
                "Put",
                "Get",
                "UnregisterKV",
                "RegisterKV",
                "GetStats",
                "ListNamespaces",
                "ListEngines",
                "ListBlocks",
                "Evict",
                "Clear",
            ]
        )
    )
    if method == "Lookup":
        return "depot", method, pb.LookupRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Pin":
        return "depot", method, pb.PinRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Unpin":
        return "depot", method, pb.UnpinRequest(session_id=s, namespace_id=ns, keys=keys)
    if method == "Put":
        return (
            "depot",
            method,
            pb.PutRequest(
                session_id=s, namespace_id=ns, key=key, rank=rank, data=bytes(draw(section_sizes))
            ),
        )
    if method == "Get":
        return "depot", method, pb.GetRequest(session_id=s, namespace_id=ns, key=key, rank=rank)
    if method == "UnregisterKV":
        return (
            "depot",
            method,
            pb.UnregisterKVRequest(session_id=s, registration_id=draw(extremes(0, U64))),
        )
    if method == "RegisterKV":  # inline (no memory): only the layout and the rank matter
        return (
            "depot",
            method,
            pb.RegisterKVRequest(session_id=s, namespace=draw(layouts()), rank=rank),
        )
    if method == "ListBlocks":
        return (
            "admin",
            method,
            apb.ListBlocksRequest(
                namespace_id=ns,
                has_group=draw(st.booleans()),
                group=draw(extremes(0, U32, 3)),
                page_size=draw(extremes(0, U32, 20)),
                page_token=draw(
                    st.one_of(
                        st.text(max_size=30),
                        st.just(f"{NS}/00"),
                        st.just(f"{NS}/zz"),
                        st.just("-5"),
                    )
                ),
            ),
        )
    if method == "Evict":
        return "admin", method, apb.EvictRequest(namespace_id=ns, keys=keys[:20])
    request_type = {
        "GetStats": apb.GetStatsRequest,
        "ListNamespaces": apb.ListNamespacesRequest,
        "ListEngines": apb.ListEnginesRequest,
        "Clear": apb.ClearRequest,
    }[method]
    return "admin", method, request_type()


def test_unary_calls(rig: Rig) -> None:
    depot, adm = rig.stub, rig.admin

    @fuzz_settings(600)
    @given(st.lists(unary_calls(), min_size=1, max_size=12))
    def run(calls: list[tuple[str, str, Any]]) -> None:
        for service, method, request in calls:
            if hasattr(request, "session_id"):
                request.session_id = rig.resolve(request.session_id)
            rig.call(getattr(depot if service == "depot" else adm, method), request)
        rig.check()

    run()
    rig.final_check()
