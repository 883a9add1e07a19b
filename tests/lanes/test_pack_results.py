"""A batched job lane's datagrams (kvdepot.common.lane_protocol.pack_results): the
results' own serialized bytes framed as kvdepot.v1.TransferResults, read back by
protobuf and by the client's codec as the same results, each once, in the order
given; no datagram over RESULTS_DATAGRAM_BYTES unless one result alone is larger.
The real daemon's batched lane: tests/test_job_lane.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.client.job_codec import results_from_bytes
from kvdepot.common.lane_protocol import RESULTS_DATAGRAM_BYTES, pack_results
from kvdepot.v1 import depot_pb2 as pb

results = st.builds(
    pb.TransferResult,
    job_id=st.integers(0, 2**64 - 1),
    success=st.booleans(),
    bytes=st.integers(0, 2**40),
    copy_seconds=st.floats(0, 10),
    error=st.text(max_size=3000),
    error_code=st.sampled_from(["", "NOT_FOUND", "INVALID_ARGUMENT"]),
    stored_keys=st.integers(0, 4096),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(results, max_size=120))
def test_packed_results_read_back_each_once_in_order(sent: list[pb.TransferResult]) -> None:
    answers = [r.SerializeToString() for r in sent]
    datagrams = pack_results(answers)
    got: list[pb.TransferResult] = []
    for datagram, count in datagrams:
        batch = list(pb.TransferResults.FromString(datagram).results)
        assert len(batch) == count > 0
        assert len(datagram) <= RESULTS_DATAGRAM_BYTES or count == 1
        assert [r.job_id for r in results_from_bytes(datagram)] == [r.job_id for r in batch]
        got += batch
    assert got == sent


def test_a_large_outbox_is_cut_into_several_datagrams() -> None:
    sent = [pb.TransferResult(job_id=i, error="x" * 1000) for i in range(200)]
    datagrams = pack_results([r.SerializeToString() for r in sent])
    assert len(datagrams) == 4  # 200 x ~1 KiB in datagrams of at most 64 KiB
    assert sum(count for _, count in datagrams) == 200
    alone = pb.TransferResult(job_id=1, error="y" * (RESULTS_DATAGRAM_BYTES + 10))
    [(datagram, count)] = pack_results([alone.SerializeToString()])
    assert count == 1
    assert pb.TransferResults.FromString(datagram).results[0] == alone
