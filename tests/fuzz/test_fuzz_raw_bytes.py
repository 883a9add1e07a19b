"""Undecodable and random bytes sent to every Depot and Admin method."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.faults import DOCUMENTED_CODES
from tests.support.fuzz_rig import LONG, Rig, fuzz_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]

DEPOT_METHODS = {
    "Session": "unary_stream",
    "RegisterKV": "unary",
    "UnregisterKV": "unary",
    "Watch": "unary_stream",
    "Lookup": "unary",
    "Pin": "unary",
    "Unpin": "unary",
    "Transfer": "stream_stream",
    "Put": "unary",
    "PutParts": "stream_unary",
    "Get": "unary",
}
ADMIN_METHODS = ["GetStats", "ListNamespaces", "ListEngines", "ListBlocks", "Evict", "Clear"]
ALL_METHODS = [(f"/kvdepot.v1.Depot/{m}", kind) for m, kind in DEPOT_METHODS.items()] + [
    (f"/kvdepot.v1.Admin/{m}", "unary") for m in ADMIN_METHODS
]


def _raw(channel: grpc.Channel, method: str, kind: str, payloads: list[bytes]) -> grpc.StatusCode:
    ident: dict[str, Any] = {
        "request_serializer": lambda b: b,
        "response_deserializer": lambda b: b,
    }
    try:
        if kind == "unary":
            channel.unary_unary(method, **ident)(payloads[0], timeout=10)
        elif kind == "unary_stream":
            call = channel.unary_stream(method, **ident)(payloads[0], timeout=10)
            next(call)  # a parsable request opens the stream (a session, a watch): end it
            call.cancel()
        elif kind == "stream_unary":
            channel.stream_unary(method, **ident)(iter(payloads), timeout=10)
        else:
            list(channel.stream_stream(method, **ident)(iter(payloads), timeout=10))
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK  # we cancelled it after the first message
        return exc.code()
    return grpc.StatusCode.OK


def test_undecodable_and_random_bytes_on_every_method(rig: Rig) -> None:
    payload = st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\xff\xff\xff", b"\x0a\x05ab", b"\x08", b"\x12\xff\xff\xff\xff\x0f"]),
    )

    @fuzz_settings(300)
    @given(st.sampled_from(ALL_METHODS), st.lists(payload, min_size=1, max_size=4))
    def run(method: tuple[str, str], payloads: list[bytes]) -> None:
        # Admin is served on the operator socket only (the data socket refuses it).
        admin = method[0].startswith("/kvdepot.v1.Admin/")
        channel = rig.admin_channel if admin else rig.channel
        assert channel is not None
        code = _raw(channel, method[0], method[1], payloads)
        rig.note(code)
        assert code in DOCUMENTED_CODES, (method, payloads, code)
        rig.check()

    run()
    rig.final_check()
