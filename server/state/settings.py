"""The settings the state reads, as a protocol: the state takes values, not the
daemon's settings table.

`kvdepot serve`'s `ServeConfig` (server/config/) has every field below, so the
daemon passes it as it is; tests and tools may pass any object with these
attributes. server/config/ sits beside this layer, not below it: the state never
imports it (docs/architecture.md §2; tests/test_layering.py).
"""

from __future__ import annotations

from typing import Protocol

from kvdepot.server.core.shares import NamespaceShares


class StateConfig(Protocol):
    # The pool (DepotState.create).
    pool_size: int
    pool_file: str | None
    slot_granularity: int
    reservation_timeout: float
    eviction_policy: str  # --eviction-policy: lru or arc (kvdepot.server.core.eviction)
    copy_threads: int
    gpu_copy_threads: int  # each GPU's own copy threads (kvdepot.server.copy_queue.CopyQueues)
    numa: str  # --numa: where the pool and the copy threads go (server/memory/numa.py)
    # Sessions and what one may hold (Sessions, NamespaceAccess).
    max_sessions: int
    max_sessions_per_pid: int
    max_sessions_per_uid: int
    max_unattested_sessions: int
    max_registrations_per_session: int
    max_watches_per_session: int
    max_pinned_per_session: str  # a size or a share of the pool (server/sizes.py)
    max_writing_per_session: str
    max_pool_held: str  # every session together, pinned and (apart) writing
    fd_reserve: int
    # Jobs and calls.
    max_job_keys: int
    max_job_blocks: int
    max_job_pages: int
    max_batch_keys: int
    max_calls_per_pid: int  # Depot calls in flight per account (Sessions.open_call)
    max_calls_per_uid: int  # 0: a quarter of the server's concurrent-call limit
    namespace_share: NamespaceShares  # --namespace-share (kvdepot.server.core.shares)
    destructive_admin: bool
    # Read by the Depot service through the state (SessionHello, the Session stream).
    keepalive_seconds: float
    # Which shard of how many this daemon is (SessionHello, GetStats; server/shards.py).
    shard: int
    shards: int

    @property
    def fd_socket(self) -> str: ...
