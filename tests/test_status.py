"""`kvdepot status` against live daemons: real `kvdepot serve` processes, real engines
storing and loading over shared memory, the real command in a subprocess, and the watch
mode in a real terminal (tmux, 80 columns).

The checks are about content, not layout: the figures the screen and --json show are
the daemon's own (compared with Admin calls made by the test), rates add up to the
traffic the test made, and each kind of failure gets its own one-line message.

This file holds the content against live daemons and the guide's status screen
(`python tests/test_status.py --write-docs` rewrites it); the one-line failures, the
watch mode in tmux and rendering reports of other daemon versions are in
tests/test_status_errors.py, tests/test_status_watch.py and tests/test_status_rendering.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run as a script (--write-docs)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvdepot
from kvdepot.v1 import admin_pb2
from tests.support.daemon import DaemonProcess, connect, kvdepot_command
from tests.support.engine import Engine, Geometry, make_key
from tests.support.faults import DaemonFactory
from tests.support.guide import GEO_A, GEO_B, GUIDE, run_guide_scenario
from tests.support.ops import GEO_M, admin, store
from tests.support.status_cli import WIDTH, one_line_error, status, status_json

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


GUIDE_COMMAND = "$ kvdepot status --socket /run/kvdepot/kvdepot.sock"


def _comparable(screen: str) -> list[str]:
    """The screen without what changes from run to run: boot id, durations, pids (and the
    column widths they set), the event loop's CPU."""
    text = re.sub(r"\b[0-9a-f]{16}\b", "<id>", screen)
    text = re.sub(r"\b\d+(\.\d+)?[smhd]\b( \d+[smh]\b)?", "<t>", text)
    text = re.sub(r"(?<=\s)\d{3,}(?=\s)", "<n>", text)  # pids; sizes all have decimals
    text = re.sub(r"\d+% of a core", "<p>% of a core", text)  # the loop's own CPU
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
    geo = dataclasses.replace(GEO_M, namespace="rates-test")
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
    from kvdepot.server.status.command import add_status_arguments

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


def test_operator_socket_by_flag_and_environment(daemon_factory: DaemonFactory, tmp_path) -> None:
    """status reads Admin on the operator socket: the --socket path + .admin, or the one
    --admin-socket / KVDEPOT_ADMIN_SOCKET names (as for serve)."""
    admin_path = str(tmp_path / "ops.sock")
    d = daemon_factory("--pool-size", "16MiB", "--admin-socket", admin_path)
    for args, env in (
        (("--admin-socket", admin_path), {}),
        ((), {"KVDEPOT_ADMIN_SOCKET": admin_path}),
    ):
        out = status("--socket", d.socket_path, "--json", "--interval", "0", *args, env=env)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["socket"], report["admin_socket"]) == (d.socket_path, admin_path)
    # Derived from --socket, the operator socket is not there: one line that names it.
    line = one_line_error(status("--socket", d.socket_path, "--interval", "0"))
    assert f"{d.socket_path}.admin: no such socket" in line, line


def test_remote_tier_health_live(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """A daemon with a real remote tier (redis-server): healthy while it answers, DOWN
    (in words, and in --json) once the server is killed and a write has failed."""
    from tests.support.fleet_key import shared_key_args
    from tests.support.redis_servers import RedisServer, free_ports, redis_available

    if not redis_available():
        pytest.fail("redis-server not found: apt-get install redis-server (scripts/test.sh does)")
    redis = RedisServer(tmp_path / "redis", free_ports(1)[0]).start()
    try:
        d = daemon_factory("--pool-size", "16MiB", "--remote", redis.url, *shared_key_args())
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write-docs")
    raise SystemExit(write_guide_screen())
