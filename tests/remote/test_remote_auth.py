"""The store's password: from KVDEPOT_REMOTE_PASSWORD or --remote-password-file,
never from the URL; a wrong one is a tier that does not answer, not a crash."""

from __future__ import annotations

import subprocess
import time

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from tests.remote.test_remote_daemons import store_on
from tests.support.daemon import kvdepot_command, stats
from tests.support.engine import Geometry
from tests.support.fleet_key import shared_key_args
from tests.support.redis_servers import RedisServer, free_ports, require_redis


def _server(tmp_path) -> RedisServer:
    require_redis()
    return RedisServer(tmp_path / "r", free_ports(1)[0], "--requirepass", "s3cret").start()


def _writes_with(daemon_factory, url: str, *args: str, env: dict[str, str] | None = None):
    d = daemon_factory("--pool-size", "64MiB", "--remote", url, *shared_key_args(), *args, env=env)
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    _, keys = store_on(c, Geometry(namespace=f"auth-{time.monotonic_ns()}"), range(0, 2))
    return d, c, keys


def test_password_from_the_environment_or_a_file(tmp_path, daemon_factory) -> None:
    server = _server(tmp_path)
    try:
        _, c, keys = _writes_with(
            daemon_factory, server.url, env={"KVDEPOT_REMOTE_PASSWORD": "s3cret"}
        )
        wait_for(lambda: stats(c).remote_writes == len(keys), what="writes (environment)")
        c.close()
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        pw.chmod(0o600)
        _, c, keys = _writes_with(
            daemon_factory,
            server.url,
            "--remote-password-file",
            str(pw),
            env={"KVDEPOT_REMOTE_PASSWORD": ""},
        )
        wait_for(lambda: stats(c).remote_writes == len(keys), what="writes (file)")
        c.close()
    finally:
        server.kill()


def test_a_wrong_password_is_a_tier_down_and_the_daemon_serves(tmp_path, daemon_factory) -> None:
    server = _server(tmp_path)
    try:
        d, c, keys = _writes_with(
            daemon_factory, server.url, env={"KVDEPOT_REMOTE_PASSWORD": "not-it-7f3q"}
        )
        wait_for(lambda: stats(c).remote_write_drops == len(keys), what="dropped writes")
        s = stats(c)
        assert not s.remote_healthy and s.remote_writes == 0
        assert "not answering" in d.log() and "not-it-7f3q" not in d.log()
        c.close()
    finally:
        server.kill()


def test_a_password_in_the_url_is_refused_before_anything_starts(tmp_path) -> None:
    out = subprocess.run(
        [
            *kvdepot_command(),
            "serve",
            "--socket",
            str(tmp_path / "s.sock"),
            "--remote",
            "redis://user:pw@127.0.0.1:6379",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 2
    assert "KVDEPOT_REMOTE_PASSWORD" in out.stderr and "Traceback" not in out.stderr
