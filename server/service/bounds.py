"""Size checks of a RegisterKV request, on its lists' lengths, before anything is
built from it: one registration of 64 groups x 4096 layers held the event loop for
98 ms. The bounds are the layout's own (kvdepot.server.core.layout)."""

from __future__ import annotations

from kvdepot.common.kinds import PUT_PART_BYTES
from kvdepot.server import errors
from kvdepot.server.config import ServeConfig
from kvdepot.server.core.layout import MAX_GROUPS, MAX_KEY_BYTES, MAX_LAYOUT_LAYERS
from kvdepot.v1 import depot_pb2 as pb

# Concurrent RPCs per allowed session (its Session and Transfer streams, Watch
# streams, unary calls in flight): past it grpc answers RESOURCE_EXHAUSTED.
RPCS_PER_SESSION = 16


def max_request_bytes(cfg: ServeConfig) -> int:
    """The largest legal request but a Put (wire.py refuses larger ones unparsed): a
    call of the most keys allowed, each of the longest, or the largest job (keys
    and block ids, 11 bytes each at most), plus room for the rest of a message."""
    key = MAX_KEY_BYTES + 3  # tag and length
    keys = max(cfg.max_batch_keys, cfg.max_job_keys)
    return keys * key + cfg.max_job_blocks * 11 + (1 << 20)


def receive_limit(cfg: ServeConfig) -> int:
    """grpc's receive limit on the daemon's servers: the largest legal request, a Put
    of one part included (a larger section goes by PutParts). grpc refuses a larger
    message with RESOURCE_EXHAUSTED from its length, before receiving it: one limit
    serves every method, so it must fit the largest one's."""
    return max(max_request_bytes(cfg), PUT_PART_BYTES + (64 << 10))


def max_job_bytes(max_job_keys: int, max_job_blocks: int) -> int:
    """The largest legal TransferJob (a stream's message, a lane's datagram): its
    most keys, each of the longest, its most block ids, and a group size and block
    index per group (11 bytes each at most), plus room for its scalars. About 1.2 MiB
    at the defaults, against 5.2 MiB for a Lookup: a job of 4 Mi one-byte block ids
    no longer reaches the parser."""
    key = MAX_KEY_BYTES + 3
    return max_job_keys * key + (max_job_blocks + 2 * MAX_GROUPS) * 11 + (64 << 10)


def type_bytes(cfg: ServeConfig) -> dict[str, int]:
    """Request types with a bound of their own below `max_request_bytes` (wire.py)."""
    job = max_job_bytes(cfg.max_job_keys, cfg.max_job_blocks)
    return {pb.TransferJob.DESCRIPTOR.full_name: job}


def max_concurrent_rpcs(cfg: ServeConfig) -> int:
    return cfg.max_sessions * RPCS_PER_SESSION


def check_register_size(request: pb.RegisterKVRequest) -> None:
    """Refuses (INVALID_ARGUMENT, naming the limit) a registration with more groups
    than MAX_GROUPS, or more layers, layer refs, tensors or regions than
    MAX_LAYOUT_LAYERS (a layer needs one tensor and one region at most)."""
    layout = request.namespace
    for what, groups in (
        ("namespace layout", layout.groups),
        ("group ids", layout.group_ids),
        ("layer refs", request.groups),
    ):
        if len(groups) > MAX_GROUPS:
            raise errors.invalid(
                f"{what}: {len(groups)} groups; a namespace has at most {MAX_GROUPS} (MAX_GROUPS)"
            )
    counts = {
        "layers": sum(len(g.layer_page_bytes) for g in layout.groups),
        "layer refs": sum(len(g.layers) for g in request.groups),
        "tensors": len(request.tensors),
        "regions": len(request.regions),
    }
    for what, n in counts.items():
        if n > MAX_LAYOUT_LAYERS:
            raise errors.invalid(
                f"{n} {what} in one registration; a namespace has at most "
                f"{MAX_LAYOUT_LAYERS} layers (MAX_LAYOUT_LAYERS)"
            )
