"""`RedisTier`: the remote tier on Redis Cluster or a standalone Redis (or Valkey),
through redis-py's asyncio clients.

URL: `redis://HOST:PORT[,HOST:PORT...]` (or `rediss://` for TLS; `USER@` before
the first host names an ACL user). The password never comes from the URL (a
flag or URL shows in `ps`): pass it in `password` (the daemon reads
KVDEPOT_REMOTE_PASSWORD or --remote-password-file). Whether the store is a
cluster is asked of the first seed that answers (`INFO cluster`); a cluster is
then discovered from the seeds by redis-py.

Deadlines: every call runs under `asyncio.timeout` until its deadline, and the
sockets have their own timeouts, so no call outlives its deadline. redis-py's
own retries are kept small (the deadline is the budget); a failed call drops the
client's connections and the next call reconnects. Connecting (the cluster probe,
redis-py's discovery and its COMMAND table: 40-70 ms idle, over 300 ms on a loaded
machine) runs as a task of its own, bounded by CONNECT_BUDGET_S: a call whose
deadline ends first (a Prefetch has 250 ms) gives up waiting but leaves the
connection being made for the next call instead of cancelling it half-way. Values are checked by the
caller (kvdepot.server.remote.codec), so even a reply mixed up by a broken
connection could never be loaded as the wrong block.

TLS (`rediss://`): the server's certificate is verified against the system's CAs
or `ca_file`, and its host name against the URL's (`ssl_cert_reqs="required"`,
`ssl_check_hostname=True`, set explicitly rather than trusting redis-py's
defaults, which have changed between releases).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvdepot.server.remote.tier import RemoteTier, TierUnavailable
from kvdepot.server.remote.url import RedisURL, parse_redis_url

log = logging.getLogger("kvdepot.remote")
T = TypeVar("T")

CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 5.0  # a backstop: each call's own deadline is usually shorter
CONNECT_BUDGET_S = 10.0  # probe + client set-up, however many calls wait for it


class RedisTier(RemoteTier):
    """Redis Cluster or standalone Redis behind the RemoteTier contract."""

    def __init__(
        self,
        url: RedisURL | str,
        *,
        password: str | None = None,
        ca_file: str | None = None,
        max_connections: int = 32,
    ) -> None:
        self.url = parse_redis_url(url) if isinstance(url, str) else url
        self._password = password
        self._ca_file = ca_file
        self._max_connections = max_connections
        self._client: Redis | RedisCluster | None = None
        self._connecting: asyncio.Task[Redis | RedisCluster] | None = None
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()
        self.cluster: bool | None = None  # known after the first connection
        # Cluster nodes seen since: seeds too when reconnecting, should the given ones be down.
        self._discovered: list[tuple[str, int]] = []
        more = len(self.url.seeds) - 1
        h, p = self.url.seeds[0]
        self.description = f"{(self.url.tls and 'rediss') or 'redis'}://{h}:{p}" + (
            f" (+{more} seed{'s' if more > 1 else ''})" if more else ""
        )

    # -- connections ------------------------------------------------------------------

    def _common(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "password": self._password,
            "username": self.url.username,
            "socket_timeout": SOCKET_TIMEOUT_S,
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            # One retry: a pooled connection to a restarted server is dead; the retry
            # takes a fresh one. The deadline still bounds the whole call.
            "retry": Retry(NoBackoff(), 1),
            "max_connections": self._max_connections,
            "client_name": "kvdepot",
        }
        if self.url.tls:
            opts["ssl"] = True
            opts["ssl_cert_reqs"] = "required"
            opts["ssl_check_hostname"] = True
            if self._ca_file:
                opts["ssl_ca_certs"] = self._ca_file
        return opts

    async def _probe_cluster(self) -> bool:
        """Asks the first seed that answers whether cluster mode is on."""
        errors = []
        for host, port in dict.fromkeys((*self.url.seeds, *self._discovered)):
            probe = Redis(host=host, port=port, **self._common())
            try:
                info = await probe.info("cluster")
                return bool(int(info.get("cluster_enabled", 0)))
            except (RedisError, OSError) as exc:
                errors.append(f"{host}:{port}: {exc}")
            finally:
                await probe.aclose()
        raise TierUnavailable("no seed answered: " + "; ".join(errors))

    async def _get_client(self) -> Redis | RedisCluster:
        if self._closed:
            raise TierUnavailable("the remote tier is closed")
        if self._client is not None:
            return self._client
        if self._connecting is None or self._connecting.done():
            task = asyncio.get_running_loop().create_task(self._connect())
            # Its failure is each waiting call's; with none left waiting, nobody's.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._connecting = task
        # Shielded: a call whose deadline ends first does not cancel the connection.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> Redis | RedisCluster:
        client: Redis | RedisCluster | None = None
        try:
            async with asyncio.timeout(CONNECT_BUDGET_S):
                cluster = await self._probe_cluster()
                if cluster:
                    client = RedisCluster(
                        startup_nodes=[
                            ClusterNode(h, p)
                            for h, p in dict.fromkeys((*self.url.seeds, *self._discovered))
                        ],
                        # A master down leaves its slots uncovered: keep serving the rest.
                        require_full_coverage=False,
                        **self._common(),
                    )
                    await client.initialize()
                    # redis-py's stubs say str | int: a cluster node's port is an int.
                    self._discovered = [(n.host, n.port) for n in client.get_nodes()]  # type: ignore[misc]
                else:
                    h, p = self.url.seeds[0]
                    client = Redis(host=h, port=p, **self._common())
            if self._closed:
                raise TierUnavailable("the remote tier is closed")
        except BaseException:  # a half-made client's connections are closed, not leaked
            if client is not None:
                await self._close_quietly(client)
            raise
        if self.cluster is None:
            log.info(
                "remote tier: %s is a %s",
                self.url,
                "Redis cluster" if cluster else "standalone Redis",
            )
        self.cluster = cluster
        self._client = client
        return client

    def _reset(self) -> None:
        """Drops the client after a failure: the next call reconnects from the seeds
        (a restarted cluster may have new node ids and addresses). The old client is
        closed in the background, so the failed call still ends by its deadline."""
        client, self._client = self._client, None
        if client is not None:
            task = asyncio.get_running_loop().create_task(self._close_quietly(client))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_quietly(client: Redis | RedisCluster) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(client.aclose(), 1.0)

    async def _run(
        self,
        what: str,
        deadline: float,
        fn: Callable[[Redis | RedisCluster], Awaitable[list[T]]],
    ) -> list[T]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TierUnavailable(f"{what}: no time left before the deadline")
        try:
            async with asyncio.timeout(left):
                client = await self._get_client()
                return await fn(client)
        except TimeoutError:
            self._reset()
            raise TierUnavailable(f"{what}: no answer within {left * 1000:.0f} ms") from None
        except (RedisError, OSError) as exc:
            self._reset()
            raise TierUnavailable(f"{what}: {type(exc).__name__}: {exc}") from None

    # -- the contract -----------------------------------------------------------------------

    async def put_many(
        self, items: Sequence[tuple[bytes, bytes]], ttl_s: int | None, deadline: float
    ) -> list[bool]:
        if not items:
            return []

        async def go(client: Redis | RedisCluster) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, nx=True, ex=ttl_s)
            replies = await pipe.execute(raise_on_error=True)
            return [bool(r) for r in replies]

        return await self._run(f"writing {len(items)} value(s)", deadline, go)

    async def get_many(
        self, keys: Sequence[bytes], deadline: float, limits: Sequence[int] | None = None
    ) -> list[bytes | None]:
        if not keys:
            return []

        async def go(client: Redis | RedisCluster) -> list[bytes | None]:
            pipe = client.pipeline(transaction=False)
            if limits is None:
                for key in keys:
                    pipe.get(key)
                return list(await pipe.execute(raise_on_error=True))
            # GETRANGE never sends more than the limit, whatever was planted under the key;
            # it answers b"" for an absent key (no value of ours is empty).
            for key, limit in zip(keys, limits, strict=True):
                pipe.getrange(key, 0, max(limit, 1) - 1)
            return [v or None for v in await pipe.execute(raise_on_error=True)]

        return await self._run(f"reading {len(keys)} value(s)", deadline, go)

    async def sizes_many(self, keys: Sequence[bytes], deadline: float) -> list[int]:
        if not keys:
            return []

        async def go(client: Redis | RedisCluster) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(key)
            return [int(r) for r in await pipe.execute(raise_on_error=True)]

        return await self._run(f"sizing {len(keys)} value(s)", deadline, go)

    async def exists_many(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        if not keys:
            return []

        async def go(client: Redis | RedisCluster) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(r) for r in await pipe.execute(raise_on_error=True)]

        return await self._run(f"checking {len(keys)} key(s)", deadline, go)

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()  # no-op once done
        self._reset()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=2.0)
