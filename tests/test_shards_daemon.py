"""`kvdepot serve --shards N`, from the outside: real processes, real sockets, real
signals. What an operator checks: every shard answers on its own socket with its share
of the pool and says which shard it is; SIGTERM stops them all cleanly; a shard that
dies takes the others down (systemd restarts the lot) and a supervisor that dies leaves
no shard behind; settings that cannot be split are refused in one line. And
`shard_config`, which decides each shard's settings, tested directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.common.shards import shard_socket
from kvdepot.server.config import ServeConfig
from kvdepot.server.shards import MIN_SHARD_POOL_BYTES, shard_config
from kvdepot.testing.waiting import wait_for
from tests.support.daemon import DaemonProcess, connect, kvdepot_command, stats
from tests.support.faults import DaemonFactory
from tests.support.notify import NotifyListener
from tests.support.ops import free_port

MiB = 1 << 20


def _shard_pids(d: DaemonProcess, n: int) -> list[int]:
    """The shards' pids, as the supervisor logs them when it starts them."""
    pids = []
    for i in range(n):
        m = d.wait_log(rf"shard {i}/{n} started \(pid (\d+)\)", timeout=20)
        pids.append(int(m.group(1)))
    return pids


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody has reaped yet counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] not in ("Z", "X")


def _serving(target: str) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=1.0
            )
    except grpc.RpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _start_two(daemon_factory: DaemonFactory, *args: str) -> tuple[DaemonProcess, list[str]]:
    """A daemon of two shards (64 MiB between them); the shards' data sockets."""
    d = daemon_factory("--shards", "2", "--pool-size", "64MiB", *args)  # shard 0 serves
    sockets = [shard_socket(d.socket_path, i) for i in range(2)]
    wait_for(
        lambda: d.check_alive() or _serving(f"unix://{sockets[1]}"),
        20,
        "shard 1 to serve",
        detail=d.log,
    )
    return d, sockets


# --- real processes -----------------------------------------------------------------------


