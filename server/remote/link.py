"""`RemoteLink`: the remote tier attached to one daemon.

It owns the tier client, the write-behind (kvdepot.server.remote.writer), the
fetcher (kvdepot.server.remote.reader), their health and counters, and plugs
into the daemon as a `Tier` (kvdepot.server.core.tier), built from the daemon's
registry (kvdepot.server.remote.factory): the event bus listener and the index and
arena APIs. The Depot/Prefetch RPC, Admin/GetStats and the Prometheus collector
read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex, IndexEvent
from kvdepot.server.core.prefix_fetch import KeyState
from kvdepot.server.core.tier import TierHost
from kvdepot.server.memory.arena import Arena
from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.fleet_key import KeyFileError, load_key_file
from kvdepot.server.remote.health import remote_health
from kvdepot.server.remote.reader import Fetcher
from kvdepot.server.remote.stats import RemoteStats
from kvdepot.server.remote.tier import RemoteTier, TierUnavailable

if TYPE_CHECKING:  # prometheus_client: imported with the collector, when metrics are on
    from prometheus_client.registry import Collector

log = logging.getLogger("kvdepot.remote")

PASSWORD_ENV = "KVDEPOT_REMOTE_PASSWORD"
PROBE_KEY = b"kvd1:probe"
PROBE_INTERVAL_S = 0.25
CONNECT_DEADLINE_S = 5.0  # the first contact, at start (a write call's deadline)


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    ttl_s: int | None = 86400
    write_mode: str = "ready"  # "ready" | "evict"
    max_inflight_bytes: int = 256 << 20
    password_file: str | None = None
    ca_file: str | None = None
    key_file: str | None = None  # the fleet key (kvdepot.server.remote.fleet_key)
    insecure: bool = False  # no key: format 1, CRC only (--remote-insecure)


def fleet_codec(settings: RemoteSettings) -> Codec:
    """The codec of this node's fleet: keyed with the key file's keys, or CRC-only
    when the operator said --remote-insecure. KeyFileError (one line) otherwise."""
    if settings.key_file:
        return Codec(load_key_file(settings.key_file))
    if settings.insecure:
        return Codec(None)
    raise KeyFileError(
        "--remote needs --remote-key-file PATH (KVDEPOT_REMOTE_KEY_FILE): without the fleet "
        "key, anyone who can write to the store could plant rows this node loads; "
        "--remote-insecure runs without it"
    )


def read_password(password_file: str | None) -> str | None:
    """KVDEPOT_REMOTE_PASSWORD, else the first line of `password_file`, else None."""
    env = os.environ.get(PASSWORD_ENV, "")
    if env:
        return env
    if password_file:
        return (
            Path(password_file).read_text().splitlines()[0].strip()
            if Path(password_file).stat().st_size
            else ""
        )
    return None


class RemoteLink:
    """The fleet's tier below the pool (a `Tier`, kvdepot.server.core.tier), asked
    after the disk."""

    name = "fleet"
    fetched = KeyState.FETCHING

    def __init__(
        self,
        tier: RemoteTier,
        index: BlockIndex,
        arena: Arena,
        copy_queue: CopyQueue,
        settings: RemoteSettings,
        codec: Codec,
    ) -> None:
        from kvdepot.server.remote.writer import WriteBehind

        self.tier = tier
        self.settings = settings
        self.codec = codec
        self.health = remote_health(tier.description)
        self.stats = RemoteStats()
        self.writer = WriteBehind(
            tier,
            index,
            arena,
            copy_queue,
            self.health,
            self.stats,
            codec,
            mode=settings.write_mode,
            ttl_s=settings.ttl_s,
            max_inflight_bytes=settings.max_inflight_bytes,
        )
        self.fetcher = Fetcher(
            tier,
            index,
            arena,
            copy_queue,
            self.health,
            self.stats,
            self.writer,
            codec,
            max_inflight_bytes=settings.max_inflight_bytes,
        )
        self._probe_task: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(
        cls,
        settings: RemoteSettings,
        index: BlockIndex,
        arena: Arena,
        copy_queue: CopyQueue,
        codec: Codec | None = None,
    ) -> RemoteLink:
        """`codec`: the fleet's, when the caller read the key file already."""
        from kvdepot.server.remote.redis_tier import RedisTier

        if codec is None:
            codec = fleet_codec(settings)  # first: a refused key file connects nothing
        tier = RedisTier(
            settings.url,
            password=read_password(settings.password_file),
            ca_file=settings.ca_file,
        )
        return cls(tier, index, arena, copy_queue, settings, codec)

    def start(self) -> None:
        """Starts the workers (on the event loop). Subscribe `on_event` to the bus."""
        self.writer.start()
        self.fetcher.start()
        self._probe_task = asyncio.create_task(self._probe())
        ttl = f"{self.settings.ttl_s} s" if self.settings.ttl_s else "no expiry"
        log.info(
            "remote tier %s: writing rows when %s, TTL %s, at most %d MiB in flight",
            self.tier.description,
            "they become ready" if self.settings.write_mode == "ready" else "LRU evicts them",
            ttl,
            self.settings.max_inflight_bytes >> 20,
        )
        ring = self.codec.keyring
        if ring is None:
            log.warning(
                "remote tier without a fleet key (--remote-insecure): rows are checked with a "
                "CRC only, so anyone who can write to %s can plant rows this node loads",
                self.tier.description,
            )
        else:  # key ids, never keys: they tell which nodes share a key, and a rotation
            log.info(
                "remote tier rows carry a keyed BLAKE3 MAC: writing with fleet key id %s%s",
                ring.current.id.hex(),
                f", also reading key id {ring.previous.id.hex()}" if ring.previous else "",
            )

    async def _probe(self) -> None:
        """Connects at once, then, while the tier is down, asks it (one EXISTS)
        whenever a probe is due, so it comes back even when no write or fetch
        happens to try it.

        Connecting first, under a deadline of its own: otherwise the first Prefetch
        paid for it within its 250 ms (a cluster's discovery takes longer than that on
        a loaded machine), answered ABSENT for rows the tier had and counted an outage."""
        await self._ask(time.monotonic() + CONNECT_DEADLINE_S)
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if self.health.up or not self.health.usable():
                continue
            await self._ask(time.monotonic() + 1.0)

    async def _ask(self, deadline: float) -> None:
        try:
            await self.tier.exists_many([PROBE_KEY], deadline)
        except TierUnavailable as exc:
            self.health.failed(str(exc))
        else:
            self.health.succeeded()

    def attach(self, host: TierHost) -> None:
        """Nothing beyond the events every tier hears: the fleet's rows are announced
        when they enter the pool."""

    def on_event(self, event: IndexEvent) -> None:
        self.writer.on_event(event)

    def touch(self, namespace_id: str, keys: Sequence[bytes]) -> None:
        """The store keeps no order of ours (its rows expire by TTL)."""

    @property
    def healthy(self) -> bool:
        return self.health.up

    def collector(self) -> Collector:
        from kvdepot.server.remote.metrics import RemoteCollector

        return RemoteCollector(self)

    async def locate(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        """A tier below the pool (kvdepot.server.core.prefix_fetch): Fetcher.locate."""
        return await self.fetcher.locate(namespace_id, keys)

    def fetch(self, namespace_id: str, keys: Sequence[bytes]) -> list[bool]:
        return self.fetcher.fetch(namespace_id, keys)

    def stats_fields(self) -> dict[str, object]:
        return self.stats.fields(
            enabled=True,
            healthy=self.health.up,
            inflight_bytes=self.writer.pending_bytes + self.fetcher.pending_bytes,
        )

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        await self.writer.close()
        await self.fetcher.close()
        await self.tier.close()
