"""`kvdepot status` against live daemons: real `kvdepot serve` processes, real engines
storing and loading over shared memory, the real command in a subprocess, and the watch
mode in a real terminal (tmux, 80 columns).

The checks are about content, not layout: the figures the screen and --json show are
the daemon's own (compared with Admin calls made by the test), rates add up to the
traffic the test made, and each kind of failure gets its own one-line message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

if __package__ in (None, ""):  # run as a script (--write-docs)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvdepot
from kvdepot.v1 import admin_pb2
from tests.support.daemon import DaemonProcess, kvdepot_command
from tests.support.engine import Engine, Geometry, make_key
from tests.test_operations import GEO_A, GEO_B, admin, connect, run_guide_scenario, store

DaemonFactory = Callable[..., DaemonProcess]
WIDTH = 80


def status(
    *args: str, env: dict[str, str] | None = None, user: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Runs `kvdepot status ARGS` (as `user` when given: needs root) at 80 columns."""
    cmd = [*kvdepot_command(), "status", *args]
    if user is not None:
        import pwd

        pw = pwd.getpwnam(user)
        cmd = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", *cmd]
    full_env = {**os.environ, "COLUMNS": str(WIDTH), "LINES": "60", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def status_json(socket_path: str, *args: str) -> dict[str, Any]:
    out = status("--socket", socket_path, "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{out.stderr}"
    assert lines[0].startswith("kvdepot status: ")
    return lines[0]


@pytest.fixture
def guide_daemon(daemon_factory: DaemonFactory) -> Iterator[DaemonProcess]:
    """A daemon in the operations guide's state, its two engines connected."""
    d = daemon_factory("--pool-size", "64MiB")
    scenario = run_guide_scenario(d.target)
    try:
        yield d
    finally:
        scenario.close()


# --- content -----------------------------------------------------------------------------


def test_json_is_the_daemons_own_figures(guide_daemon: DaemonProcess) -> None:
    report = status_json(guide_daemon.socket_path)
    ch, stub = admin(guide_daemon)
    with ch:
        s = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
        engines = stub.ListEngines(admin_pb2.ListEnginesRequest(), timeout=10).engines
    assert report["daemon"]["boot_id"] == s.boot_id
    assert report["daemon"]["version"] == kvdepot.__version__
    pool = report["pool"]
    assert pool["capacity_bytes"] == 64 << 20
    assert (pool["used_bytes"], pool["pinned_bytes"]) == (s.used_bytes, s.pinned_bytes)
    assert pool["free_bytes"] == s.capacity_bytes - s.used_bytes
    assert pool["largest_free_extent_bytes"] == s.largest_free_extent_bytes
    assert report["warmup"]["complete"] and report["warmup"]["fraction"] == 1.0
    assert report["blocks"] == {
        "ready": 11,
        "writing": 2,
        "pinned": 1,
        "inflight_jobs": 0,
        "job_lanes_open": 3,
    }

    ns = {n["id"]: n for n in report["namespaces"]}
    assert set(ns) == {GEO_A.namespace, GEO_B.namespace}
    assert (ns[GEO_A.namespace]["ready_blocks"], ns[GEO_A.namespace]["writing_blocks"]) == (8, 2)
    assert ns[GEO_B.namespace]["ready_blocks"] == 3
    assert sum(n["used_bytes"] for n in ns.values()) == s.used_bytes

    by_name = {e["client_name"]: e for e in report["engines"]}
    a, b = by_name["engine-a (synthetic, TP=2)"], by_name["engine-b (synthetic)"]
    assert a["pid"] == b["pid"] == os.getpid()
    assert (a["ranks"], b["ranks"]) == ([0, 1], [0])
    assert a["memory_paths"] == b["memory_paths"] == ["shm"]
    assert a["pinned_blocks"] == 1
    assert all(r["memory_path_reason"] for e in report["engines"] for r in e["registrations"])
    assert {e.session_id for e in engines} == {e["session_id"] for e in report["engines"]}
    # One interval, no traffic in it: every rate is there, at zero.
    rates = report["rates"]
    assert rates["interval_seconds"] > 0
    assert rates["stores_per_second"] == rates["loads_per_second"] == 0
    assert report["totals"]["stores"] == 4 and report["totals"]["hits"] == 4
    if "pin_keys" in admin_pb2.GetStatsResponse.DESCRIPTOR.fields_by_name:  # newer daemons
        assert (report["totals"]["pin_keys"], report["totals"]["pinned_keys"]) == (1, 1)
        assert rates["pin_keys_per_second"] == rates["failed_store_jobs_per_second"] == 0


def test_screen_shows_the_state_at_80_columns(guide_daemon: DaemonProcess) -> None:
    out = status("--socket", guide_daemon.socket_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert all(len(line.rstrip()) <= WIDTH for line in text.splitlines()), text
    ch, stub = admin(guide_daemon)
    with ch:
        s = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    for needle in (
        f"kvdepot {kvdepot.__version__}",
        s.boot_id,
        guide_daemon.socket_path,
        "of 64.0 MiB",
        "used 316.0 KiB",
        "pinned 32.0 KiB",
        "free 63.7 MiB",
        "largest free extent 63.7 MiB",
        "100% done",
        "11 ready",
        "2 writing",
        "1 pinned",
        GEO_A.namespace[:13],
        GEO_B.namespace[:13],
        "synthetic engine A",
        "stores 4",
        "lookups 6 (4 hits)",
    ):
        assert needle in text, f"{needle!r} not on the screen:\n{text}"
    # Each engine on one line with its pid, ranks and memory path.
    rows = {
        line.split("  ")[0].strip(): line
        for line in text.splitlines()
        if line.strip().startswith("engine-")
    }
    assert re.search(rf"\b{os.getpid()}\s+0,1\s+shm\b", rows["engine-a (synthetic, TP=2)"])
    assert re.search(rf"\b{os.getpid()}\s+0\s+shm\b", rows["engine-b (synthetic)"])
    assert "shm: KV tensors in shared memory" in text


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
GUIDE_COMMAND = "$ kvdepot status --socket /run/kvdepot/kvdepot.sock"


def _comparable(screen: str) -> list[str]:
    """The screen without what changes from run to run: boot id, durations, pids (and the
    column widths they set)."""
    text = re.sub(r"\b[0-9a-f]{16}\b", "<id>", screen)
    text = re.sub(r"\b\d+(\.\d+)?[smhd]\b( \d+[smh]\b)?", "<t>", text)
    text = re.sub(r"(?<=\s)\d{3,}(?=\s)", "<n>", text)  # pids; sizes all have decimals
    text = re.sub("─+", "─", text)  # a table's rule is as wide as its columns
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_guide_shows_the_current_screen(guide_daemon: DaemonProcess) -> None:
    """docs/operations.md's status screen is what the command shows in the guide's state."""
    text = GUIDE.read_text()
    start = text.index(GUIDE_COMMAND + "\n") + len(GUIDE_COMMAND) + 1
    printed = text[start : text.index("```", start)]
    out = status("--socket", guide_daemon.socket_path)
    assert out.returncode == 0, out.stderr
    live = out.stdout.replace(guide_daemon.socket_path, "/run/kvdepot/kvdepot.sock")
    assert _comparable(printed) == _comparable(live), (
        "docs/operations.md shows an old screen (python tests/test_status.py --write-docs "
        f"rewrites it); the command now shows:\n{live}"
    )


def write_guide_screen() -> int:
    """Reruns the guide's scenario and rewrites the status screen in docs/operations.md."""
    d = DaemonProcess(Path(tempfile.mkdtemp(prefix="kvd-doc-")), "--pool-size", "64MiB")
    try:
        d.start()
        scenario = run_guide_scenario(d.target)
        try:
            out = status("--socket", d.socket_path)
        finally:
            scenario.close()
    finally:
        d.kill()
        shutil.rmtree(d.workdir, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    live = out.stdout.replace(d.socket_path, "/run/kvdepot/kvdepot.sock")
    screen = "\n".join(line.rstrip() for line in live.splitlines()).rstrip("\n")
    text = GUIDE.read_text()
    start = text.index(GUIDE_COMMAND + "\n") + len(GUIDE_COMMAND) + 1
    GUIDE.write_text(text[:start] + screen + "\n" + text[text.index("```", start) :])
    print(f"rewrote the status screen in {GUIDE}")
    return 0


def test_rates_add_up_to_the_traffic(daemon_factory: DaemonFactory) -> None:
    """--watch --json: the per-second rates times their intervals sum to exactly the
    stores, bytes and evictions made while it watched."""
    d = daemon_factory("--pool-size", "16MiB")
    geo = Geometry(
        groups=[[4096, 4096]],
        blocks_per_chunk=2,
        world_size=1,
        num_blocks=128,
        namespace="rates-test",
    )
    client = connect(d.target, "rates-test")
    proc = subprocess.Popen(
        [
            *kvdepot_command(),
            "status",
            "--socket",
            d.socket_path,
            "--watch",
            "--json",
            "--interval",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        eng = Engine(client, geo, 0)
        for i in range(5):
            store(eng, range(i * 2, i * 2 + 2))  # 5 jobs, 10 chunks
        ch, stub = admin(d)
        with ch:
            evicted = stub.Evict(
                admin_pb2.EvictRequest(
                    namespace_id="rates-test", keys=[make_key(c, 0) for c in range(3)]
                )
            ).evicted_blocks
            want_bytes = stub.GetStats(admin_pb2.GetStatsRequest()).stored_bytes
            time.sleep(0.5)
            reports = [first]
            while reports[-1]["totals"]["evictions"] < evicted or len(reports) < 3:
                reports.append(json.loads(proc.stdout.readline()))
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
        client.close()
    assert evicted == 3
    later = [r["rates"] for r in reports[1:]]
    assert all(r is not None and r["interval_seconds"] > 0 for r in later)

    def total(key: str) -> float:
        return sum(r[key] * r["interval_seconds"] for r in later)

    assert round(total("stores_per_second")) == 5
    assert round(total("store_bytes_per_second")) == want_bytes == 10 * 2 * 8192
    assert round(total("evictions_per_second")) == 3
    assert (
        round(
            sum(
                r["evictions_by_reason_per_second"].get("admin", 0) * r["interval_seconds"]
                for r in later
            )
        )
        == 3
    )


def test_socket_from_the_environment_and_serve_default(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    out = status("--json", "--interval", "0", env={"KVDEPOT_SOCKET": d.socket_path})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["socket"] == d.socket_path
    assert json.loads(out.stdout)["rates"] is None  # one reading

    import argparse

    from kvdepot.server.config import default_socket_path
    from kvdepot.server.status import add_status_arguments

    env = {k: v for k, v in os.environ.items() if k != "KVDEPOT_SOCKET"}
    parser = argparse.ArgumentParser()
    old = os.environ.pop("KVDEPOT_SOCKET", None)
    try:
        add_status_arguments(parser)
    finally:
        if old is not None:
            os.environ["KVDEPOT_SOCKET"] = old
    assert parser.parse_args([]).socket == default_socket_path()
    assert env is not None


def test_remote_tier_health_live(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """A daemon with a real remote tier (redis-server): healthy while it answers, DOWN
    (in words, and in --json) once the server is killed and a write has failed."""
    from tests.support.redis_servers import RedisServer, free_ports, redis_available

    if not redis_available():
        pytest.fail("redis-server not found: apt-get install redis-server (scripts/test.sh does)")
    redis = RedisServer(tmp_path / "redis", free_ports(1)[0]).start()
    try:
        d = daemon_factory("--pool-size", "16MiB", "--remote", redis.url)
        client = connect(d.target, "remote-status-test")
        try:
            eng = Engine(
                client,
                Geometry(
                    groups=[[4096, 4096]], world_size=1, num_blocks=128, namespace="remote-status"
                ),
                0,
            )
            store(eng, range(0, 2))
            up = status_json(d.socket_path, "--interval", "0")["remote"]
            assert up["remote_enabled"] and up["remote_healthy"], up
            screen = status("--socket", d.socket_path, "--interval", "0").stdout
            assert re.search(r"^remote\s+healthy\s*$", screen, re.M), screen

            redis.kill()
            deadline, chunk = time.monotonic() + 30, 2
            while status_json(d.socket_path, "--interval", "0")["remote"]["remote_healthy"]:
                assert time.monotonic() < deadline, "the tier's death never showed"
                store(eng, range(chunk, chunk + 1))  # a write to the tier fails
                chunk += 1
                time.sleep(0.2)
            screen = status("--socket", d.socket_path, "--interval", "0").stdout
            assert re.search(r"^remote\s+DOWN: not answering", screen, re.M), screen
            assert status_json(d.socket_path, "--interval", "0")["remote"]["remote_errors"] >= 1
        finally:
            client.close()
    finally:
        redis.kill()


def test_recovery_after_a_crash(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """A --pool-file daemon killed and started again: the screen says how many blocks
    its journal listed and how many were verified and served again."""
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(tmp_path / "kvdepot.pool"))
    client = connect(d.target, "recovery-test")
    try:
        store(
            Engine(
                client,
                Geometry(
                    groups=[[4096]],
                    blocks_per_chunk=1,
                    world_size=1,
                    num_blocks=64,
                    namespace="recovery",
                ),
                0,
            ),
            range(0, 6),
        )
    finally:
        client.close()
    d.restart()  # SIGKILL, then a new daemon on the same pool file
    deadline = time.monotonic() + 30
    while not (rec := status_json(d.socket_path, "--interval", "0")["recovery"])[
        "recovery_complete"
    ]:
        assert time.monotonic() < deadline, rec
        time.sleep(0.2)
    assert rec["recovery_blocks_total"] == 6, rec
    verified = rec["recovery_blocks_verified"]
    assert verified + rec["recovery_blocks_rejected"] == 6
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert f"{verified} of 6 blocks verified and served again" in screen, screen
    assert "(done)" in screen


def test_probe(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    d = daemon_factory("--pool-size", "16MiB")
    assert status("--socket", d.socket_path, "--probe").returncode == 0
    assert "no such socket" in one_line_error(status("--socket", str(tmp_path / "x"), "--probe"))


def test_client_side_does_not_import_rich() -> None:
    code = "import sys, kvdepot.client; assert 'rich' not in sys.modules, 'rich imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- failures: one line each ----------------------------------------------------------------


def test_missing_socket(tmp_path: Path) -> None:
    line = one_line_error(status("--socket", str(tmp_path / "kvdepot.sock")))
    assert "no such socket" in line and "KVDEPOT_SOCKET" in line


def test_stale_socket_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "kvdepot.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: what a killed daemon leaves behind
    line = one_line_error(status("--socket", path))
    assert "connection refused" in line and "no daemon listens" in line


def test_not_a_socket(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    assert "not a socket" in one_line_error(status("--socket", str(tmp_path / "file")))


def test_other_grpc_server_is_not_a_kvdepot_daemon(tmp_path: Path) -> None:
    """A gRPC server with only the health service: UNIMPLEMENTED on Admin."""
    path = str(tmp_path / "other.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        line = one_line_error(status("--socket", path))
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
        line = one_line_error(status("--socket", path, "--timeout", "3"))
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
    """A user outside the socket's group is told which group to join. As root, the
    command runs as nobody (root may connect to any socket); otherwise the socket is
    made unconnectable for its owner (mode 000)."""
    import grp

    root = os.geteuid() == 0
    if root and shutil.which("setpriv") is None:
        pytest.fail("setpriv not found: install Debian's util-linux")
    # A directory every user may enter: pytest's own temporary root is private to root.
    workdir = Path(tempfile.mkdtemp(prefix="kvd-perm-", dir="/tmp"))
    os.chmod(workdir, 0o755)
    d = DaemonProcess(workdir, "--pool-size", "16MiB", "--socket-mode", "660" if root else "0")
    try:
        d.start()
        group = grp.getgrgid(os.stat(d.socket_path).st_gid).gr_name
        out = status("--socket", d.socket_path, user="nobody" if root else None)
        line = one_line_error(out)
        assert "permission denied" in line and f"join the group {group}" in line, line
        assert status("--socket", d.socket_path, "--interval", "0").returncode == (0 if root else 1)
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


# --- watch mode in a real terminal ---------------------------------------------------------


class Tmux:
    """A private tmux server (its own socket name) with one 80-column window."""

    def __init__(self, command: list[str]) -> None:
        tool = shutil.which("tmux")
        if tool is None:
            pytest.fail("tmux not found: apt-get install tmux (scripts/test.sh installs it)")
        self.base = [tool, "-L", f"kvd-status-{os.getpid()}", "-f", "/dev/null"]
        # The pane's size must come from the terminal: a LINES or COLUMNS inherited from
        # this process (some imports export them) would override it.
        self.env = {k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")}
        # The command as separate arguments, which tmux runs directly (no sh -c): the
        # pane's process is the command, and Ctrl-C reaches only it.
        self.run("new-session", "-d", "-x", str(WIDTH), "-y", "60", "-s", "w", *command)
        self.run("set-option", "-t", "w", "remain-on-exit", "on")

    def run(self, *args: str) -> str:
        return subprocess.run(
            [*self.base, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=20,
            env=self.env,
        ).stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "w")

    def wait_for(self, predicate: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                size = self.run(
                    "display-message", "-p", "-t", "w", "#{window_width}x#{window_height}"
                ).strip()
                raise AssertionError(f"the screen ({size}) never showed {what}:\n{text}")
            time.sleep(0.2)

    def exit_status(self) -> int | None:
        """The command's exit status once it has exited, else None. tmux records it when
        it reaps the process, which it sometimes does late: until then the kernel has
        it, in the zombie's /proc/PID/stat (exit_code, the last field)."""
        fmt = "#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_pid}"
        dead, status, sig, pid = (
            self.run("display-message", "-p", "-t", "w", fmt).strip().split("|")
        )
        if dead != "1":
            return None
        if status or sig:
            return int(status) if status else -int(sig)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return None  # reaped a moment ago: tmux has it now
        return os.waitstatus_to_exitcode(int(fields[-1])) if fields[0] == "Z" else None

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=20)


def test_watch_in_tmux_follows_the_daemon(guide_daemon: DaemonProcess) -> None:
    """Redraws with new state, shows the daemon's death in words, picks up the restarted
    daemon, and quits on Ctrl-C with status 0."""
    d = guide_daemon
    cmd = [*kvdepot_command(), "status", "--watch", "--interval", "0.3", "--socket", d.socket_path]
    tmux = Tmux(cmd)
    try:
        ch, stub = admin(d)
        with ch:
            boot = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).boot_id
        text = tmux.wait_for(lambda t: "11 ready" in t and "engine-b" in t, "the first state")
        assert boot in text and f"{os.getpid()}" in text

        # New blocks show up on the next redraw.
        client = connect(d.target, "engine-c (watch test)")
        try:
            geo = Geometry(
                groups=[[4096]],
                blocks_per_chunk=1,
                world_size=1,
                num_blocks=64,
                namespace="watch-test",
            )
            store(Engine(client, geo, 0), range(0, 5))
            tmux.wait_for(
                lambda t: "16 ready" in t and "engine-c (watch test)" in t,
                "five new blocks and the third engine",
            )
        finally:
            client.close()

        d.kill()
        text = tmux.wait_for(lambda t: "connection refused" in t, "the daemon gone")
        assert "retrying" in text
        d.start()
        with d.channel() as ch2:
            from kvdepot.v1 import admin_pb2_grpc

            new_boot = (
                admin_pb2_grpc.AdminStub(ch2)
                .GetStats(admin_pb2.GetStatsRequest(), timeout=10)
                .boot_id
            )
        assert new_boot != boot
        tmux.wait_for(
            lambda t: new_boot in t and "connection refused" not in t, "the restarted daemon"
        )

        tmux.run("send-keys", "-t", "w", "C-c")

        tmux.wait_for(lambda _: tmux.exit_status() is not None, "the command's exit")
        assert tmux.exit_status() == 0, tmux.screen()
    finally:
        tmux.close()


def _stats_class(add: dict[str, int], drop: Iterable[str] = ()) -> Any:
    """GetStatsResponse as another daemon version would have it: fields added (name ->
    FieldDescriptorProto type) and dropped, in a descriptor pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto()
    admin_pb2.DESCRIPTOR.CopyToProto(proto)
    (msg,) = [m for m in proto.message_type if m.name == "GetStatsResponse"]
    kept = [f for f in msg.field if f.name not in set(drop)]
    del msg.field[:]
    msg.field.extend(kept)
    for number, (name, kind) in enumerate(add.items(), start=9000):
        msg.field.add(
            name=name,
            number=number,
            type=kind,  # type: ignore[arg-type]
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kvdepot.v1.GetStatsResponse")
    )


def test_older_daemon_without_job_and_pin_counters(guide_daemon: DaemonProcess) -> None:
    """A daemon that predates the job, block and pin counters: shown without them."""
    from rich.console import Console

    from kvdepot.server.status import render
    from kvdepot.server.status_report import OPTIONAL_COUNTERS, Sample, build_report

    older = _stats_class({}, drop=OPTIONAL_COUNTERS)
    ch, stub = admin(guide_daemon)
    with ch:
        first = older.FromString(stub.GetStats(admin_pb2.GetStatsRequest()).SerializeToString())
        time.sleep(0.1)
        second = older.FromString(stub.GetStats(admin_pb2.GetStatsRequest()).SerializeToString())
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(1, second, [], []))
    assert not set(OPTIONAL_COUNTERS) & set(report["totals"])
    assert "pin_keys_per_second" not in report["rates"]
    assert not set(report["other"]) & set(OPTIONAL_COUNTERS) and report["totals"]["stores"] == 4
    console = Console(width=WIDTH)
    with console.capture() as cap:
        console.print(render(report))
    assert "failed jobs" not in cap.get() and "11 ready" in cap.get()


def test_remote_tier_and_unknown_fields(guide_daemon: DaemonProcess) -> None:
    """The remote tier: one line when off; health, rates and trouble when on. Fields a
    newer daemon adds to GetStats reach --json and the screen without this version
    knowing them (GetStatsResponse rebuilt with three more fields, filled from a live
    reading plus values)."""
    from google.protobuf.descriptor_pb2 import FieldDescriptorProto as F
    from rich.console import Console

    from kvdepot.server.status import render
    from kvdepot.server.status_report import Sample, build_report

    def screen(report: dict[str, Any]) -> str:
        console = Console(width=WIDTH)
        with console.capture() as cap:
            console.print(render(report))
        return cap.get()

    off = status_json(guide_daemon.socket_path, "--interval", "0")
    if off["remote"] is not None:  # a daemon with a remote tier, started without one
        assert off["remote"]["remote_enabled"] is False
        assert re.search(r"^remote\s+off\b", screen(off), re.M), screen(off)

    newer = _stats_class(
        {"remote_future_gauge": F.TYPE_BOOL, "remote_future_bytes": F.TYPE_UINT64,
         "future_spill_files": F.TYPE_UINT64}
    )  # fmt: skip
    ch, stub = admin(guide_daemon)
    with ch:
        live = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    first, second = newer.FromString(live.SerializeToString()), newer()
    first.remote_future_gauge, first.remote_future_bytes, first.future_spill_files = True, 5, 7
    second.CopyFrom(first)
    second.uptime_seconds += 2.0
    has_tier = "remote_enabled" in newer.DESCRIPTOR.fields_by_name
    if has_tier:
        for m in (first, second):
            m.remote_enabled = True
        second.remote_writes, second.remote_write_bytes = 8, 8 << 20  # 4/s, 4 MiB/s
        second.remote_hits, second.remote_misses, second.remote_errors = 3, 1, 2
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    # (Containment: the daemon may already send fields this version does not know.)
    assert report["remote"].items() >= {"remote_future_bytes": 5}.items()
    assert report["other"]["future_spill_files"] == 7
    assert report["blocks"]["ready"] == 11  # the known fields as before
    text = screen(report)
    for needle in ("remote_future_bytes 5", "remote_future_gauge True", "future_spill_files 7"):
        assert needle in text, text
    if has_tier:
        assert report["rates"]["remote_writes_per_second"] == 4
        assert "DOWN" in text and "writes 4.0/s 4.0 MiB/s" in text and "75% hit" in text, text
        assert "errors 2" in text
        second.remote_healthy = True
        text = screen(build_report("/x.sock", None, Sample(2, second, [], [])))
        assert re.search(r"^remote\s+healthy\s*$", text, re.M), text


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write-docs")
    raise SystemExit(write_guide_screen())
