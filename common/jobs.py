"""The one job model: a transfer job's description (`Job`) and its result (`JobResult`).

Both sides use these two types and nothing else for a job. The vLLM worker builds a
`Job` from vLLM's `GPULoadStoreSpec`, hands it to the inline transport or to the wire
(kvdepot.client.job_codec); the daemon reads the wire into a `Job`
(kvdepot.server.service.codec), runs it (kvdepot.server.state.jobs) into a `JobResult`,
which goes back on the wire and is read into a `JobResult` again. So a job takes one
form on each side of the wire, and the only protobuf<->dataclass code for it is one
codec module per side.

Field names are the wire's (kvdepot.v1.TransferJob, TransferResult), so each codec is
a field-for-field copy. The list fields are taken as given, never copied: the daemon's
`Job` holds the received message's own repeated fields (its sizes are checked before
anything is built from them), the worker's holds the lists it made from vLLM's spec.

Plain dataclasses with slots, standard library only (kvdepot.common). A `Job` is not
changed once built, except `registration_id`, which the worker fills when its
namespace's registration is known; a `JobResult` is filled by its one runner (the
daemon's event loop, or the worker's thread that fails a job locally) before anyone
else reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.common.kinds import Direction


@dataclass(slots=True)
class Job:
    """One transfer: copy `keys`' chunks between the engine's blocks and the pool.

    `block_ids`, `group_sizes` and `block_indices` are exactly vLLM's GPULoadStoreSpec's
    (group-major block ids, blocks per KV-cache group, first logical block index of each
    group). `direction` is a `Direction` value, kept as an int because the daemon must
    answer a job whose direction is not one (INVALID_ARGUMENT) rather than fail to read it.
    """

    job_id: int
    direction: int
    keys: Sequence[bytes]
    block_ids: Sequence[int]
    group_sizes: Sequence[int]
    block_indices: Sequence[int]
    expedited: bool = False
    # Which registered memory the daemon copies to or from: the wire names it.
    registration_id: int = 0
    # The client's name for the registration's namespace: the inline path (Put/Get)
    # and held jobs use it; not on the wire (the registration implies it).
    namespace_id: str = ""
    # The session the job runs as: filled by the client's Transfer stream, and by the
    # daemon's job lane with the lane's own session.
    session_id: str = ""
    # STORE, optional: one serialized kvdepot.v1.ChunkEvent per key, in keys' order
    # (b"": none for that key); what routers index, kept beside the rows.
    key_events: Sequence[bytes] = ()

    @property
    def is_load(self) -> bool:
        return self.direction == Direction.LOAD


@dataclass(slots=True)
class JobResult:
    """What became of a job. `success` False: `error` says why in words, and
    `error_code` is the status code name of the daemon's error table (or UNAVAILABLE,
    CANCELLED from the client when the daemon could not answer)."""

    job_id: int
    success: bool
    bytes: int = 0
    copy_seconds: float = 0.0
    total_seconds: float = 0.0
    error: str = ""
    error_code: str = ""
    # A STORE's keys: written now, already in the pool, and not written (drop_reason).
    stored_keys: int = 0
    present_keys: int = 0
    dropped_keys: int = 0
    drop_reason: str = ""

    def fail(self, error_code: str, error: str) -> None:
        """Marks the job failed with a status code name and a message."""
        self.success, self.error, self.error_code = False, error, error_code
