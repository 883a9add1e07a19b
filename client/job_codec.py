"""The client's only protobuf<->job code: `Job` to kvdepot.v1.TransferJob, and
kvdepot.v1.TransferResult (a message, or a job lane's datagram, or the several of a
batched lane's TransferResults datagram) to `JobResult`
(kvdepot.common.jobs). kvdepot.client.transfer_stream encodes each job once and
decodes each result once, on the thread that reads it (the stream's or the lane's
reader); no other client module builds or reads these messages
(tests/test_job_codecs.py checks).

Pure functions, called on whatever thread submits a job or collects its results
(the vLLM worker's model-runner thread). Field for field, no per-key work: the
message's repeated fields take the job's lists (protobuf copies them once, into the
message it serializes), and a result's fields are scalars.
"""

from __future__ import annotations

from kvdepot.common.jobs import Job, JobResult
from kvdepot.v1 import depot_pb2


def job_to_proto(job: Job) -> depot_pb2.TransferJob:
    """The wire form of `job` (its namespace_id stays behind: the registration implies it;
    an empty session_id is filled by the TransferStream that sends it)."""
    msg = depot_pb2.TransferJob(
        job_id=job.job_id,
        direction=job.direction,  # type: ignore[arg-type]  # a Direction value
        registration_id=job.registration_id,
        keys=job.keys,
        block_ids=job.block_ids,
        group_sizes=job.group_sizes,
        block_indices=job.block_indices,
        expedited=job.expedited,
        session_id=job.session_id,
    )
    if job.key_events:  # most jobs carry none: no field to fill
        msg.key_events.extend(job.key_events)
    return msg


def result_from_proto(msg: depot_pb2.TransferResult) -> JobResult:
    """A result as the daemon sent it on the Transfer stream."""
    # Positional, in JobResult's field order: every result pays this, and keywords
    # cost half as much again (tests/test_job_codecs.py checks the round trip).
    return JobResult(
        msg.job_id,
        msg.success,
        msg.bytes,
        msg.copy_seconds,
        msg.total_seconds,
        msg.error,
        msg.error_code,
        msg.stored_keys,
        msg.present_keys,
        msg.dropped_keys,
        msg.drop_reason,
    )


def result_from_bytes(data: bytes) -> JobResult:
    """A result as the daemon sent it on a job lane (one serialized TransferResult;
    raises protobuf's DecodeError when the datagram is not one)."""
    return result_from_proto(depot_pb2.TransferResult.FromString(data))


def results_from_bytes(data: bytes) -> list[JobResult]:
    """The results of a batched job lane's datagram (one serialized TransferResults,
    OpenJobLaneRequest.batched_results; raises DecodeError when it is not one)."""
    return [result_from_proto(msg) for msg in depot_pb2.TransferResults.FromString(data).results]
