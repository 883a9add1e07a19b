"""The daemon's protobuf<->dataclass code for the Depot and Admin services, in one place.

A Transfer job is read into kvdepot.common.jobs.Job and its JobResult written back
(`job_from_proto`, `result_to_proto`), the same two types the client uses; a
RegisterKV request is read into the core's NamespaceLayout, TensorView and
LayerRef (`layout_from_proto`, `memory_from_proto`). Admin's listings are written
from the state's objects (`namespace_info`, `registration_info`, `engine_info`,
`block_infos`). No other module of kvdepot.server.service builds a TransferJob or
TransferResult (tests/test_job_codecs.py checks).

Pure functions, called on the event loop by the servicers and the job lanes
(kvdepot.server.service.depot, admin, job_lane). A job's counts (the lengths of
its repeated fields) are checked (DepotState.admit_job) before
`job_from_proto` copies its keys and block ids into lists; a job message read off
bytes (`read_job`) has its packed lists counted before they are decoded (below). A
malformed layout raises DepotError INVALID_ARGUMENT (kvdepot.server.errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.kinds import MemoryPath
from kvdepot.server import errors
from kvdepot.server.core.index import Namespace, Slot
from kvdepot.server.core.layout import MAX_GROUPS, LayoutError, NamespaceLayout
from kvdepot.server.core.memory_map import LayerRef, TensorView
from kvdepot.server.core.namespace_proof import check_declaration
from kvdepot.server.state.jobs import JobCounts, JobLimits
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.sessions import Session
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb


def job_from_proto(job: pb.TransferJob) -> Job:
    """The job a TransferJob describes, its session as the message names it (the
    stream's client, or the lane's session, filled in by the lane)."""
    # Positional, in Job's field order (namespace_id is not on the wire): every job
    # pays this, and keywords cost half as much again (tests/test_job_codecs.py).
    # Keys and block ids as lists, once: a protobuf repeated field makes a new object
    # at every read, and the check, the index and the planner each read them. Key
    # events are a store's (a load's are never read): not read for a load.
    direction = job.direction
    return Job(
        job.job_id,
        direction,
        list(job.keys),
        list(job.block_ids),
        job.group_sizes,
        job.block_indices,
        job.expedited,
        job.registration_id,
        "",
        job.session_id,
        job.key_events if direction == pb.STORE else (),
    )


# -- a job message read off its bytes ---------------------------------------------------
#
# A TransferJob's packed lists counted off its bytes, before they are decoded.
#
# Parsing costs by the field, not by the byte: a job message within its byte bound
# (bounds.max_job_bytes, 1.2 MiB at the defaults) can carry 1.2 Mi one-byte block ids,
# which protobuf took 6-40 ms to decode on the event loop before the counts refused
# them (state.jobs.check_job_counts). Read as `TransferJobHead`, a message with the same
# field numbers whose packed lists are plain bytes, the same message costs about 0.2 ms,
# and numpy counts the varints in each list (one ends at every byte below 0x80). A job
# whose lists are longer than any job may have comes out as an `OversizedJob`: its ids
# and counts, enough to refuse it (DepotServicer.answer_job) without decoding a list.
#
# Messages of up to SHALLOW_BYTES are decoded at once: they cannot hold many more ids
# than a job may have, and the extra pass would cost more than it saves. Lists sent
# unpacked (legal protobuf, which no encoder does for proto3) are not counted here; they
# cost at least two bytes an id, and the counts refuse them after decoding.

#: Job messages larger than this are counted before they are decoded.
SHALLOW_BYTES = 64 << 10


@dataclass(slots=True)
class OversizedJob:
    """A job message whose lists are longer than any job may have, not decoded: what
    its refusal needs (its session is the lane's, on a lane)."""

    job_id: int
    registration_id: int
    session_id: str
    counts: JobCounts


JobMessage = pb.TransferJob | OversizedJob


def _head_class() -> type[Message]:
    """TransferJob's field numbers (proto/kvdepot/v1/depot.proto), the packed lists as
    bytes; keys (field 4) and the rest are skipped as unknown fields."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="kvdepot/internal/job_head.proto", package="kvdepot.internal", syntax="proto3"
    )
    head = file.message_type.add(name="TransferJobHead")
    for name, number, kind in (
        ("job_id", 1, F.TYPE_UINT64),
        ("registration_id", 3, F.TYPE_UINT64),
        ("block_ids", 5, F.TYPE_BYTES),
        ("group_sizes", 6, F.TYPE_BYTES),
        ("block_indices", 7, F.TYPE_BYTES),
        ("session_id", 9, F.TYPE_STRING),
    ):
        head.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kvdepot.internal.TransferJobHead")
    )


_Head = _head_class()


def _varints(packed: bytes) -> int:
    return int(np.count_nonzero(np.frombuffer(packed, np.uint8) < 0x80)) if packed else 0


def read_job(data: bytes, limits: JobLimits) -> JobMessage:
    """The job `data` holds; an OversizedJob, undecoded, when its block ids, group
    sizes or block indices are more than `limits` and MAX_GROUPS allow. Raises what
    protobuf raises for bytes that are no TransferJob."""
    if len(data) > SHALLOW_BYTES:
        try:
            head = _Head.FromString(data)
        except DecodeError:
            head = None  # decoded below, which says what is wrong
        if head is not None:
            counts = JobCounts(
                0,
                _varints(head.block_ids),
                _varints(head.group_sizes),
                _varints(head.block_indices),
            )
            if counts.blocks > limits.blocks or max(counts.groups, counts.indices) > MAX_GROUPS:
                return OversizedJob(head.job_id, head.registration_id, head.session_id, counts)
    return pb.TransferJob.FromString(data)


def result_to_proto(result: JobResult) -> pb.TransferResult:
    out = pb.TransferResult(
        job_id=result.job_id,
        success=result.success,
        bytes=result.bytes,
        copy_seconds=result.copy_seconds,
        total_seconds=result.total_seconds,
        stored_keys=result.stored_keys,
    )
    # Most results leave these at their defaults (nothing present, dropped or failed):
    # set only then, as each field costs every job about 0.05 µs.
    if (
        result.present_keys
        or result.dropped_keys
        or result.error
        or result.error_code
        or result.drop_reason
    ):
        out.present_keys = result.present_keys
        out.dropped_keys = result.dropped_keys
        out.error = result.error
        out.error_code = result.error_code
        out.drop_reason = result.drop_reason
    return out


def layout_from_proto(msg: pb.NamespaceLayout) -> NamespaceLayout:
    """A declared layout, checked against the id it claims (`check_declaration`)."""
    try:
        layout = NamespaceLayout(
            id=msg.id,
            world_size=msg.world_size,
            blocks_per_chunk=msg.blocks_per_chunk,
            groups=tuple(tuple(g.layer_page_bytes) for g in msg.groups),
            description=msg.description,
            group_ids=tuple(msg.group_ids),
        )
        check_declaration(layout, msg.digest_inputs)
        return layout
    except LayoutError as exc:
        raise errors.invalid(f"namespace layout: {exc}") from None


def memory_from_proto(
    request: pb.RegisterKVRequest,
) -> tuple[list[tuple[MemoryPath, object]], list[TensorView], list[list[LayerRef]]]:
    """A registration's memory: its regions (memory path, handle), the tensors in
    them, and each KV-cache group's layers. A region with no handle is INVALID_ARGUMENT."""
    regions: list[tuple[MemoryPath, object]] = []
    for r in request.regions:
        kind = r.WhichOneof("handle")
        if kind == "shm":
            regions.append((MemoryPath.SHM, (r.shm.fd_token, r.shm.size)))
        elif kind == "cuda_ipc":
            regions.append((MemoryPath.CUDA_IPC, r.cuda_ipc))
        elif kind == "pvm":
            regions.append((MemoryPath.PVM, r.pvm))
        else:
            raise errors.invalid("a memory region needs a handle (shm, cuda_ipc or pvm)")
    tensors = [
        TensorView(
            t.region_index,
            t.region_offset,
            t.num_blocks,
            t.block_stride_bytes,
            t.page_bytes,
        )
        for t in request.tensors
    ]
    groups = [
        [LayerRef(ref.tensor_index, ref.page_offset, ref.page_bytes) for ref in g.layers]
        for g in request.groups
    ]
    return regions, tensors, groups


# -- Admin's listings -----------------------------------------------------------------


def namespace_info(ns: Namespace) -> admin_pb2.NamespaceInfo:
    """A namespace's layout and block counts (ListNamespaces)."""
    lay = ns.layout
    return admin_pb2.NamespaceInfo(
        id=lay.id,
        world_size=lay.world_size,
        blocks_per_chunk=lay.blocks_per_chunk,
        slot_bytes=[lay.slot_bytes(g) for g in range(lay.num_groups)],
        group_ids=lay.group_ids,
        ready_blocks=ns.ready_blocks,
        writing_blocks=ns.writing_blocks,
        used_bytes=ns.used_bytes,
        description=lay.description,
        share_bytes=ns.share_bytes,
        evicted_blocks=ns.evicted_blocks,
    )


def registration_info(r: Registration) -> admin_pb2.RegistrationInfo:
    """One registration of an engine (ListEngines)."""
    return admin_pb2.RegistrationInfo(
        registration_id=r.id,
        namespace_id=r.layout.id,
        rank=r.rank,
        memory_path=r.memory_path.value,
        registered_bytes=r.registered_bytes,
        unit_count=r.unit_count,
    )


def engine_info(
    s: Session,
    registrations: list[Registration],
    pinned_blocks: int,
    job_lanes: int,
    now: float,
) -> admin_pb2.EngineInfo:
    """An open session (ListEngines): `registrations` are its own, in id order;
    `now` is time.monotonic() (its connected_seconds count from s.opened)."""
    return admin_pb2.EngineInfo(
        session_id=s.tag,  # the id itself is the session's secret
        client_name=s.client_name,
        pid=s.owner.pid if s.owner is not None else s.pid,
        engine_id=s.engine_id,
        connected_seconds=now - s.opened,
        registrations=[registration_info(r) for r in registrations],
        pinned_blocks=pinned_blocks,
        job_lanes=job_lanes,
    )


def block_infos(slots: Sequence[Slot]) -> list[admin_pb2.BlockInfo]:
    """One BlockInfo per slot, in order (ListBlocks builds a page a slice at a time)."""
    return [
        admin_pb2.BlockInfo(
            namespace_id=s.namespace,
            key_hex=s.key.hex(),
            key=s.key,
            group=s.group,
            state=s.state.value,
            pins=s.pin_count,
            bytes=s.extent.size,
            pool_offset=s.extent.offset,
            written_ranks_mask=s.written_mask,
        )
        for s in slots
    ]
