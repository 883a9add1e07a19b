"""The index's states, outcomes and reasons, as enums shared by every layer.

Reasons are enums whose value is the short label that metrics and
Admin/GetStats show (`lru`, `pool_full`, ...); `.text` is the sentence a client
reads where the wire carries one (TransferResult.drop_reason, Watch's reason).
"""

from __future__ import annotations

import enum


class SlotState(enum.StrEnum):
    WRITING = "writing"  # reserved; not every rank's section is written yet
    READY = "ready"  # readable by lookups, pins and loads


class StoreOutcome(enum.StrEnum):
    """What `BlockIndex.begin_store` decided for one key of one rank."""

    WRITE = "write"  # copy this rank's section into the slot, then finish_store
    PRESENT = "present"  # nothing to do: ready, or this rank's section done or in flight
    DROPPED = "dropped"  # no space (pool full of pinned / in-flight blocks)


class PutOutcome(enum.StrEnum):
    """An inline Put's outcome (PutResponse.outcome)."""

    STORED = "stored"
    PRESENT = "present"
    DROPPED = "dropped"


class EventKind(enum.StrEnum):
    STORED = "stored"  # a key became READY
    REMOVED = "removed"  # a READY key left the index (evicted)


class Tier(enum.StrEnum):
    """Where the block of an event lives (Watch's `tier`)."""

    POOL = "pool"  # the RAM pool: the index's own events
    DISK = "disk"  # the disk tier below it (kvdepot.server.disk), announced to watchers only


class DiskRemoval(enum.StrEnum):
    """Why the disk tier dropped a record (Watch's `reason` of a disk REMOVED event)."""

    LRU = "lru"  # room for a newer record
    REJECTED = "rejected"  # the record did not verify when read
    LOST = "lost"  # the tier's file was removed or replaced

    @property
    def text(self) -> str:
        return self.value


class EvictionReason(enum.StrEnum):
    """Why a READY block was evicted (Watch's `reason`, evictions_by_reason)."""

    LRU = "lru"  # room for a store
    ADMIN = "admin"  # Admin/Evict
    CLEAR = "clear"  # Admin/Clear

    @property
    def text(self) -> str:
        return self.value


class DropReason(enum.StrEnum):
    """Why a key's store was dropped (nothing written, the engine recomputes)."""

    POOL_FULL = "pool_full"
    ROW_TOO_LARGE = "row_too_large"
    SESSION_QUOTA = "session_quota"  # the writer's process holds its quota (or the pool)
    ROW_GIVEN_UP = "row_given_up"  # another rank of the row dropped it, or its row went unfinished

    @property
    def text(self) -> str:
        return _DROP_TEXT[self]


_DROP_TEXT = {
    DropReason.POOL_FULL: "pool full: every block is pinned or in flight",
    DropReason.ROW_TOO_LARGE: "block row larger than the pool",
    DropReason.SESSION_QUOTA: (
        "this process's sessions hold their quota of block rows being written "
        "(--max-writing-per-session, KVDEPOT_MAX_WRITING_PER_SESSION, counts a process's "
        "sessions together), or every client's rows being written hold 75% of the pool"
    ),
    DropReason.ROW_GIVEN_UP: (
        "another rank of this block row dropped it or its row was dropped unfinished: "
        "this rank's part alone would never make the row whole"
    ),
}


class AbortReason(enum.StrEnum):
    """Why a WRITING row was dropped before it became READY."""

    COPY_FAILED = "copy_failed"
    WRITER_GONE = "writer_gone"
    RESERVATION_TIMEOUT = "reservation_timeout"

    @property
    def text(self) -> str:
        return _ABORT_TEXT[self]


_ABORT_TEXT = {
    AbortReason.COPY_FAILED: "copy failed",
    AbortReason.WRITER_GONE: "writer went away",
    AbortReason.RESERVATION_TIMEOUT: "reservation timed out (a rank never stored its section)",
}
