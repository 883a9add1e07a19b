"""A job lane datagram that does not parse fails its job by the job_id read before
the damage (kvdepot.common.lane_protocol.leading_job_id, protobuf's wire format read
by hand, and read as protobuf's own decoder reads it); with no job_id before the damage
there is none (the lane closes). The
real daemon's answer to such datagrams: tests/test_job_lane.py."""

from __future__ import annotations

from google.protobuf.internal import decoder as wire
from google.protobuf.internal import wire_format
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.common.lane_protocol import leading_job_id
from kvdepot.v1 import depot_pb2 as pb


def test_examples() -> None:
    assert leading_job_id(b"\x08\x07" + b"\xff" * 5) == 7  # job_id 7, then garbage
    assert leading_job_id(b"\xff" * 16) is None  # damage from the first byte
    assert leading_job_id(b"") is None
    assert leading_job_id(b"\x12\x02ab\x08\x09\xff") == 9  # after a well-formed field
    assert leading_job_id(b"\x12\x10ab\x08\x09") is None  # inside a truncated field
    assert leading_job_id(b"\x0b\x08\x05") is None  # a group: no TransferJob field


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.text(max_size=8),
    st.lists(st.binary(min_size=1, max_size=40), max_size=3),
    st.binary(max_size=12),
)
def test_the_job_id_of_any_damaged_job_is_found(
    job_id: int, session: str, keys: list[bytes], damage: bytes
) -> None:
    data = pb.TransferJob(job_id=job_id, session_id=session, keys=keys).SerializeToString()
    found = leading_job_id(data + damage)
    # A job_id of 0 is not on the wire (proto3 default): then none, or one from the damage.
    assert found == job_id or (job_id == 0 and (found is None or found < 2**64))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_and_give_a_uint64(data: bytes) -> None:
    found = leading_job_id(data)
    assert found is None or 0 <= found < 2**64  # TransferResult.job_id takes it


def protobufs_leading_job_id(data: bytes) -> int | None:
    """The same, read with protobuf's own wire decoder (the daemon's reader before the
    lane protocol read it by hand, standard library only)."""
    buffer, pos, end = memoryview(data), 0, len(data)
    try:
        while pos < end:
            tag, pos = wire._DecodeVarint(buffer, pos)
            field, wire_type = wire_format.UnpackTag(tag)
            if wire_type in (wire_format.WIRETYPE_START_GROUP, wire_format.WIRETYPE_END_GROUP):
                return None
            value, pos = wire._DecodeUnknownField(buffer, pos, end, field, wire_type)
            if field == 1 and wire_type == wire_format.WIRETYPE_VARINT:
                return value
    except Exception:
        return None
    return None


@settings(max_examples=1000, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.builds(bytes.__add__, st.just(b"\x08"), st.binary())))
def test_it_reads_what_protobufs_decoder_reads(data: bytes) -> None:
    assert leading_job_id(data) == protobufs_leading_job_id(data)
