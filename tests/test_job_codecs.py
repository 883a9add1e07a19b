"""The one job model (kvdepot.common.jobs) and the two codecs that put it on the wire:
the client's (kvdepot.client.job_codec) and the daemon's (kvdepot.server.service.codec)
agree field for field, and no wire field of a job or its result is left out of the model.

And they are the only codecs: read from the source, no module of client/ but
job_codec.py, and none of server/service/ but codec.py, builds or parses a
TransferJob or TransferResult message (the daemon's job lane reads its job datagrams
with the codec's `read_job`, as gRPC's deserializer does for the stream). The checker is
shown to catch what it exists to stop: each message this rule moved into a codec, put
back into a copy of its module, fails it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError

from kvdepot.client.job_codec import job_to_proto, result_from_proto
from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.kinds import Direction
from kvdepot.server.service.codec import (
    SHALLOW_BYTES,
    OversizedJob,
    job_from_proto,
    read_job,
    result_to_proto,
)
from kvdepot.server.state.jobs import JobCounts, JobLimits
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import make_key
from tests.support.source_rules import ROOT, assert_check_catches

# (folder, its one codec): every module below the folder but the codec is checked.
CODEC_HOMES = [(ROOT / "client", "job_codec.py"), (ROOT / "server" / "service", "codec.py")]
JOB_MESSAGES = {"TransferJob", "TransferResult", "TransferResults"}
ALLOWED: set[tuple[str, str]] = set()  # the job lanes read jobs with codec.read_job


def test_every_wire_field_of_a_job_and_a_result_is_in_the_model() -> None:
    job_fields = {f.name for f in dataclasses.fields(Job)}
    result_fields = {f.name for f in dataclasses.fields(JobResult)}
    assert {f.name for f in pb.TransferJob.DESCRIPTOR.fields} <= job_fields
    assert {f.name for f in pb.TransferResult.DESCRIPTOR.fields} == result_fields


def test_a_job_crosses_the_wire_unchanged_but_its_namespace_name() -> None:
    sent = Job(
        job_id=7,
        direction=Direction.LOAD,
        keys=[b"\x01" * 32, b"\x02" * 32],
        block_ids=[5, 6, 9],
        group_sizes=[2, 1],
        block_indices=[3, 0],
        expedited=True,
        registration_id=4,
        namespace_id="ns-a",  # the client's own: the registration implies it
        session_id="s-1",
    )
    data = job_to_proto(sent).SerializeToString()
    got = job_from_proto(pb.TransferJob.FromString(data))
    assert got.is_load and got.namespace_id == ""
    assert (
        got.job_id,
        got.direction,
        list(got.keys),
        list(got.block_ids),
        list(got.group_sizes),
        list(got.block_indices),
        got.expedited,
        got.registration_id,
        got.session_id,
    ) == (7, Direction.LOAD, sent.keys, [5, 6, 9], [2, 1], [3, 0], True, 4, "s-1")


def test_a_result_crosses_the_wire_unchanged() -> None:
    sent = JobResult(
        job_id=9,
        success=True,
        bytes=1 << 33,
        copy_seconds=0.25,
        total_seconds=0.5,
        stored_keys=3,
        present_keys=2,
        dropped_keys=1,
        drop_reason="pool full",
    )
    failed = JobResult(job_id=10, success=True)
    failed.fail("NOT_FOUND", "key 0102… is not ready")
    # Most results: nothing present, dropped or failed (written with fewer fields).
    stored = JobResult(11, True, bytes=1 << 20, copy_seconds=0.5, total_seconds=1.0)
    stored.stored_keys = 16
    loaded = JobResult(12, True, bytes=1 << 20, copy_seconds=0.5, total_seconds=1.0)
    for result in (sent, failed, stored, loaded):
        data = result_to_proto(result).SerializeToString()
        assert result_from_proto(pb.TransferResult.FromString(data)) == result
    assert (failed.success, failed.error_code) == (False, "NOT_FOUND")


def _message_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names bound to the kvdepot.v1.depot_pb2 module, job message names imported
    from it) in `tree`: `from kvdepot.v1 import depot_pb2 as pb` binds `pb`."""
    modules, messages = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "kvdepot.v1":
            modules |= {a.asname or a.name for a in node.names if a.name == "depot_pb2"}
        elif isinstance(node, ast.ImportFrom) and node.module == "kvdepot.v1.depot_pb2":
            messages |= {a.asname or a.name for a in node.names if a.name in JOB_MESSAGES}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name.endswith(".depot_pb2") and a.asname}
    return modules, messages


