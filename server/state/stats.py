"""The figures Admin/GetStats and the Prometheus collector read from a DepotState.

`stats_fields(state)` gathers the pool's, the index's, the sessions' and the
traffic counters' figures into one dict keyed by GetStatsResponse's field names
(admin.proto says what each one means). Called on the event loop, which owns
everything it reads, so the figures are one consistent snapshot; the dict is the
caller's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvdepot
from kvdepot.common.kinds import MemoryPath
from kvdepot.server.memory.numa import format_cpulist

if TYPE_CHECKING:
    from kvdepot.server.state.depot import DepotState


def stats_fields(state: DepotState) -> dict[str, object]:
    """GetStatsResponse's fields of the pool, index, sessions and traffic."""
    counts = state.index.counts()
    alloc = state.index.allocator
    ix = state.index.stats
    store, load = state.traffic.store, state.traffic.load
    chunk_event_rows, chunk_event_bytes = state.index.chunk_event_totals()
    below_rows, below_bytes = state.tiers.chunk_event_totals()  # the disk's records'
    chunk_event_rows += below_rows
    chunk_event_bytes += below_bytes
    return {
        "version": kvdepot.__version__,
        "boot_id": state.boot_id,
        "uptime_seconds": state.uptime,
        "loop_cpu_seconds": state.loop_cpu_seconds,
        "shard": state.config.shard,
        "shard_count": state.config.shards,
        "capacity_bytes": alloc.capacity,
        "used_bytes": alloc.used_bytes,
        "pinned_bytes": state.index.pinned_bytes,
        "largest_free_extent_bytes": alloc.largest_free_extent,
        "warmup_done_bytes": state.arena.warmup_done_bytes,
        "warmup_complete": state.arena.warmup_complete,
        "ready_blocks": counts["ready"],
        "writing_blocks": counts["writing"],
        "pinned_blocks": counts["pinned"],
        "sessions": len(state.sessions),
        "permission_denied": state.permission_denied,
        "registrations": len(state.registrations),
        "populating_bytes": sum(
            r.populating_bytes for reg in state.registrations.values() for r in reg.regions
        ),
        "namespaces": len(state.index.namespaces),
        "lookups": ix.lookups,
        "hits": ix.hits,
        "misses": ix.misses,
        "evictions": sum(ix.evictions.values()),
        "stores": store.jobs,
        "loads": load.jobs,
        "stored_bytes": store.bytes,
        "loaded_bytes": load.bytes,
        "dropped_stores": sum(ix.dropped_stores.values()),
        "inflight_jobs": state.traffic.inflight_jobs,
        "pool_backing": state.arena.backing,
        "warm_restarted": state.warm_restarted,
        "store_jobs": store.jobs,
        "load_jobs": load.jobs,
        "stored_blocks": store.blocks,
        "loaded_blocks": load.blocks,
        "failed_store_jobs": store.failed_jobs,
        "failed_load_jobs": load.failed_jobs,
        "pin_calls": ix.pin_calls,
        "pin_keys": ix.pin_keys,
        "pinned_keys": ix.pinned_keys,
        "touched_keys": ix.touched_keys,
        "chunk_event_rows": chunk_event_rows,
        "chunk_event_bytes": chunk_event_bytes,
        "kv_events_published": state.event_stream.published if state.event_stream else 0,
        "kv_events_dropped": state.event_stream.dropped if state.event_stream else 0,
        "recovery_blocks_total": state.recovery.total,
        "recovery_blocks_verified": state.recovery.verified,
        "recovery_blocks_rejected": state.recovery.rejected,
        "recovery_complete": state.recovery.complete,
        **_page_locking_fields(state),
        **_numa_fields(state),
        **_copy_time_fields(state),
    }


def _copy_time_fields(state: DepotState) -> dict[str, object]:
    """How loaded the copy threads are: copies started, seconds queued, seconds busy,
    the oldest copy running (server/copy_queue.CopyTimes), for the shared CPU threads
    and each GPU's own (in gpu_copy_devices' order)."""
    cpu = state.copy_queue.times()
    gpus = [q.times() for q in state.copy_queues.devices.values()]
    return {
        "copy_threads": state.copy_queue.threads,
        "copies_started": cpu.copies,
        "copy_wait_seconds": cpu.wait_seconds,
        "copy_busy_seconds": cpu.busy_seconds,
        "gpu_copies_started": [t.copies for t in gpus],
        "gpu_copy_wait_seconds": [t.wait_seconds for t in gpus],
        "gpu_copy_busy_seconds": [t.busy_seconds for t in gpus],
        "copy_longest_running_seconds": cpu.longest_running_seconds,
        "gpu_copy_longest_running_seconds": [t.longest_running_seconds for t in gpus],
    }


def _numa_fields(state: DepotState) -> dict[str, object]:
    """Where the pool and the copy threads are (--numa; server/memory/numa.py)."""
    placement, queue = state.arena.placement, state.copy_queue
    threads = placement.threads(queue.threads)
    return {
        "numa_host_nodes": placement.host_nodes,
        "numa_policy": placement.policy,
        "numa_pool_nodes": list(placement.nodes),
        "numa_basis": placement.basis,
        "numa_copy_thread_nodes": [
            t[0] if t and cpus else -1 for t, cpus in zip(threads, queue.thread_cpus, strict=True)
        ],
        "numa_copy_thread_cpus": [format_cpulist(c) if c else "" for c in queue.thread_cpus],
        "gpu_copy_devices": list(state.copy_queues.devices),
        "gpu_copy_nodes": [state.copy_queues.device_nodes[d] for d in state.copy_queues.devices],
        "gpu_copy_threads": state.copy_queues.device_threads,
    }


def _page_locking_fields(state: DepotState) -> dict[str, object]:
    """The CUDA path's page-locking figures (server/cuda/enable.py), when it serves."""
    path = state.memory_path(MemoryPath.CUDA_IPC)
    report = getattr(path, "page_locking_fields", None)
    if report is None:
        return {"page_locking": False, "page_locked_bytes": 0, "page_locking_error": ""}
    return report()
