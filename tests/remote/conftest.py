"""Fixtures for the remote tier: real Redis servers started by the suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_servers import (
    RedisClusterProcs,
    RedisServer,
    free_ports,
    require_redis,
)


@pytest.fixture(scope="module")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    require_redis()
    s = RedisServer(tmp_path_factory.mktemp("redis"), free_ports(1)[0]).start()
    yield s
    s.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    require_redis()
    c = RedisClusterProcs(tmp_path_factory.mktemp("rcluster")).start()
    yield c
    c.kill_all()


@pytest.fixture
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    """A cluster of the test's own, for tests that kill or restart it."""
    require_redis()
    c = RedisClusterProcs(tmp_path_factory.mktemp("rcluster")).start()
    yield c
    c.kill_all()
