"""The disk tier's factory: `kvdepot serve --disk DIR` read into a started `DiskLink`
(its line in the daemon's registry, kvdepot.server.tier_registry, names this module).

Importable without the `disk` extra (blake3): the link is imported only when `--disk`
asks for it, and its absence is a start-up error that says what to install.
"""

from __future__ import annotations

from typing import Protocol

from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.tier import Tier, TierStartError
from kvdepot.server.memory import private_files
from kvdepot.server.memory.arena import Arena


class DiskTierError(TierStartError):
    """--disk cannot be used (blake3 missing, someone else's directory or file, another
    daemon's disk tier)."""


class DiskConfig(Protocol):
    """The daemon's settings this tier reads (kvdepot.server.config.ServeConfig)."""

    @property
    def disk(self) -> str | None: ...
    @property
    def disk_size(self) -> int: ...
    @property
    def disk_write(self) -> str: ...
    @property
    def disk_write_priority(self) -> str: ...


class DiskSite(Protocol):
    """What the registry hands the factory (kvdepot.server.tier_registry.TierSite)."""

    @property
    def config(self) -> DiskConfig: ...
    @property
    def index(self) -> BlockIndex: ...
    @property
    def arena(self) -> Arena: ...
    @property
    def held_fleet_keys(self) -> frozenset[bytes]:
        """The fleet key ids of this run: records of rows another key admitted are
        dropped (none without --remote)."""
        ...


def build(site: DiskSite) -> Tier | None:
    """The disk tier (`--disk`), opened at once (its index comes back in the
    background); None without --disk. On the event loop."""
    cfg = site.config
    if not cfg.disk:
        return None
    try:
        from kvdepot.server.disk.files import TierBusy
        from kvdepot.server.disk.link import DiskLink, DiskSettings
    except ImportError as exc:  # blake3 is the `disk` extra
        if exc.name != "blake3":  # a broken install, not a missing extra: say so as it is
            raise
        raise DiskTierError(f"--disk needs blake3 ({exc}): pip install 'kvdepot[disk]'") from None
    link = DiskLink.from_settings(
        DiskSettings(
            cfg.disk,
            cfg.disk_size,
            write_mode=cfg.disk_write,
            background_writes=cfg.disk_write_priority == "low",
            held_fleet_keys=site.held_fleet_keys,
        ),
        site.index,
        site.arena,
    )
    try:
        link.start()
    except (private_files.UnsafeFileError, TierBusy) as exc:
        raise DiskTierError(f"--disk {cfg.disk}: {exc}") from None
    return link
