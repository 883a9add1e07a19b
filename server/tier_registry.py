"""The tiers below the pool, by name: the daemon's registry of `Tier` factories
(kvdepot.server.core.tier), nearest first, the order Prefetch asks them in.

Each line names a tier and the module of its factory, a function `build(site)` that
reads the tier's own settings off `site.config` and returns the tier started, None
when its settings leave it off, or raises TierStartError (one line: the daemon exits
2). Modules are imported by name, so a tier whose extra is missing costs nothing
until its setting asks for it. A new tier is a package with its `Tier` and factory,
and one line here (docs/architecture.md §2, "Tiers below the pool").

Called on the event loop, once, at start (`start_tiers`); the daemon closes the tiers,
farthest first, before it unmaps the pool.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvdepot.server.config import ServeConfig
from kvdepot.server.core.tier import Tier
from kvdepot.server.state import DepotState

if TYPE_CHECKING:
    from kvdepot.server.copy_queue import CopyQueue
    from kvdepot.server.core.index import BlockIndex
    from kvdepot.server.memory.arena import Arena
    from kvdepot.server.remote.factory import Fleet

# name, factory module: nearest first.
TIERS: tuple[tuple[str, str], ...] = (
    ("disk", "kvdepot.server.disk.factory"),
    ("fleet", "kvdepot.server.remote.factory"),
)


@dataclass(frozen=True)
class TierSite:
    """What every factory is handed: the daemon's settings, the pool's parts a tier
    works on, and the fleet key read before any tier opens."""

    config: ServeConfig
    index: BlockIndex
    arena: Arena
    copy_queue: CopyQueue
    fleet: Fleet | None  # --remote's settings and codec (kvdepot.server.remote.factory)

    @property
    def held_fleet_keys(self) -> frozenset[bytes]:
        """The fleet key ids of this run; none without --remote."""
        return self.fleet.held_ids if self.fleet is not None else frozenset()


class TierFactory(Protocol):
    def __call__(self, site: TierSite) -> Tier | None: ...


def start_tiers(
    config: ServeConfig, state: DepotState, tiers: Sequence[tuple[str, str]] = TIERS
) -> list[Tier]:
    """Builds and starts the tiers `config` asks for, in `tiers`' order, and attaches
    each to `state` below those before it; returns them, nearest first."""
    from kvdepot.server.remote.factory import read_fleet

    # The fleet key first: the disk keeps the fleet's rows only under keys held now.
    site = TierSite(config, state.index, state.arena, state.copy_queue, read_fleet(config))
    started: list[Tier] = []
    for _name, module in tiers:
        build: TierFactory = importlib.import_module(module).build
        tier = build(site)
        if tier is not None:
            state.attach_tier(tier)  # Prefetch, GetStats, and every index event
            started.append(tier)
    return started
