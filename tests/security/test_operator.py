"""Operators apart from engines; TCP only with mutual TLS; client strings escaped
(docs/security.md).

Each attack runs against a real `kvdepot serve` from a real attacker process (a
Python child, as root or as uid 65534 under setpriv), and each test checks the
legitimate path beside it: the engine's own blocks load back byte for byte, the
operator's calls work on the operator socket, a client with a certificate works.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb
from kvdepot.v1 import depot_pb2_grpc
from tests.support.daemon import DaemonProcess, connect, kvdepot_command
from tests.support.engine import Engine, Geometry, chunk_plan
from tests.support.faults import DaemonFactory, admin, stats
from tests.support.ops import free_port, load, store
from tests.support.status_cli import one_line_error, status
from tests.support.tls import Pki, make_pki
from tests.support.unprivileged import AS_NOBODY, NOBODY, nobody_python

pytestmark = pytest.mark.timeout(120)

GEO = Geometry(
    groups=[[4096, 4096]], blocks_per_chunk=2, world_size=1, num_blocks=64, namespace="op-ns"
)

# An attacker process: every Admin call on `target`, each answer as [code, details].
ADMIN_PROBE = r"""
import json, sys
import grpc
from kvdepot.v1 import admin_pb2 as apb, admin_pb2_grpc

calls = {
    "GetStats": apb.GetStatsRequest(),
    "ListNamespaces": apb.ListNamespacesRequest(),
    "ListEngines": apb.ListEnginesRequest(),
    "ListBlocks": apb.ListBlocksRequest(),
    "Evict": apb.EvictRequest(namespace_id=sys.argv[2]),
    "Clear": apb.ClearRequest(),
}
answers = {}
with grpc.insecure_channel(sys.argv[1]) as ch:
    stub = admin_pb2_grpc.AdminStub(ch)
    for name, request in calls.items():
        try:
            reply = getattr(stub, name)(request, timeout=10)
            answers[name] = ["OK", str(reply)[:200]]
        except grpc.RpcError as exc:
            answers[name] = [exc.code().name, exc.details()]
print(json.dumps(answers))
"""

# A process that checks the data socket's health: the legitimate path beside the attack.
HEALTH_PROBE = r"""
import sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

