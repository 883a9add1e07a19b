"""The tiers below the pool as the services see them: a facet of `DepotState`.

`TiersBelow` holds the tiers below the pool once the daemon attaches them (the
disk, kvdepot.server.disk.link.DiskLink; the fleet's, kvdepot.server.remote.link.
RemoteLink; the daemon starts and closes both): each hears every index event;
Prefetch asks them in order (the disk, then the fleet: `TierBelow`,
kvdepot.server.core.prefix_fetch) which of a request's keys missing in RAM they
hold and fetches the leading run, never a key behind a hole; their figures join
GetStats. Without either, Prefetch still checks the call and fetches nothing. The
services never hold the links (tests/test_service_facade.py).

Owned by `DepotState`, which offers these calls as its own (kvdepot.server.state.facade);
everything runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.prefix_fetch import KeyState, TierBelow, leading_run
from kvdepot.server.state.events import EventBus
from kvdepot.server.state.key_calls import KeyCalls
from kvdepot.server.state.namespaces import NamespaceAccess

if TYPE_CHECKING:  # the tiers' extras (redis, blake3) may be missing
    from kvdepot.server.disk.link import DiskLink
    from kvdepot.server.remote.link import RemoteLink


class TiersBelow:
    """The attached tiers below the pool (disk, fleet), if any, and the calls that go
    to them."""

    def __init__(
        self, index: BlockIndex, bus: EventBus, access: NamespaceAccess, keys: KeyCalls
    ) -> None:
        self.index = index
        self.bus = bus
        self.access = access
        self.keys = keys
        self.link: RemoteLink | None = None
        self.disk: DiskLink | None = None

    def attach_remote_tier(self, link: RemoteLink) -> None:
        """The tier below the pool (kvdepot.server.remote; the daemon starts and
        closes it): it hears every index event, answers Prefetch, and its figures
        join GetStats."""
        self.link = link
        self.bus.add_listener(link.on_event)

    def attach_disk_tier(self, disk: DiskLink) -> None:
        """The disk tier below the pool (kvdepot.server.disk; the daemon starts and
        closes it): it hears every index event, its own events (tier DISK) reach the
        Watch streams, Prefetch asks it first, and its figures join GetStats."""
        self.disk = disk
        self.bus.add_listener(disk.on_event)
        self.keys.touch_listeners.append(disk.touch)  # the disk keeps the pool's order
        self.keys.chunk_event_sources.append(disk.chunk_events)  # records' router metadata
        disk.announce = self.bus.publish_to_watchers  # the disk's own events: Watch only
        self.bus.add_greeting(disk.on_watch)  # a new Watch stream hears what is on disk

    @property
    def has_tier_below(self) -> bool:
        """A tier below the pool (the disk or the fleet's): SessionHello.remote_tier,
        so that the connector asks Prefetch for what RAM misses."""
        return self.link is not None or self.disk is not None

    @property
    def tiers_healthy(self) -> bool:
        return (self.link is not None and self.link.health.up) or (
            self.disk is not None and self.disk.healthy
        )

    def tier_stats(self) -> dict[str, object]:
        """The tiers' GetStats fields; none without them."""
        out = self.link.stats_fields() if self.link is not None else {}
        if self.disk is not None:
            out.update(self.disk.stats_fields())
        return out

    @property
    def below(self) -> list[TierBelow]:
        """The tiers below the pool, nearest first: the disk, then the fleet's."""
        return [tier for tier in (self.disk, self.link) if tier is not None]

    async def prefetch(
        self, session_id: str, namespace_id: str, keys: Sequence[bytes]
    ) -> list[KeyState] | None:
        """Depot/Prefetch: `keys` are one request's, in the order its lookups asked for
        them. Fetches into the pool, from the tiers below, the leading run of each
        group that the pool or a tier holds, never a key after one nothing holds
        (kvdepot.server.core.prefix_fetch), and says, per key, where it is. None when
        the daemon has no tier below the pool (the keys are checked; nothing is
        fetched)."""
        self.access.member(session_id, namespace_id)
        self.keys.check_batch(keys)  # before the keys are copied
        keys = list(keys)
        ns = self.index.namespace(namespace_id)
        groups = [ns.layout.key_group(key) for key in keys]  # LayoutError: INVALID_ARGUMENT
        below = self.below
        if not below:
            return None
        slots = ns.slots
        states = [KeyState.LOCAL if key in slots else KeyState.ABSENT for key in keys]
        holder: list[TierBelow | None] = [None] * len(keys)
        for tier in below:
            ask = [
                i
                for i, state in enumerate(states)
                if state is KeyState.ABSENT and holder[i] is None
            ]
            if not ask:
                break
            found = await tier.locate(namespace_id, [keys[i] for i in ask])
            for i, has in zip(ask, found, strict=True):
                if has:
                    holder[i] = tier
        held = [
            state is KeyState.LOCAL or tier is not None
            for state, tier in zip(states, holder, strict=True)
        ]
        run = leading_run(groups, held)
        for tier in below:
            mine = [i for i in range(len(keys)) if run[i] and holder[i] is tier]
            if not mine:
                continue
            under_way = tier.fetch(namespace_id, [keys[i] for i in mine])
            for i, ok in zip(mine, under_way, strict=True):
                if ok:  # where from: vLLM's cache-hit source of the load that follows
                    states[i] = KeyState.FETCHING_DISK if tier is self.disk else KeyState.FETCHING
        return states
