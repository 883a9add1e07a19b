"""`kvdepot serve` settings of the fleet's tier below the pool (`--remote`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting
from kvdepot.server.sizes import parse_size


def _remote_url(text: str) -> str:
    from kvdepot.server.remote.url import parse_redis_url

    parse_redis_url(text)  # RemoteURLError is a ValueError that says what is wrong
    return text.strip()


@dataclass
class FleetSettings:
    """The fleet's tier below the pool (Redis)."""

    remote: str | None = setting(
        "--remote",
        parse=_remote_url,
        metavar="URL",
        shown="off",
        help="a shared tier below the pool: redis://HOST:PORT[,HOST:PORT...] (a Redis "
        "cluster is discovered from any seed; a standalone server works too; rediss:// for "
        "TLS). The password comes from KVDEPOT_REMOTE_PASSWORD or --remote-password-file, "
        "never from the URL",
    )
    remote_ttl: int = setting(
        "--remote-ttl",
        86400,
        parse=parsers.whole_number(0),
        metavar="SECONDS",
        help="time to live of rows written to the remote tier (0: no expiry)",
    )
    remote_write: str = setting(
        "--remote-write",
        "ready",
        parse=parsers.one_of("ready", "evict"),
        help="write a row to the remote tier when it becomes ready, or only when LRU evicts it",
    )
    remote_max_inflight_bytes: int = setting(
        "--remote-max-inflight-bytes",
        256 << 20,
        parse=parse_size,
        shown="256MiB",
        metavar="SIZE",
        help="bytes queued or in flight to the remote tier (each way); past it, writes are "
        "dropped and counted",
    )
    remote_password_file: str | None = setting(
        "--remote-password-file",
        metavar="PATH",
        help="file whose first line is the remote tier's password (KVDEPOT_REMOTE_PASSWORD wins)",
    )
    remote_ca_file: str | None = setting(
        "--remote-ca-file",
        metavar="PATH",
        shown="the system's CAs",
        help="CA certificates for rediss:// (PEM)",
    )
    remote_key_file: str | None = setting(
        "--remote-key-file",
        metavar="PATH",
        shown="none: --remote refuses to start without it",
        help="the fleet key: rows written to the remote tier carry a MAC under it and only "
        "rows that verify are loaded. First line: the current key (32+ characters, e.g. "
        "`openssl rand -hex 32`); an optional second line: the previous key, still accepted "
        "on reads. Mode 0600 (refused if the group or others may read or write it)",
    )
    remote_insecure: bool = setting(
        "--remote-insecure",
        False,
        switch=True,
        help="run --remote without a fleet key: rows are checked with a CRC only, so anyone "
        "who can write to the store can plant rows this node loads",
    )