def test_two_shards_each_serve_half_the_pool_on_their_own_sockets(
    daemon_factory: DaemonFactory,
) -> None:
    d, sockets = _start_two(daemon_factory)
    assert sockets[1] == d.socket_path + ".shard1"
    for i, path in enumerate(sockets):
        client = connect(f"unix://{path}", f"shard-test {i}")
        try:
            hello = client.hello
            assert hello is not None
            assert (hello.shard, hello.shard_count) == (i, 2)
            assert hello.pool_capacity_bytes == 32 * MiB
            assert hello.fd_socket == path + ".fd"
        finally:
            client.close()
        s = stats(f"unix://{path}.admin")
        assert (s.shard, s.shard_count, s.capacity_bytes) == (i, 2, 32 * MiB)
    # Two processes, two pools: each shard's boot id is its own.
    assert (
        stats(f"unix://{sockets[0]}.admin").boot_id != stats(f"unix://{sockets[1]}.admin").boot_id
    )
    # Each shard's log lines say which shard they come from.
    assert re.search(r"shard 1/2 kvdepot: serving on unix:\S+\.shard1 ", d.log()), d.log()
    # `kvdepot status` of a shard names it, and how to read the others.
    out = subprocess.run(
        [*kvdepot_command(), "status", "--socket", sockets[1], "--interval", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "shard 1 of 2" in out.stdout, out.stdout
    assert f"the others: kvdepot status --socket {sockets[0]}\n" in out.stdout, out.stdout
    # The node's view: a row per shard, each with its half of the pool, and the sum.
    rows = [
        ln.split()
        for ln in out.stdout.splitlines()
        if re.match(r"\s*(0|1 \*|node)\s+\S+ \S+ of ", ln)
    ]
    assert [r[0] for r in rows] == ["0", "1", "node"], out.stdout
    assert rows[0][1:5] == ["0", "B", "of", "32.0"] and rows[2][-2:] == ["64.0", "MiB"], rows
    # Each shard's event loop, its share of a core since it started (one reading).
    assert "loop busy" in out.stdout and "share of a core since the shard started" in out.stdout
    assert all(re.fullmatch(r"\d+%", r[-1]) for r in rows[:2]), rows
    as_json = subprocess.run(
        [*kvdepot_command(), "status", "--socket", sockets[0], "--interval", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    shards = json.loads(as_json.stdout)["shards"]
    assert [(s["shard"], s["capacity_bytes"]) for s in shards] == [(0, 32 * MiB), (1, 32 * MiB)]
    assert shards[0]["boot_id"] != shards[1]["boot_id"]
    assert all(s["loop"]["over"] == "since start" for s in shards), shards
    assert all(0 < s["loop"]["busy_fraction"] < 1 for s in shards), shards


def test_status_watch_shows_every_shard_at_every_reading(
    daemon_factory: DaemonFactory,
) -> None:
    """`kvdepot status --watch --json` on shard 1: every reading carries the node's
    table, both shards with their half of the pool, and an engine that attaches to
    shard 0 meanwhile shows up in a later reading's row, each shard's event loop then
    read over the interval since the reading before."""
    _, sockets = _start_two(daemon_factory)
    args = ["status", "--watch", "--json", "--interval", "0.3", "--socket", sockets[1]]
    watch = subprocess.Popen(
        [*kvdepot_command(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = json.loads(watch.stdout.readline())
        assert first["daemon"]["shard"] == 1
        rows = first["shards"]
        assert [(r["shard"], r["capacity_bytes"]) for r in rows] == [(0, 32 * MiB), (1, 32 * MiB)]
        assert rows[0]["sessions"] == 0
        with contextlib.closing(connect(f"unix://{sockets[0]}", "engine-on-shard-0")):
            deadline = time.monotonic() + 20
            while True:
                reading = json.loads(watch.stdout.readline())
                if reading["shards"][0]["sessions"] == 1:
                    break
                assert time.monotonic() < deadline, reading["shards"]
            assert reading["shards"][1]["sessions"] == 0  # shard 1's own figures
            # From the second reading on, each shard's loop over the interval between.
            assert [r["loop"]["over"] for r in reading["shards"]] == ["interval"] * 2
    finally:
        watch.send_signal(signal.SIGINT)
        try:
            watch.wait(10)
        finally:
            watch.kill()
            watch.stdout.close()
            watch.stderr.close()
    assert watch.returncode == 0


def test_each_shard_serves_its_metrics_on_its_own_port(daemon_factory: DaemonFactory) -> None:
    port = free_port()
    _start_two(daemon_factory, "--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    for i in range(2):
        url = f"http://127.0.0.1:{port + i}/metrics"
        text = wait_for(lambda u=url: _scrape(u), 20, f"shard {i}'s metrics")
        info = next(line for line in text.splitlines() if line.startswith("kvdepot_build_info"))
        assert f'shard="{i}"' in info and 'shards="2"' in info, info
        assert f"kvdepot_pool_capacity_bytes {32 * MiB:.7e}" in text, text


def _scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def test_sigterm_stops_every_shard_and_removes_their_sockets(
    daemon_factory: DaemonFactory,
) -> None:
    d, sockets = _start_two(daemon_factory)
    pids = _shard_pids(d, 2)
    assert all(_alive(p) for p in pids)
    assert d.stop(timeout=40) == 0, d.log()
    assert not any(_alive(p) for p in pids), d.log()
    for path in sockets:
        for suffix in ("", ".fd", ".admin"):
            assert not os.path.exists(path + suffix), f"{path + suffix} outlived the daemon"
    assert "shard 0/2 kvdepot: stopped; sockets removed" in d.log()
    assert "shard 1/2 kvdepot: stopped; sockets removed" in d.log()


def test_a_shard_that_dies_stops_the_others_and_the_supervisor_fails(
    daemon_factory: DaemonFactory,
) -> None:
    d, _ = _start_two(daemon_factory)
    pids = _shard_pids(d, 2)
    os.kill(pids[1], signal.SIGKILL)
    assert d.proc is not None
    code = d.proc.wait(timeout=15)
    assert code not in (0, None), d.log()  # non-zero: systemd's Restart=on-failure
    assert "shard 1 was killed by SIGKILL; stopping the other shards" in d.log(), d.log()
    wait_for(lambda: not _alive(pids[0]), 10, "shard 0 to stop", detail=d.log)


def test_a_killed_supervisor_leaves_no_shard_behind(daemon_factory: DaemonFactory) -> None:
    d, sockets = _start_two(daemon_factory)
    pids = _shard_pids(d, 2)
    d.kill()  # SIGKILL: the supervisor cannot forward anything
    wait_for(
        lambda: not any(_alive(p) for p in pids), 15, "the orphaned shards to exit", detail=d.log
    )
    # They stopped as on SIGTERM (the parent-death signal), removing their sockets.
    assert not any(os.path.exists(p) for p in sockets), d.log()


def test_a_shard_that_cannot_start_stops_the_others_with_exit_2(
    daemon_factory: DaemonFactory,
) -> None:
    # Shard 1's socket path is taken by a plain file: that shard refuses to start.
    d = daemon_factory("--shards", "2", "--pool-size", "64MiB", start=False)
    Path(d.socket_path + ".shard1").write_text("not a socket")
    d.launch()
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2, d.log()
    assert re.search(r"shard 1 exited with code 2; stopping the other shards", d.log()), d.log()
    pids = _shard_pids(d, 2)
    assert not any(_alive(p) for p in pids)


def test_with_a_disk_tier_every_shard_has_a_private_directory_and_its_share(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    pytest.importorskip("blake3")
    disk = tmp_path / "disk"  # missing: created 0700, as for one shard
    d, sockets = _start_two(daemon_factory, "--disk", str(disk), "--disk-size", "64MiB")
    assert stat.S_IMODE(disk.stat().st_mode) == 0o700
    for i, path in enumerate(sockets):
        s = stats(f"unix://{path}.admin")
        assert 31 * MiB < s.disk_capacity_bytes <= 32 * MiB, s  # half, less its header
        assert stat.S_IMODE((disk / f"shard{i}").stat().st_mode) == 0o700
    assert d.stop(timeout=40) == 0, d.log()


def test_the_supervisor_alone_tells_systemd_ready_watchdog_and_stopping(
    daemon_factory: DaemonFactory,
) -> None:
    """Every datagram comes from the supervisor's pid (the unit's NotifyAccess=main):
    READY=1 once both shards' sockets accept; STATUS= names each shard; WATCHDOG=1
    keeps coming; SIGTERM brings STOPPING=1, and exit 0."""
    d = daemon_factory("--shards", "2", "--pool-size", "64MiB", start=False)
    notify = NotifyListener(d)
    try:
        d.launch()
        notify.until("READY=1", 30)
        for i in range(2):  # accepting now, without a retry
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(shard_socket(d.socket_path, i))
        notify.until("WATCHDOG=1", 5)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1", 20)
        assert d.proc.wait(timeout=40) == 0, d.log()
        assert notify.senders() == {d.proc.pid}, notify.got
        statuses = [f for _, fields in notify.got for f in fields if f.startswith("STATUS=")]
        assert any("shard 0:" in s and "shard 1:" in s for s in statuses), statuses
    finally:
        notify.sock.close()


def test_a_shard_whose_loop_stops_is_ended_and_takes_the_others_down(
    daemon_factory: DaemonFactory,
) -> None:
    """A shard that sends no keep-alive for the watchdog timeout (here: stopped with
    SIGSTOP) is aborted, then killed; the supervisor then stops the other one and fails."""
    d = daemon_factory("--shards", "2", "--pool-size", "64MiB", start=False)
    notify = NotifyListener(d)
    d.launch()
    pids = _shard_pids(d, 2)
    try:
        notify.until("READY=1", 30)
        notify.until("WATCHDOG=1", 5)
        os.kill(pids[1], signal.SIGSTOP)
        assert d.proc is not None
        wait_for(
            lambda: notify.drain() or d.proc.poll() is not None,
            30,
            "the supervisor to exit",
            detail=d.log,
        )
        assert d.proc.returncode not in (0, None), d.log()
        assert "shard 1 sent no watchdog keep-alive" in d.log(), d.log()
        assert re.search(r"shard 1 was killed by SIG(ABRT|KILL)", d.log()), d.log()
        assert not any(_alive(p) for p in pids), d.log()
    finally:
        notify.sock.close()
        for pid in pids:  # a stopped process ignores SIGTERM: never leave one behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- bad settings: one line naming the flag, exit 2 ---------------------------------------


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--shards", "0"], "argument --shards:"),
        (["--shards", "65"], "argument --shards:"),
        (["--shards", "2", "--listen", "127.0.0.1:7470"], "--listen"),
        (["--shards", "4", "--pool-size", "32MiB"], "--pool-size"),
    ],
)
def test_settings_that_cannot_be_split_are_refused_in_one_line(
    tmp_path: Path, args: list[str], named: str
) -> None:
    out = subprocess.run(
        [*kvdepot_command(), "serve", "--socket", str(tmp_path / "k.sock"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")},
    )
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("kvdepot serve: error: ") and named in lines[0], lines[0]
    assert not (tmp_path / "k.sock").exists()


# --- shard_config, directly ---------------------------------------------------------------


def _cfg(**kw: object) -> ServeConfig:
    return replace(ServeConfig(socket="/run/k/k.sock", pool_size=1 << 30), **kw)  # type: ignore[arg-type]


def test_one_shard_is_the_config_itself() -> None:
    cfg = _cfg(listen="127.0.0.1:7470", pool_size=1 * MiB)
    assert shard_config(cfg, 0) is cfg


def test_each_shard_gets_its_sockets_and_its_share_of_the_pool() -> None:
    cfg = _cfg(shards=3, pool_size=(1 << 30) + 12345)
    shards = [shard_config(cfg, i) for i in range(3)]
    assert [s.shard for s in shards] == [0, 1, 2]
    assert [s.shards for s in shards] == [3, 3, 3]
    assert [s.socket for s in shards] == [
        "/run/k/k.sock",
        "/run/k/k.sock.shard1",
        "/run/k/k.sock.shard2",
    ]
    # Derived sockets follow the socket.
    assert shards[2].fd_socket == "/run/k/k.sock.shard2.fd"
    assert shards[2].admin_socket_path == "/run/k/k.sock.shard2.admin"
    for s in shards:  # a third, rounded down to whole slots
        assert s.pool_size % cfg.slot_granularity == 0
        assert cfg.pool_size // 3 - cfg.slot_granularity < s.pool_size <= cfg.pool_size // 3
    assert cfg.shard == 0 and cfg.socket == "/run/k/k.sock"  # the input is left alone


def test_named_admin_socket_pool_file_metrics_and_disk_are_split() -> None:
    cfg = _cfg(
        shards=2,
        admin_socket="/run/k/ops.sock",
        pool_file="/dev/shm/k/k.pool",
        metrics_port=9477,
        disk="/var/lib/k/disk",
        disk_size=64 << 30,
    )
    s0, s1 = shard_config(cfg, 0), shard_config(cfg, 1)
    assert (s0.admin_socket_path, s1.admin_socket_path) == (
        "/run/k/ops.sock",
        "/run/k/ops.sock.shard1",
    )
    assert (s0.pool_file, s1.pool_file) == ("/dev/shm/k/k.pool", "/dev/shm/k/k.pool.shard1")
    assert (s0.metrics_port, s1.metrics_port) == (9477, 9478)
    assert (s0.disk, s1.disk) == ("/var/lib/k/disk/shard0", "/var/lib/k/disk/shard1")
    assert s0.disk_size == s1.disk_size == 32 << 30
    # What two processes may share stays as it is.
    assert (s1.metrics_addr, s1.socket_mode, s1.copy_threads, s1.numa) == (
        cfg.metrics_addr,
        cfg.socket_mode,
        cfg.copy_threads,
        cfg.numa,
    )


def test_only_shard_0_publishes_kv_events() -> None:
    cfg = _cfg(shards=3, kv_events="tcp://*:5557")
    assert [shard_config(cfg, i).kv_events for i in range(3)] == ["tcp://*:5557", None, None]


def test_unset_or_any_metrics_port_stays_as_it_is() -> None:
    assert shard_config(_cfg(shards=2), 1).metrics_port is None
    assert shard_config(_cfg(shards=2, metrics_port=0), 1).metrics_port == 0


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"listen": "127.0.0.1:7470"}, "--listen"),
        ({"pool_size": 2 * MIN_SHARD_POOL_BYTES - 1}, "--pool-size"),
        ({"disk": "/d", "disk_size": 16 * MiB}, "--disk-size"),
        ({"metrics_port": 65535}, "--metrics-port"),
    ],
)
def test_settings_that_cannot_be_split_raise_naming_the_flag(
    kw: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(named)) as info:
        shard_config(_cfg(shards=2, **kw), 1)
    assert "--shards 2" in str(info.value) and "\n" not in str(info.value)


def test_a_shard_outside_the_count_is_refused() -> None:
    with pytest.raises(ValueError, match="outside --shards 2"):
        shard_config(_cfg(shards=2), 2)
