"""A chunk's router metadata between vLLM's OffloadingEventsTracker and kvdepot.v1.ChunkEvent.

With `self_describing_kv_events` on, vLLM's offloading scheduler snapshots, for each
chunk it stores or hits, what its KV events need (`OffloadingEventsTracker`: block
hashes, parent hash, token ids, block size, group, LoRA) and turns its manager's
OffloadingEvents into complete BlockStored / BlockRemoved events from it. A chunk
another engine stored has no snapshot here, so vLLM would publish a placeholder (one
hash, no tokens, block size 0). kvdepot closes that gap:

- the storing engine's scheduler reads the snapshots of the chunks a step stores
  (`encode_for_keys`) and sends them with the store job (TransferJob.key_events, from
  the worker of rank 0 on each shard);
- the daemon keeps each beside its row and hands it with Watch STORED and SNAPSHOT
  events, and with REMOVED events the rows' it removed; the mirror collects them, and
  `TrackerFeed` lends the tracker, for one step, each one the step's events name and
  the tracker lacks, before it translates them: every engine then publishes what the
  storing one does, and holds other engines' snapshots for one step, not the pool's.

The tracker's snapshot table (`_pending_event_metadata`) and its record type are
vLLM 0.33.0's own (kvdepot pins that version): this module is the one place that
reads or writes them, and tests/vllm/test_chunk_events.py compares the events of
every engine with the storing engine's, so a change in vLLM fails there.

Threads: `encode_for_keys` and `TrackerFeed` run on vLLM's scheduler thread, which
owns the tracker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
    _OffloadEventMetadata,
)
from vllm.v1.kv_offload.base import Medium

from kvdepot.v1 import depot_pb2

# The residency vLLM's tracker gives a chunk held by the primary (CPU) tier.
_POOL_RESIDENCY = (Medium.CPU, None)


def tracker_of(scheduler: Any) -> OffloadingEventsTracker | None:
    """The OffloadingConnectorScheduler's tracker, when it records self-describing events."""
    tracker = getattr(scheduler, "_events_tracker", None)
    if isinstance(tracker, OffloadingEventsTracker) and tracker.self_describing_enabled:
        return tracker
    return None


def encode(meta: _OffloadEventMetadata) -> bytes:
    """One snapshot as a serialized ChunkEvent."""
    msg = depot_pb2.ChunkEvent(
        block_hashes=list(meta.block_hashes),
        parent_block_hash=meta.parent_block_hash or b"",
        token_ids=meta.token_ids,
        block_size=meta.block_size,
        group_idx=meta.group_idx,
        has_lora=meta.lora_id is not None or meta.lora_name is not None,
        lora_id=meta.lora_id or 0,
        lora_name=meta.lora_name or "",
        kv_cache_spec_kind=meta.kv_cache_spec.kv_cache_spec_kind or "",
        kv_cache_spec_sliding_window=meta.kv_cache_spec.kv_cache_spec_sliding_window or 0,
    )
    return msg.SerializeToString()


def encode_for_keys(tracker: OffloadingEventsTracker, keys: Iterable[bytes]) -> list[bytes]:
    """Each key's snapshot, serialized (b"" where the tracker has none: a sliding-window
    group's); an empty list when it has none of them."""
    table = tracker._pending_event_metadata
    out = [encode(meta) if (meta := table.get(key)) is not None else b"" for key in keys]
    return out if any(out) else []


def decode(data: bytes, on_pool: bool) -> _OffloadEventMetadata:
    """A serialized ChunkEvent as the tracker's snapshot; `on_pool`: the chunk is in the
    daemon's pool (vLLM's primary tier), as the tracker records a hit."""
    msg = depot_pb2.ChunkEvent.FromString(data)
    return _OffloadEventMetadata(
        block_hashes=tuple(msg.block_hashes),
        parent_block_hash=msg.parent_block_hash or None,
        token_ids=tuple(msg.token_ids),
        block_size=msg.block_size,
        lora_id=msg.lora_id if msg.has_lora else None,
        lora_name=(msg.lora_name or None) if msg.has_lora else None,
        extra_keys=None,  # vLLM 0.33.0's tracker sends none either
        group_idx=msg.group_idx,
        kv_cache_spec=OffloadingEventGroupSpec(
            msg.kv_cache_spec_kind or None, msg.kv_cache_spec_sliding_window or None
        ),
        active_residencies={_POOL_RESIDENCY} if on_pool else set(),
    )


class TrackerFeed:
    """Lends vLLM's tracker, for one step, the chunk events of the keys that step's
    KV events name and that it lacks, and takes them back at the next step.

    The tracker keeps a snapshot until the chunk's final removal; kept for every
    chunk of the node's pool, another engine's snapshots would cost each engine's
    scheduler about a kilobyte a chunk. Lent instead for the one translation that
    needs them (a removal's comes with the daemon's REMOVED event), they cost at
    most one step's events. A lent snapshot is taken back only while the tracker
    still holds that very object: one the tracker replaced (its own store's) or
    dropped (a final removal) is its own business.

    Threads: vLLM's scheduler thread (the manager's `take_events`), which owns the
    tracker: `withdraw` the previous step's loans, then `lend` this step's, before
    the tracker translates the events (OffloadingConnectorScheduler.take_events
    drains the manager, then translates).
    """

    def __init__(self, tracker: OffloadingEventsTracker) -> None:
        self._tracker = tracker
        self._lent: list[tuple[bytes, _OffloadEventMetadata]] = []

    def lend(self, events: Mapping[bytes, tuple[bytes, bool]]) -> int:
        """Puts each key's chunk event (`events`: key -> (ChunkEvent bytes, in the
        pool)) into the tracker unless it has the key already (its own snapshot,
        taken from the Request, stays); returns how many it lent. A chunk event that
        does not parse is skipped: the tracker then publishes vLLM's placeholder for
        it, as before."""
        table = self._tracker._pending_event_metadata
        lent = self._lent
        taken = 0
        for key, (data, on_pool) in events.items():
            if (own := table.get(key)) is not None:
                if on_pool:
                    own.active_residencies.add(_POOL_RESIDENCY)
                continue
            try:
                meta = decode(data, on_pool)
            except Exception:  # a bad event costs its completeness, nothing more
                continue
            table[key] = meta
            lent.append((key, meta))
            taken += 1
        return taken

    def withdraw(self) -> int:
        """Takes back the snapshots lent at the last step that the tracker still
        holds as lent; returns how many."""
        if not self._lent:
            return 0
        table = self._tracker._pending_event_metadata
        taken_back = 0
        for key, meta in self._lent:
            if table.get(key) is meta:
                del table[key]
                taken_back += 1
        self._lent = []
        return taken_back