with grpc.insecure_channel(sys.argv[1]) as ch:
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
"""


def run_python(code: str, *args: str, as_nobody: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [*AS_NOBODY, nobody_python()] if as_nobody else [sys.executable]
    cmd += ["-c", code, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def admin_probe(target: str, as_nobody: bool = False) -> dict[str, list[str]]:
    out = run_python(ADMIN_PROBE, target, GEO.namespace, as_nobody=as_nobody)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@dataclass
class Tenant:
    """An engine with 4 chunks stored: what an attack must not destroy."""

    client: DepotClient
    engine: Engine

    def intact(self) -> None:
        """Its blocks are still there, and load back byte for byte."""
        load(self.engine, range(4), base_block=32)


@pytest.fixture
def tenant(daemon: DaemonProcess) -> Iterator[Tenant]:
    client = connect(daemon.target, "engine-a tenant")
    engine = Engine(client, GEO, 0)
    store(engine, range(4))
    yield Tenant(client, engine)
    client.close()


# --- operators apart from engines (item 4) -------------------------------------------------


def test_admin_is_refused_on_the_engines_socket(daemon: DaemonProcess, tenant: Tenant) -> None:
    """Before: any engine could Clear the pool and list the other engines over the data
    socket. Now every Admin call there answers PERMISSION_DENIED, naming the operator
    socket, and nothing changes."""
    ready = stats(admin(daemon.admin_channel())).ready_blocks
    assert ready == 4
    answers = admin_probe(daemon.target)
    assert set(answers) == {
        "GetStats",
        "ListNamespaces",
        "ListEngines",
        "ListBlocks",
        "Evict",
        "Clear",
    }
    for name, (code, details) in answers.items():
        assert code == "PERMISSION_DENIED", (name, code, details)
        assert f"operator socket {daemon.admin_socket_path}" in details, details
    tenant.intact()
    assert stats(admin(daemon.admin_channel())).ready_blocks == ready


def test_the_operator_socket_serves_admin_to_its_owner(
    daemon: DaemonProcess, tenant: Tenant
) -> None:
    """The same calls from another process of the daemon's user, on the operator
    socket: they work (and Clear really clears)."""
    st = os.stat(daemon.admin_socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    answers = admin_probe(daemon.admin_target)
    assert {name: code for name, (code, _) in answers.items()} == dict.fromkeys(answers, "OK")
    assert "engine-a tenant" in answers["ListEngines"][1]
    assert GEO.namespace in answers["ListNamespaces"][1]
    # The probe's Evict of the namespace and its Clear deleted the blocks, as asked.
    keys, _, _ = chunk_plan(GEO, range(4))
    assert tenant.client.lookup(GEO.namespace, keys) == [False] * 4
    assert stats(admin(daemon.admin_channel())).ready_blocks == 0


def test_the_operator_socket_has_no_depot(daemon: DaemonProcess) -> None:
    """Engines have no business on the operator socket: Depot is not served there."""
    with daemon.admin_channel() as ch:
        with pytest.raises(grpc.RpcError) as info:
            next(depot_pb2_grpc.DepotStub(ch).Session(pb.SessionRequest(), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's temporary root is private to root):
    only the sockets' own modes decide who connects."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid (setpriv)")
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv not found: install Debian's util-linux")
    workdir = Path(tempfile.mkdtemp(prefix="kvd-op-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    yield workdir
    shutil.rmtree(workdir, ignore_errors=True)


def test_another_uid_cannot_reach_the_operator_socket(shared_dir: Path) -> None:
    """uid 65534 may use the data socket (mode 666 here, on purpose) but cannot connect
    to the operator socket (0600) beside it: no Admin call reaches the daemon."""
    d = DaemonProcess(shared_dir, "--pool-size", "16MiB", "--socket-mode", "666")
    try:
        d.start()
        client = connect(d.target, "engine-a owner")
        engine = Engine(client, GEO, 0)
        store(engine, range(4))
        # The legitimate path beside the attack: nobody reaches the engines' socket.
        ok = run_python(HEALTH_PROBE, d.target, as_nobody=True)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
        answers = admin_probe(d.admin_target, as_nobody=True)
        for name, (code, details) in answers.items():
            assert code == "UNAVAILABLE", (name, code, details)
            assert "Permission denied" in details or "EACCES" in details, details
        # `kvdepot status` as nobody: one line that says why and what to do.
        line = one_line_error(status("--socket", d.socket_path, user="nobody"))
        assert "permission denied" in line and "mode 0600" in line and "--admin-group" in line
        load(engine, range(4), base_block=32)
        assert stats(admin(d.admin_channel())).ready_blocks == 4
        client.close()
    finally:
        d.kill()


def test_an_operator_group_may_use_the_operator_socket(shared_dir: Path) -> None:
    """--admin-group: the socket is 0660 and that group's members get Admin."""
    import grp

    group = grp.getgrgid(NOBODY).gr_name  # nobody's own group (nogroup on Debian)
    d = DaemonProcess(shared_dir, "--pool-size", "16MiB", "--admin-group", group)
    try:
        d.start()
        st = os.stat(d.admin_socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == NOBODY
        answers = admin_probe(d.admin_target, as_nobody=True)
        assert answers["GetStats"][0] == "OK", answers
        out = status("--socket", d.socket_path, "--interval", "0", "--json", user="nobody")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["admin_socket"] == d.admin_socket_path
    finally:
        d.kill()


# --- TCP only with mutual TLS (item 8) -----------------------------------------------------


def serve_refused(workdir: Path, *args: str) -> str:
    proc = subprocess.run(
        [*kvdepot_command(), "serve", "--socket", str(workdir / "k.sock"), "--pool-size", "8MiB",
         *args],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert not (workdir / "k.sock").exists(), "refused before any socket was made"
    return lines[0]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_a_public_listen_address_needs_mutual_tls(tmp_path: Path, pki: Pki) -> None:
    """Before: --listen 0.0.0.0:PORT served Depot and Admin, Clear included, in
    plaintext. Now it refuses to start, with one line, unless all three TLS files
    are given; unreadable files are refused the same way."""
    port = str(free_port())
    line = serve_refused(tmp_path, "--listen", f"0.0.0.0:{port}")
    assert "not a loopback address" in line and "--tls-client-ca" in line, line
    line = serve_refused(
        tmp_path, "--listen", f"0.0.0.0:{port}", "--tls-cert", str(pki.server_cert),
        "--tls-key", str(pki.server_key),
    )  # fmt: skip
    assert "missing --tls-client-ca" in line, line
    line = serve_refused(
        tmp_path, "--listen", f"[::]:{port}", "--tls-cert", str(pki.server_cert),
        "--tls-key", str(tmp_path / "no-such.key"), "--tls-client-ca", str(pki.ca),
    )  # fmt: skip
    assert "--tls-key" in line and "No such file" in line, line
    line = serve_refused(tmp_path, "--tls-cert", str(pki.server_cert))
    assert "--listen" in line, line


def _session_and_health(channel: grpc.Channel) -> str:
    """A Depot Session's hello and a health check over `channel`; returns the boot id."""
    call = depot_pb2_grpc.DepotStub(channel).Session(
        pb.SessionRequest(client_name="tcp engine"), timeout=10
    )
    hello = next(call).hello
    call.cancel()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    return hello.boot_id


def test_mutual_tls_admits_only_clients_with_a_certificate(
    daemon_factory: DaemonFactory, pki: Pki
) -> None:
    port = free_port()
    d = daemon_factory(
        "--pool-size", "8MiB", "--listen", f"0.0.0.0:{port}",
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca),
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    boot_id = stats(admin(d.admin_channel())).boot_id
    assert "mutual TLS" in d.log() and "anyone who reaches it" not in d.log()
    # A client with a certificate of the daemon's CA: Depot and health work.
    good = grpc.ssl_channel_credentials(
        root_certificates=pki.read("ca"),
        private_key=pki.read("client_key"),
        certificate_chain=pki.read("client_cert"),
    )
    with grpc.secure_channel(address, good) as ch:
        assert _session_and_health(ch) == boot_id
        # Admin is never served over TCP, even to a client with a certificate.
        with pytest.raises(grpc.RpcError) as info:
            stats(admin(ch))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert d.admin_socket_path in info.value.details()
    # Without a certificate, with one of another CA, or in plaintext: no call gets through.
    strangers = {
        "no certificate": grpc.ssl_channel_credentials(root_certificates=pki.read("ca")),
        "another CA's certificate": grpc.ssl_channel_credentials(
            root_certificates=pki.read("ca"),
            private_key=pki.read("stranger_key"),
            certificate_chain=pki.read("stranger_cert"),
        ),
    }
    for what, creds in strangers.items():
        with grpc.secure_channel(address, creds) as ch, pytest.raises(grpc.RpcError) as info:
            _session_and_health(ch)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (what, info.value)
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        _session_and_health(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # None of them opened a session; the good client's ended with its channel.
    assert stats(admin(d.admin_channel())).sessions <= 1


def test_loopback_listen_stays_plaintext_with_a_warning(daemon_factory: DaemonFactory) -> None:
    port = free_port()
    d = daemon_factory("--pool-size", "8MiB", "--listen", f"127.0.0.1:{port}")
    assert "anyone who reaches it can use the pool" in d.log()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        assert _session_and_health(ch) == stats(admin(d.admin_channel())).boot_id


# --- client strings escaped (item 10) ------------------------------------------------------

HOSTILE = "\x1b[2J\x1b]0;pwned\x07"


@dataclass
class DescribedGeometry(Geometry):
    description: str = ""

    def layout(self) -> pb.NamespaceLayout:
        layout = super().layout()
        layout.description = self.description
        return layout


def test_client_strings_reach_the_operator_escaped(daemon: DaemonProcess) -> None:
    """Before: a client name with terminal escapes reached the operator's terminal
    through `kvdepot status`, and "[/]" in a name crashed it (rich markup). Now the
    screen and the log show them escaped; --json carries them exactly (as JSON)."""
    name = f"evil{HOSTILE}"
    markup = "x[/]y[blink]z"
    evil = DepotClient(daemon.target, client_name=name, engine_id=HOSTILE).start()
    other = DepotClient(daemon.target, client_name=markup).start()
    try:
        assert evil.wait_connected(10) and other.wait_connected(10)
        geo = DescribedGeometry(
            groups=[[4096]], blocks_per_chunk=1, world_size=1, num_blocks=8,
            namespace="described-ns", description=f"model{HOSTILE}\u202etxt.exe",
        )  # fmt: skip
        engine = Engine(evil, geo, 0)
        store(engine, range(2))
        out = subprocess.run(
            [*kvdepot_command(), "status", "--socket", daemon.socket_path, "--interval", "0"],
            capture_output=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert out.returncode == 0, out.stderr
        screen = out.stdout
        assert b"\x1b" not in screen and b"\x07" not in screen, screen
        assert "\u202e".encode() not in screen
        text = screen.decode()
        assert "evil\\x1b[2J\\x1b]0;pwned\\x07" in text, text
        assert markup in text, text
        assert "model\\x1b[2J" in text, text
        # --json: the exact strings, JSON-escaped (no raw control byte on the terminal).
        out = subprocess.run(
            [*kvdepot_command(), "status", "--socket", daemon.socket_path, "--interval", "0",
             "--json"],
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        assert out.returncode == 0 and b"\x1b" not in out.stdout
        names = {e["client_name"] for e in json.loads(out.stdout)["engines"]}
        assert {name, markup} <= names
        # The daemon's log: the name escaped, no raw escape byte.
        log = daemon.log_path.read_bytes()
        assert b"\x1b" not in log and b"\x07" not in log
        assert b"evil\\x1b[2J" in log
        # The legitimate path beside it: the hostile-named engine's own bytes round-trip.
        load(engine, range(2), base_block=4)
    finally:
        evil.close()
        other.close()
