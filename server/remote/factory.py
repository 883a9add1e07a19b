"""The fleet's tier factory: `kvdepot serve --remote URL` read into a started
`RemoteLink` (its line in the daemon's registry, kvdepot.server.tier_registry, names
this module).

The fleet key is read first, once, before any tier opens (`read_fleet`, which the
registry calls): the disk keeps the fleet's rows only under the key ids held now.
Importable without the `remote` extra (redis-py, blake3): the link is imported only
when `--remote` asks for it, and its absence is a start-up error that says what to
install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.core.index import BlockIndex
from kvdepot.server.core.tier import Tier, TierStartError
from kvdepot.server.memory.arena import Arena

if TYPE_CHECKING:
    from kvdepot.server.remote.codec import Codec
    from kvdepot.server.remote.link import RemoteSettings


class RemoteTierError(TierStartError):
    """--remote cannot be used (redis-py missing, password file unreadable, no usable
    fleet key)."""


class RemoteConfig(Protocol):
    """The daemon's settings this tier reads (kvdepot.server.config.ServeConfig)."""

    @property
    def remote(self) -> str | None: ...
    @property
    def remote_ttl(self) -> int: ...
    @property
    def remote_write(self) -> str: ...
    @property
    def remote_max_inflight_bytes(self) -> int: ...
    @property
    def remote_password_file(self) -> str | None: ...
    @property
    def remote_ca_file(self) -> str | None: ...
    @property
    def remote_key_file(self) -> str | None: ...
    @property
    def remote_insecure(self) -> bool: ...


class Fleet(NamedTuple):
    """`--remote`'s settings and the fleet's codec (its key file read once)."""

    settings: RemoteSettings
    codec: Codec

    @property
    def held_ids(self) -> frozenset[bytes]:
        """The fleet key ids this node holds (the disk's records of rows another key
        admitted are dropped)."""
        return self.codec.held_ids


def read_fleet(cfg: RemoteConfig) -> Fleet | None:
    """`--remote`'s settings and the fleet's codec (its key file read once, here);
    None without --remote."""
    if not cfg.remote:
        return None
    try:
        from kvdepot.server.remote.fleet_key import KeyFileError
        from kvdepot.server.remote.link import RemoteSettings, fleet_codec
    except ImportError as exc:  # redis-py and blake3 are the `remote` extra
        raise RemoteTierError(
            f"--remote needs redis-py and blake3 ({exc}): pip install 'kvdepot[remote]'"
        ) from None
    settings = RemoteSettings(
        url=cfg.remote,
        ttl_s=cfg.remote_ttl or None,
        write_mode=cfg.remote_write,
        max_inflight_bytes=cfg.remote_max_inflight_bytes,
        password_file=cfg.remote_password_file,
        ca_file=cfg.remote_ca_file,
        key_file=cfg.remote_key_file,
        insecure=cfg.remote_insecure,
    )
    try:
        return Fleet(settings, fleet_codec(settings))
    except KeyFileError as exc:  # no fleet key, or one others could read
        raise RemoteTierError(str(exc)) from None


class RemoteSite(Protocol):
    """What the registry hands the factory (kvdepot.server.tier_registry.TierSite)."""

    @property
    def fleet(self) -> Fleet | None: ...
    @property
    def index(self) -> BlockIndex: ...
    @property
    def arena(self) -> Arena: ...
    @property
    def copy_queue(self) -> CopyQueue: ...


def build(site: RemoteSite) -> Tier | None:
    """The remote tier (`--remote`), started (its workers and its first contact with
    the store, in the background); None without --remote. On the event loop."""
    if site.fleet is None:
        return None
    from kvdepot.server.remote.link import RemoteLink

    settings, codec = site.fleet
    try:
        link = RemoteLink.from_settings(settings, site.index, site.arena, site.copy_queue, codec)
    except OSError as exc:
        raise RemoteTierError(f"--remote-password-file: {exc}") from None
    link.start()
    return link