def job_message_uses(path: Path, source: str) -> list[str]:
    """Each call in `source` that builds a TransferJob/TransferResult (`pb.TransferJob(...)`)
    or parses one (`depot_pb2.TransferResult.FromString(...)`). vLLM's own TransferResult
    (kvdepot.client.vllm.job_ledger builds it for vLLM) is no job message."""
    tree = ast.parse(source, str(path))
    modules, messages = _message_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = ast.unparse(node.func)
        parts = callee.split(".")
        if parts[-1] == "FromString":
            parts = parts[:-1]
        builds = (len(parts) == 2 and parts[0] in modules and parts[1] in JOB_MESSAGES) or (
            len(parts) == 1 and parts[0] in messages
        )
        if builds and (path.name, callee) not in ALLOWED:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {callee}(...)")
    return found


def checked_modules() -> list[Path]:
    return [
        path
        for folder, codec in CODEC_HOMES
        for path in sorted(folder.rglob("*.py"))
        if "__pycache__" not in path.parts and path != folder / codec
    ]


def test_only_the_codecs_build_or_parse_job_messages() -> None:
    found = [v for path in checked_modules() for v in job_message_uses(path, path.read_text())]
    assert not found, (
        "job messages belong in client/job_codec.py and server/service/codec.py:\n"
        + "\n".join(found)
    )


def test_the_codecs_themselves_are_seen_building_them() -> None:
    """The checker reads the codecs' own calls as uses (it is not blind to them)."""
    for folder, codec in CODEC_HOMES:
        path = folder / codec
        assert job_message_uses(path, path.read_text()), codec


@pytest.mark.parametrize(
    ("module", "anchor", "planted"),
    [
        # What each module did before its codec did it for it.
        (
            "client/transfer_stream.py",
            "self._done[job_id] = JobResult(job_id, False, error=error, error_code=code)",
            "self._done[job_id] = depot_pb2.TransferResult(job_id=job_id, success=False)",
        ),
        (
            "client/transfer_stream.py",
            "msg = job_to_proto(job)",
            "msg = depot_pb2.TransferJob(job_id=job.job_id, keys=job.keys)",
        ),
        (
            "client/job_lane.py",
            "JobCalls(max_job_bytes, batched, result_from_bytes, results_from_bytes)",
            "JobCalls(max_job_bytes, batched, result_from_bytes, "
            "lambda d: list(depot_pb2.TransferResults.FromString(d).results))",
        ),
        (
            "client/vllm/worker.py",
            "from kvdepot.v1 import depot_pb2\n",
            "from kvdepot.v1 import depot_pb2\nfrom kvdepot.v1.depot_pb2 import TransferJob\n"
            "_EMPTY = TransferJob()\n",
        ),
        (
            "server/service/job_lane.py",
            'rejected = JobResult(job_id, False, error=why, error_code="INVALID_ARGUMENT")',
            "rejected = pb.TransferResult(job_id=job_id, success=False, error=why)",
        ),
        (
            "server/service/depot.py",
            "return result_to_proto(await self.state.run_job(job_from_proto(job)))",
            "return pb.TransferResult(job_id=job.job_id, success=True)",
        ),
        (
            "server/service/job_lane.py",
            "req = pb.PinRequest.FromString(data)",
            "req = pb.TransferResult.FromString(data)",
        ),
    ],
)
def test_the_check_catches_a_job_message_put_back(module: str, anchor: str, planted: str) -> None:
    assert_check_catches(job_message_uses, module, anchor, planted)


def test_a_job_messages_lists_are_counted_before_they_are_decoded() -> None:
    # codec.read_job: a message past SHALLOW_BYTES whose packed lists are longer than
    # any job may have comes out undecoded, with what its refusal needs; a legal one,
    # large or small, as protobuf decodes it; bytes that are no job raise.
    limits = JobLimits()

    def job(blocks: int, keys: int = 0, groups: int = 1) -> bytes:
        msg = pb.TransferJob(job_id=5, registration_id=3, session_id="s-1")
        msg.group_sizes.extend([blocks] + [0] * (groups - 1))
        msg.block_indices.extend([0] * groups)
        msg.block_ids.extend([1] * blocks)
        msg.keys.extend(make_key(i, 0) for i in range(keys))
        return msg.SerializeToString()

    big = read_job(job(1_240_000), limits)
    assert big == OversizedJob(5, 3, "s-1", JobCounts(0, 1_240_000, 1, 1)), big
    many_groups = read_job(job(limits.blocks, groups=40_000), limits)
    assert isinstance(many_groups, OversizedJob) and many_groups.counts.groups == 40_000
    for data in (job(limits.blocks, keys=limits.keys), job(16)):  # the largest, a small one
        assert read_job(data, limits) == pb.TransferJob.FromString(data)
    assert len(job(limits.blocks, keys=limits.keys)) > SHALLOW_BYTES
    small_but_over = job(limits.blocks + 1)  # under SHALLOW_BYTES: decoded, counts refuse it
    assert len(small_but_over) < SHALLOW_BYTES
    assert isinstance(read_job(small_but_over, limits), pb.TransferJob)
    with pytest.raises(DecodeError):
        read_job(b"\xff" * (SHALLOW_BYTES + 1), limits)
