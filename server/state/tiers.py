"""The tiers below the pool as the services see them: a facet of `DepotState`.

`TiersBelow` holds the tiers below the pool once the daemon attaches them, an
ordered list of `Tier`s (kvdepot.server.core.tier), nearest first: the daemon builds
them from its registry (kvdepot.server.tier_registry: the disk, then the fleet's),
starts and closes them. Each hears every index event and every touch; Prefetch asks
them in order which of a request's keys missing in RAM they hold and fetches the
leading run, never a key behind a hole (`TierBelow`, kvdepot.server.core.prefix_fetch);
their figures join GetStats. With none, Prefetch still checks the call and fetches
nothing. The services never hold a tier (tests/test_service_facade.py).

Owned by `DepotState`, which offers these calls as its own (a method per call);
everything runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.prefix_fetch import KeyState, leading_run
from kvdepot.server.core.tier import ChunkEventSource, Tier
from kvdepot.server.state.events import EventBus
from kvdepot.server.state.key_calls import KeyCalls
from kvdepot.server.state.namespaces import NamespaceAccess


class TiersBelow:
    """The attached tiers below the pool, nearest first, and the calls that go to them.
    It is the tiers' `TierHost` (kvdepot.server.core.tier) too."""

    def __init__(
        self, index: BlockIndex, bus: EventBus, access: NamespaceAccess, keys: KeyCalls
    ) -> None:
        self.index = index
        self.bus = bus
        self.access = access
        self.keys = keys
        self.below: list[Tier] = []  # nearest first: the order Prefetch asks them in
        self.chunk_event_sources: list[ChunkEventSource] = []

    def attach_tier(self, tier: Tier) -> None:
        """Adds `tier` below those attached before it (the daemon attaches them in the
        registry's order, kvdepot.server.tier_registry; it starts and closes them):
        it hears every index event and every touch, Prefetch asks it after those above
        it, its figures join GetStats, and it wires what else it says (`Tier.attach`)."""
        self.below.append(tier)
        self.bus.add_listener(tier.on_event)
        self.keys.touch_listeners.append(tier.touch)
        tier.attach(self)

    # -- TierHost (kvdepot.server.core.tier) ----------------------------------------------

    def publish_to_watchers(self, event: IndexEvent) -> None:
        self.bus.publish_to_watchers(event)

    def add_greeting(self, greeting: Callable[[str], list[IndexEvent]]) -> None:
        self.bus.add_greeting(greeting)

    def add_chunk_event_source(self, source: ChunkEventSource) -> None:
        self.chunk_event_sources.append(source)
        self.keys.chunk_event_sources.append(source.chunk_events)

    # -- the services' calls ----------------------------------------------------------------

    @property
    def has_tier_below(self) -> bool:
        """A tier below the pool (the disk or the fleet's): SessionHello.remote_tier,
        so that the connector asks Prefetch for what RAM misses."""
        return bool(self.below)

    @property
    def tiers_healthy(self) -> bool:
        return any(tier.healthy for tier in self.below)

    def tier_stats(self) -> dict[str, object]:
        """The tiers' GetStats fields; none without them."""
        out: dict[str, object] = {}
        for tier in reversed(self.below):  # the nearest's last (its fields win)
            out.update(tier.stats_fields())
        return out

    def chunk_event_totals(self) -> tuple[int, int]:
        """Rows and bytes of the chunk events the tiers keep beyond the pool's rows."""
        sources = self.chunk_event_sources
        return (
            sum(s.chunk_event_rows for s in sources),
            sum(s.chunk_event_bytes for s in sources),
        )

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
        holder: list[Tier | None] = [None] * len(keys)
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
                    states[i] = tier.fetched
        return states
