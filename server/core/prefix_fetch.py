"""Prefetch fetches a prefix, never a hole: which of a request's keys the tiers below
the pool bring into it, and the interface those tiers offer for it.

A lookup walks a request's chunks from the first and stops at the first miss, so a
row fetched into the pool behind a key that no tier holds can never be hit: it only
takes room. A Prefetch therefore names one request's keys in the order its lookups
asked for them (group-major; keys the pool holds may be left out), every tier below
the pool says which of them it holds (`TierBelow.locate`), and only the leading run
of each group that the pool or some tier holds is fetched (`leading_run`), each tier
fetching its own keys of it (`TierBelow.fetch`). The keys after the first one that
nothing holds are answered ABSENT: the engine recomputes them.

Sans-I/O: the state walks its ordered list of tiers (kvdepot.server.state.tiers); the
tiers (kvdepot.server.disk.link, kvdepot.server.remote.link) do the I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class KeyState(enum.IntEnum):
    """Per-key answer of a prefetch (the wire values of PrefetchResponse)."""

    LOCAL = 1  # in the pool already (ready or being written)
    FETCHING = 2  # a tier has it: it becomes READY shortly (or is given up)
    ABSENT = 3  # neither here nor in a tier (or behind such a key, or no tier answering)
    # FETCHING, from the disk tier (kvdepot.server.disk): on the wire FETCHING, with
    # PrefetchResponse.from_disk (vLLM's cache-hit source of the load that follows).
    FETCHING_DISK = 4


class TierBelow(Protocol):
    """A tier below the pool as Prefetch walks them, nearest first (the disk, then the
    fleet). Both calls run on the daemon's event loop, one `locate` then one `fetch`
    per Prefetch, with nothing of the loop between them but `locate`'s own waits; the
    tier owns its I/O and the rows it claims in the pool until they are READY."""

    async def locate(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key (each checked, missing from the pool when asked): whether this tier
        holds it as a row of the namespace's layout, or is fetching it already. Waits
        at most the tier's own short deadline; a tier down holds nothing. Claims and
        fetches nothing."""
        ...

    def fetch(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Starts bringing `keys` (some of those `locate` just found, a leading run of
        a request in its order) into the pool: each becomes READY and is announced on
        Watch shortly, admitted tail first as far as the tier can (the pool's order,
        kvdepot.server.core.eviction.tail_first). Per key: True when under way (or
        already in the pool), False when it will not come (no room, gone since)."""
        ...


def leading_run(groups: Sequence[int], held: Sequence[bool]) -> list[bool]:
    """Per key, whether it lies in its group's leading run of held keys: `groups[i]` is
    key i's group, `held[i]` whether the pool or a tier holds it; a group's keys after
    its first key not held are left out (no lookup reaches them)."""
    out: list[bool] = []
    broken: set[int] = set()
    for group, has in zip(groups, held, strict=True):
        if not has:
            broken.add(group)
        out.append(has and group not in broken)
    return out
