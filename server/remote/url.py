"""`--remote` URLs: parsed without importing a client library (the settings table
validates them before anything connects)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote


class RemoteURLError(ValueError):
    """A --remote value that cannot be used."""


@dataclass(frozen=True)
class RedisURL:
    tls: bool
    seeds: tuple[tuple[str, int], ...]
    username: str | None = None

    def __str__(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}" + ",".join(f"{h}:{p}" for h, p in self.seeds)


def parse_redis_url(text: str) -> RedisURL:
    """'redis://h1:6379,h2:6379' -> RedisURL; RemoteURLError says what is wrong."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise RemoteURLError(f"{text!r}: use redis://HOST:PORT[,HOST:PORT...] (rediss:// for TLS)")
    rest = rest.rstrip("/")
    username = None
    if "@" in rest:
        user, _, rest = rest.rpartition("@")
        if ":" in user:
            raise RemoteURLError(
                "the URL carries a password, which `ps` would show: put it in "
                "KVDEPOT_REMOTE_PASSWORD or a file named by --remote-password-file"
            )
        username = unquote(user) or None
    if "/" in rest or "?" in rest:
        raise RemoteURLError(f"{text!r}: no database number or options in the URL")
    seeds = []
    for part in rest.split(","):
        host, _, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise RemoteURLError(f"{part!r} in {text!r} is not HOST:PORT")
        seeds.append((host, int(port)))
    return RedisURL(scheme == "rediss", tuple(seeds), username)
