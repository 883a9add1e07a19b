"""Transfer streams with random jobs, valid ones mutated so they do not add up."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.common.kinds import SESSION_METADATA
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Geometry, make_key
from tests.support.faults import DOCUMENTED_CODE_NAMES, DOCUMENTED_CODES
from tests.support.fuzz_rig import (
    I64_MAX,
    I64_MIN,
    LONG,
    MAX_JOB_KEYS,
    U32,
    U64,
    Rig,
    fuzz_settings,
)
from tests.support.fuzz_strategies import extremes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600 if LONG else 240)]

MUTATIONS = [
    "neg_block",
    "huge_block",
    "drop_key",
    "extra_key",
    "dup_key",
    "wrong_group_key",
    "empty_key",
    "group_sizes_len",
    "group_sizes_huge",
    "block_indices_huge",
    "bad_session",
    "too_many_keys",
    "bad_registration",
    "bad_direction",
]


@st.composite
def transfer_jobs(draw: st.DrawFn, regs: list[tuple[int, Geometry]]) -> pb.TransferJob:
    """A job that is valid for one of the home registrations, then 0-2 mutations."""
    reg_id, geo = draw(st.sampled_from(regs))
    bpc = geo.blocks_per_chunk
    keys: list[bytes] = []
    block_ids: list[int] = []
    sizes: list[int] = []
    firsts: list[int] = []
    for g in range(len(geo.groups)):
        first = draw(st.integers(0, 5))
        n = draw(st.integers(0, 6))
        chunks = 0 if n == 0 else (first % bpc + n + bpc - 1) // bpc
        ids = draw(st.lists(st.integers(0, geo.num_blocks - 1), min_size=n, max_size=n))
        picks = draw(st.lists(st.integers(0, 20), min_size=chunks, max_size=chunks, unique=True))
        keys += [make_key(c, g, geo.namespace.encode()) for c in picks]
        block_ids += ids
        sizes.append(n)
        firsts.append(first)
    job = pb.TransferJob(
        job_id=draw(st.integers(0, U64)),
        direction=draw(st.sampled_from([1, 1, 2, 2])),
        registration_id=reg_id,
        keys=keys,
        block_ids=block_ids,
        group_sizes=sizes,
        block_indices=firsts,
        expedited=draw(st.booleans()),
        session_id="HOME",
    )
    for m in draw(st.lists(st.sampled_from(MUTATIONS), max_size=2)):
        if m == "neg_block" and job.block_ids:
            job.block_ids[draw(st.integers(0, len(job.block_ids) - 1))] = draw(
                st.sampled_from([-1, I64_MIN])
            )
        elif m == "huge_block" and job.block_ids:
            job.block_ids[0] = draw(st.sampled_from([geo.num_blocks, I64_MAX]))
        elif m == "drop_key" and job.keys:
            del job.keys[-1]
        elif m == "extra_key":
            job.keys.append(make_key(99, 0))
        elif m == "dup_key" and job.keys:
            job.keys.append(job.keys[0])
        elif m == "wrong_group_key" and job.keys:
            job.keys[0] = make_key(1, len(geo.groups) + draw(st.integers(0, 3)))
        elif m == "empty_key" and job.keys:
            job.keys[0] = b""
        elif m == "group_sizes_len":
            job.group_sizes.append(1)
        elif m == "group_sizes_huge" and job.group_sizes:
            job.group_sizes[0] = U32
        elif m == "block_indices_huge" and job.block_indices:
            job.block_indices[0] = U64
        elif m == "bad_session":
            job.session_id = draw(st.sampled_from(["", "nope"]))
        elif m == "too_many_keys":
            job.keys.extend(make_key(1000 + i, 0) for i in range(MAX_JOB_KEYS + 1))
        elif m == "bad_registration":
            job.registration_id = draw(extremes(0, U64))
        elif m == "bad_direction":
            job.direction = draw(st.sampled_from([0, 3, 7]))
    return job


def _drain(results: Iterator[pb.TransferResult], out: queue.Queue) -> None:
    try:
        for r in results:
            out.put(r)
        out.put(grpc.StatusCode.OK)
    except grpc.RpcError as exc:
        out.put(exc.code())


def test_transfer_streams(rig: Rig) -> None:
    regs = rig.registrations()

    @fuzz_settings(300)
    @given(
        st.lists(transfer_jobs(regs), min_size=1, max_size=8),
        st.sampled_from(["read_all", "read_all", "cancel_now", "cancel_after_one", "half_close"]),
    )
    def run(jobs: list[pb.TransferJob], cut: str) -> None:
        requests: queue.SimpleQueue[pb.TransferJob | None] = queue.SimpleQueue()
        for job in jobs:
            job.session_id = rig.resolve(job.session_id)
            requests.put(job)

        def request_iter() -> Iterator[pb.TransferJob]:
            while (job := requests.get()) is not None:
                yield job

        if cut != "cancel_now" and cut != "cancel_after_one":
            requests.put(None)  # half-close: the daemon answers what it got, then ends
        # The home session's stream (as the client opens it: its id in the metadata,
        # server/service/gate.py), whatever sessions its jobs name.
        metadata = [(SESSION_METADATA, rig.home.session_id)]
        call = rig.stub.Transfer(request_iter(), timeout=20, metadata=metadata)
        out: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_drain, args=(call, out), daemon=True)
        reader.start()
        results: list[pb.TransferResult] = []
        status = None
        if cut == "cancel_now":
            call.cancel()
        while status is None:
            item = out.get(timeout=20)
            if isinstance(item, grpc.StatusCode):
                status = item
            else:
                results.append(item)
                if cut == "cancel_after_one":
                    call.cancel()
        requests.put(None)
        reader.join(5)
        rig.note(status)
        if cut.startswith("cancel"):
            assert status in DOCUMENTED_CODES | {grpc.StatusCode.CANCELLED}, status
        else:
            assert status is grpc.StatusCode.OK, status
            assert len(results) == len(jobs)
        for r in results:
            rig.note(r.error_code or "OK")
            assert r.success or r.error_code in DOCUMENTED_CODE_NAMES, r
            assert r.error_code not in ("INTERNAL", "UNKNOWN"), r
        rig.check()

    run()
    rig.final_check()
