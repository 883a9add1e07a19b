"""The tier seam: what a tier below the pool offers the daemon, and what the daemon
offers it back (docs/architecture.md §2, "Tiers below the pool").

The state holds an ordered list of `Tier`s, nearest first (the disk, then the
fleet's), built by the daemon from a registry by name (kvdepot.server.tier_registry):
each hears the pool's events, Prefetch walks them in order (a `TierBelow`,
kvdepot.server.core.prefix_fetch), their figures join GetStats and Prometheus, the
daemon's health is theirs, and the daemon closes them, farthest first, before it
unmaps the pool. A new tier is a package with a `Tier` and its factory, and one line
in the registry.

Threads: every call here is made on the daemon's event loop. A tier's own threads
(its I/O) hand their results back to the loop; `close` waits for them.

Ownership: the tier owns its I/O, its files or connections, and the pool rows it
claims (through the index it was built with) until they are READY or dropped; the
state owns the list, the event bus, the Watch streams and every call from the
services (which never hold a tier: tests/test_service_facade.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.prefix_fetch import KeyState, TierBelow

if TYPE_CHECKING:  # the daemon's dependency; a tier's collector is built only with metrics
    from prometheus_client.registry import Collector


class TierStartError(RuntimeError):
    """A tier cannot start (its extra missing, its files someone else's, its key
    refused). The message is one line that says what to change; the daemon logs it
    and exits 2."""


class ChunkEventSource(Protocol):
    """Chunk events (kvdepot.v1.ChunkEvent, as bytes) a tier keeps for rows the pool
    may no longer hold (the disk's records): Watch and the KV-event stream read them
    where the pool's row has none."""

    @property
    def chunk_event_rows(self) -> int:
        """Rows with an event held (counted into GetStats' chunk_event_rows)."""
        ...

    @property
    def chunk_event_bytes(self) -> int:
        """Their events' bytes (counted into GetStats' chunk_event_bytes)."""
        ...

    def chunk_events(self, namespace_id: str, keys: Sequence[bytes]) -> list[bytes]:
        """Per key, its chunk event, b"" where none is held."""
        ...


class TierHost(Protocol):
    """What the state offers a tier at `Tier.attach`, beside the events every tier
    hears: the ways a tier may speak to the pool's clients. A tier uses what it needs
    (the fleet's uses none)."""

    def publish_to_watchers(self, event: IndexEvent) -> None:
        """The tier's own event (a row of its tier stored or removed) to the Watch
        streams of the event's namespace, not to the pool's listeners."""
        ...

    def add_greeting(self, greeting: Callable[[str], list[IndexEvent]]) -> None:
        """`greeting(namespace_id)`: what a new Watch stream is told the tier holds,
        queued after the pool's snapshot."""
        ...

    def add_chunk_event_source(self, source: ChunkEventSource) -> None:
        """Chunk events the tier keeps beyond the pool's rows."""
        ...


class Tier(TierBelow, Protocol):
    """A tier below the pool, from attach to close (the module docstring says who calls
    what, on which thread, and who owns what). Prefetch's `locate` and `fetch` are
    `TierBelow`'s."""

    name: str  # the registry's name ("disk", "fleet"): logs and tests
    # What Prefetch answers for a key this tier fetches: FETCHING, or FETCHING_DISK for
    # a node-local disk (vLLM's cache-hit source of the load that follows).
    fetched: KeyState

    def start(self) -> None:
        """Opens the tier's I/O (its threads, files, connections), on the event loop,
        before it is attached; raises TierStartError (or the tier's own start-up
        errors, which its factory names) when it cannot serve at all. A tier that
        starts but finds its store down serves nothing until it comes back."""
        ...

    def attach(self, host: TierHost) -> None:
        """Wires the tier's own voice into the state (the host's calls); the state
        calls it once, when it adds the tier to its list."""
        ...

    def on_event(self, event: IndexEvent) -> None:
        """Every event of the pool's index (rows stored, removed, evicted), while the
        index is being changed: note it, never call back into the index (the event
        bus's listener contract, kvdepot.server.state.events)."""
        ...

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        """Keys a finished request used again (group-major, chunks ascending), after
        the pool made its rows the most recent, the head youngest: a tier that keeps
        an order of its own follows the pool's, so that, full, it evicts a prompt's
        tail before its head and never keeps a row behind one it dropped. That holds
        for rows it is still writing when the touch comes, too: it applies the touch
        again once they are written (`TouchesAfterWrites`,
        kvdepot.server.core.touch_order)."""
        ...

    @property
    def healthy(self) -> bool:
        """Whether the tier answers now (GetStats' and Prefetch's remote_healthy: any
        tier up)."""
        ...

    def stats_fields(self) -> dict[str, object]:
        """The tier's GetStatsResponse fields (admin.proto), read by GetStats and
        `kvdepot status`; the dict is the caller's."""
        ...

    def collector(self) -> Collector:
        """The tier's Prometheus series (read at scrape time), when the daemon serves
        metrics."""
        ...

    async def close(self) -> None:
        """Ends the tier's I/O and waits for its threads: after it, nothing of the tier
        touches the pool's memory (the daemon unmaps it next)."""
        ...
