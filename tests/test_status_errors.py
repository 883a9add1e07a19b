"""`kvdepot status` failures, one line each: no socket, a stale or wrong file, a server
that is not a kvdepot daemon, a stopped daemon, a socket the user may not open. (status
reads the operator socket: --admin-socket, or the --socket path + .admin.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tests.support.daemon import DaemonProcess
from tests.support.faults import DaemonFactory
from tests.support.status_cli import one_line_error, status


def test_missing_socket(tmp_path: Path) -> None:
    line = one_line_error(status("--socket", str(tmp_path / "kvdepot.sock")))
    assert "no such socket" in line and "KVDEPOT_SOCKET" in line


def test_stale_socket_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "kvdepot.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: what a killed daemon leaves behind
    line = one_line_error(status("--admin-socket", path))
    assert "connection refused" in line and "no daemon listens" in line


def test_not_a_socket(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert "not a socket" in one_line_error(status("--admin-socket", str(tmp_path / "file")))


def test_other_grpc_server_is_not_a_kvdepot_daemon(tmp_path: Path) -> None:
    """A gRPC server with only the health service: UNIMPLEMENTED on Admin."""
    path = str(tmp_path / "other.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        line = one_line_error(status("--admin-socket", path))
    finally:
        server.stop(None)
    assert "not a kvdepot daemon" in line and "kvdepot.v1.Admin" in line


def test_non_grpc_listener_is_not_a_kvdepot_daemon(tmp_path: Path) -> None:
    """Something that accepts and answers with plain text (not HTTP/2)."""
    path = str(tmp_path / "text.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    stop = False

    def serve() -> None:
        while not stop:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"hello, I am not gRPC\r\n")

    import threading

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        line = one_line_error(status("--admin-socket", path, "--timeout", "3"))
    finally:
        stop = True
        listener.close()
    assert "not a kvdepot daemon" in line


def test_stopped_daemon_times_out(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGSTOP)  # the kernel still accepts; nobody answers
    try:
        line = one_line_error(status("--socket", d.socket_path, "--timeout", "1"))
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert "did not answer within 1s" in line


def test_permission_denied_names_the_group(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A user outside the operator socket's group (--admin-group) is told which group to
    join. As root, the command runs as nobody (root may connect to any socket);
    otherwise the socket is made unconnectable for its owner (mode 000)."""
    import grp

    root = os.geteuid() == 0
    if root and shutil.which("setpriv") is None:
        pytest.fail("setpriv not found: install Debian's util-linux")
    # A directory every user may enter: pytest's own temporary root is private to root.
    workdir = Path(tempfile.mkdtemp(prefix="kvd-perm-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    group = grp.getgrgid(os.getegid()).gr_name  # the daemon's own group: not nobody's
    d = DaemonProcess(workdir, "--pool-size", "16MiB", "--admin-group", group)
    try:
        d.start()
        if not root:
            os.chmod(d.admin_socket_path, 0o000)
        assert grp.getgrgid(os.stat(d.admin_socket_path).st_gid).gr_name == group
        out = status("--socket", d.socket_path, user="nobody" if root else None)
        line = one_line_error(out)
        assert "permission denied" in line and f"join the group {group}" in line, line
        assert status("--socket", d.socket_path, "--interval", "0").returncode == (0 if root else 1)
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)
