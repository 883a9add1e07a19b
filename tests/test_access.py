"""Access control (docs/architecture.md §11): the Unix socket's mode and
group are the boundary, the daemon never takes over a path that is not its own
stale socket, TCP is off unless asked for (and carries no Admin), and the admin calls
that delete data can be switched off. Admin is on the operator socket, mode 0600 or
0660 with --admin-group (tests/security/test_operator.py attacks it).
"""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
from pathlib import Path

import grpc
import pytest

from kvdepot.client import DepotClient
from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import depot_pb2 as pb
from tests.support import soak
from tests.support.daemon import DaemonProcess, kvdepot_command
from tests.support.engine import Engine, chunk_plan
from tests.support.faults import DaemonFactory, admin, fd_targets, stats
from tests.support.ops import free_port

pytestmark = pytest.mark.timeout(90)

OTHER_GROUP = "nogroup"  # exists on Debian and Ubuntu images; the test skips otherwise
OTHER_UID = 65534  # nobody


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def serve_refused(socket_path: str, *args: str) -> str:
    """Runs `kvdepot serve` expecting it to refuse (exit 2); returns its output."""
    proc = subprocess.run(
        [*kvdepot_command(), "serve", "--socket", socket_path, "--pool-size", "8MiB", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout + proc.stderr


def tcp_listeners(pid: int) -> list[int]:
    """Local ports on which `pid` has a TCP socket in LISTEN state."""
    inodes = {t[len("socket:[") : -1] for t in fd_targets(pid) if t.startswith("socket:[")}
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A = TCP_LISTEN
                ports.append(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_sockets_are_0660_by_default(daemon: DaemonProcess) -> None:
    for path in (daemon.socket_path, daemon.socket_path + ".fd"):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
        assert st.st_uid == os.geteuid()
    # The operator socket: the daemon's user only.
    st = os.stat(daemon.socket_path + ".admin")
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_uid == os.geteuid()


def test_socket_mode_and_group_are_honoured(daemon_factory: DaemonFactory) -> None:
    try:
        gid = grp.getgrnam(OTHER_GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {OTHER_GROUP!r} on this machine")
    d = daemon_factory("--pool-size", "8MiB", "--socket-mode", "600")
    for path in (d.socket_path, d.socket_path + ".fd"):
        assert mode_of(path) == 0o600
    d2 = daemon_factory(
        "--pool-size", "8MiB", "--socket-group", OTHER_GROUP, "--socket-mode", "640"
    )
    for path in (d2.socket_path, d2.socket_path + ".fd"):
        assert os.stat(path).st_gid == gid
        assert mode_of(path) == 0o640
    # The environment fallbacks do the same.
    d3 = daemon_factory(
        "--pool-size",
        "8MiB",
        env={"KVDEPOT_SOCKET_MODE": "600", "KVDEPOT_SOCKET_GROUP": OTHER_GROUP},
    )
    assert mode_of(d3.socket_path) == 0o600 and os.stat(d3.socket_path).st_gid == gid
    # The operator socket has its own path and group (then 0660), by flag or environment.
    admin_path = str(d3.workdir / "ops" / "admin.sock")
    d4 = daemon_factory(
        "--pool-size", "8MiB", "--admin-socket", admin_path, "--admin-group", OTHER_GROUP
    )
    assert d4.admin_socket_path == admin_path
    assert mode_of(admin_path) == 0o660 and os.stat(admin_path).st_gid == gid
    assert not os.path.exists(d4.socket_path + ".admin")
    assert stats(admin(d4.admin_channel())).boot_id
    d5 = daemon_factory("--pool-size", "8MiB", env={"KVDEPOT_ADMIN_GROUP": OTHER_GROUP})
    assert mode_of(d5.admin_socket_path) == 0o660
    assert os.stat(d5.admin_socket_path).st_gid == gid


def test_refuses_a_regular_file_at_the_socket_path(tmp_path: Path) -> None:
    path = tmp_path / "kvdepot.sock"
    path.write_text("precious")
    out = serve_refused(str(path))
    assert "is not a socket" in out
    assert path.read_text() == "precious", "the file must be left alone"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a socket to another uid")
def test_refuses_a_socket_that_belongs_to_another_uid(tmp_path: Path) -> None:
    path = str(tmp_path / "kvdepot.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)  # a stale socket (nobody listens), but not ours
    os.chown(path, OTHER_UID, OTHER_UID)
    out = serve_refused(path)
    assert f"belongs to uid {OTHER_UID}" in out
    assert os.stat(path).st_uid == OTHER_UID and stat.S_ISSOCK(os.stat(path).st_mode)


def test_refuses_a_socket_where_another_daemon_listens(daemon: DaemonProcess) -> None:
    out = serve_refused(daemon.socket_path)
    assert "another process is listening" in out
    # The first daemon is untouched and still serving on its socket.
    assert os.path.exists(daemon.socket_path)
    assert stats(admin(daemon.admin_channel())).boot_id


def test_replaces_its_own_stale_socket(daemon: DaemonProcess) -> None:
    daemon.kill()  # leaves both sockets behind
    assert os.path.exists(daemon.socket_path)
    daemon.start()
    assert stats(admin(daemon.admin_channel())).sessions == 0


def test_tcp_is_off_unless_asked_for(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--pool-size", "8MiB")
    assert tcp_listeners(d.proc.pid) == []  # type: ignore[union-attr]
    port = free_port()
    d2 = daemon_factory("--pool-size", "8MiB", "--listen", f"127.0.0.1:{port}")
    assert tcp_listeners(d2.proc.pid) == [port]  # type: ignore[union-attr]
    # Depot over TCP (loopback: plaintext allowed, with a warning); Admin never.
    tcp = DepotClient(f"127.0.0.1:{port}", client_name="tcp").start()
    try:
        assert tcp.wait_connected(10)
        assert tcp.hello is not None
        assert tcp.hello.boot_id == stats(admin(d2.admin_channel())).boot_id
    finally:
        tcp.close()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as info:
        stats(admin(ch))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert d2.admin_socket_path in info.value.details()
    assert "also listening on TCP" in d2.log()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_destructive_admin_calls_can_be_disabled(daemon_factory: DaemonFactory, how: str) -> None:
    if how == "flag":
        d = daemon_factory("--pool-size", "16MiB", "--no-destructive-admin")
    else:
        d = daemon_factory("--pool-size", "16MiB", env={"KVDEPOT_NO_DESTRUCTIVE_ADMIN": "1"})
    client = DepotClient(d.target).start()
    assert client.wait_connected(10)
    geo = soak.geometry("access-ns")
    keys, blocks, indices = chunk_plan(geo, range(4))
    for rank in range(geo.world_size):
        assert Engine(client, geo, rank).job(pb.STORE, keys, blocks, indices).success
    stub = admin(d.admin_channel())
    ready = stats(stub).ready_blocks
    assert ready == len(keys)
    calls = [
        lambda: stub.Evict(apb.EvictRequest(namespace_id="access-ns"), timeout=5),
        lambda: stub.Evict(apb.EvictRequest(namespace_id="access-ns", keys=keys[:1]), timeout=5),
        lambda: stub.Clear(apb.ClearRequest(), timeout=5),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--no-destructive-admin" in info.value.details()
    # Nothing was deleted, and the read-only admin calls still work.
    assert stats(stub).ready_blocks == ready
    assert stub.ListBlocks(apb.ListBlocksRequest(), timeout=5).total_blocks == ready
    assert len(stub.ListEngines(apb.ListEnginesRequest(), timeout=5).engines) == 1
    client.close()


def test_destructive_admin_calls_work_by_default(daemon: DaemonProcess) -> None:
    stub = admin(daemon.admin_channel())
    assert stub.Clear(apb.ClearRequest(), timeout=5).evicted_blocks == 0
