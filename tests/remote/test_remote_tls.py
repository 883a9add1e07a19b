"""rediss://: the tier over TLS to a real redis-server with a test CA (openssl)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from tests.remote.test_remote_daemons import store_on
from tests.support.daemon import stats
from tests.support.engine import Geometry
from tests.support.fleet_key import shared_key_args
from tests.support.redis_servers import free_ports, require_redis


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def tls_server(tmp_path):
    require_redis()
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    d = tmp_path
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=kvdepot-test-ca",
        cwd=d,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=d,
    )
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.crt",
        "-days",
        "1",
        "-extfile",
        "ext",
        cwd=d,
    )
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "127.0.0.2",  # an address the certificate does not name
            "--tls-cert-file",
            "srv.crt",
            "--tls-key-file",
            "srv.key",
            "--tls-ca-cert-file",
            "ca.crt",
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        cwd=d,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while (
        subprocess.run(
            ["redis-cli", "--tls", "--cacert", "ca.crt", "-p", str(port), "PING"],
            cwd=d,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        != "PONG"
    ):
        assert proc.poll() is None and time.monotonic() < deadline, "no TLS redis-server"
        time.sleep(0.05)
    yield f"rediss://127.0.0.1:{port}", d / "ca.crt"
    proc.kill()
    proc.wait()


def test_rediss_with_the_ca_writes_and_without_it_is_a_tier_down(
    tls_server, daemon_factory
) -> None:
    url, ca = tls_server
    d = daemon_factory(
        "--pool-size", "64MiB", "--remote", url, *shared_key_args(), "--remote-ca-file", str(ca)
    )
    c = DepotClient(d.target).start()
    assert c.wait_connected(10)
    _, keys = store_on(c, Geometry(namespace=f"tls-{time.monotonic_ns()}"), range(0, 2))
    wait_for(lambda: stats(c).remote_writes == len(keys), what="writes over TLS")
    c.close()
    # The system's CAs do not know the test CA: the certificate is refused.
    d2 = daemon_factory("--pool-size", "64MiB", "--remote", url, *shared_key_args())
    c2 = DepotClient(d2.target).start()
    assert c2.wait_connected(10)
    _, keys = store_on(c2, Geometry(namespace=f"tls2-{time.monotonic_ns()}"), range(0, 2))
    wait_for(lambda: stats(c2).remote_write_drops == len(keys), what="dropped writes")
    assert stats(c2).remote_writes == 0 and "not answering" in d2.log()
    c2.close()


def test_the_servers_host_name_is_checked(tls_server) -> None:
    """The same server and CA, reached at an address its certificate does not name
    (127.0.0.2): refused, where 127.0.0.1 (named) answers."""
    import asyncio

    from kvdepot.server.remote.redis_tier import RedisTier
    from kvdepot.server.remote.tier import TierUnavailable

    url, ca = tls_server

    async def ask(u: str) -> list[bool]:
        tier = RedisTier(u, ca_file=str(ca))
        try:
            return await tier.exists_many([b"kvd2:absent"], time.monotonic() + 5)
        finally:
            await tier.close()

    assert asyncio.run(ask(url)) == [False]
    with pytest.raises(TierUnavailable, match=r"(?i)hostname|certificate|IP address mismatch"):
        asyncio.run(ask(url.replace("127.0.0.1", "127.0.0.2")))
