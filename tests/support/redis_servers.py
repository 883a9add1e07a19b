"""Real Redis servers for the remote-tier tests: Debian's `redis-server` and
`redis-cli` (scripts/test.sh installs them), on loopback ports.

`RedisServer` is one process; `RedisClusterProcs` is three masters joined with
`redis-cli --cluster create`. Both can be killed (SIGKILL) and started again on
the same ports, as an operator's restart would; a restarted cluster node reads its
nodes.conf and rejoins with its slots (empty: no persistence).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def redis_available() -> bool:
    return bool(shutil.which("redis-server") and shutil.which("redis-cli"))


def require_redis() -> None:
    if not redis_available():
        pytest.skip("redis-server/redis-cli not installed (scripts/test.sh installs them)")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """n free loopback ports (and port+10000 free too, for a cluster's bus)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p in ports or p + 10000 > 65535 or (bus and not _free(p + 10000)):
            continue
        ports.append(p)
    return ports


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout.strip()


class RedisServer:
    def __init__(self, workdir: Path, port: int, *extra: str) -> None:
        self.workdir = workdir
        self.port = port
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--protected-mode",
                "no",
                *self.extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while not any(w in cli(self.port, "PING") for w in ("PONG", "NOAUTH")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()  # never leave a half-started server behind
                raise RuntimeError(
                    f"redis-server on {self.port} did not start:\n"
                    + (self.workdir / "redis.log").read_text()
                )
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisClusterProcs:
    """Three masters (and `replicas` replicas each), slots spread by
    `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0) -> None:
        self.replicas = replicas
        ports = free_ports(masters * (1 + replicas), bus=True)
        self.nodes = [
            RedisServer(
                workdir / f"n{p}",
                p,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                # Replicas sync at once, and fail over however stale they are.
                "--repl-diskless-sync-delay",
                "0",
                "--cluster-replica-validity-factor",
                "0",
            )
            for p in ports
        ]

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def seed_url(self) -> str:
        """One seed only: the rest is discovered."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterProcs:
        try:
            return self._start()
        except BaseException:
            self.kill_all()  # never leave a half-built cluster behind
            raise

    def _start(self) -> RedisClusterProcs:
        for n in self.nodes:
            n.start()
        out = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}{out.stderr}")
        self.wait_ok()
        deadline = time.monotonic() + 30
        while self.replicas and not all(  # every replica in sync with its master
            "master_link_status:up" in cli(n.port, "INFO", "replication")
            for n in self.nodes
            if "role:slave" in cli(n.port, "INFO", "replication")
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the replicas did not sync")
            time.sleep(0.1)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            if all("cluster_state:ok" in cli(n.port, "CLUSTER", "INFO") for n in live):
                return
            time.sleep(0.1)
        raise TimeoutError("the cluster did not reach cluster_state:ok")

    def restart_all(self) -> None:
        """Starts every stopped node again (nodes.conf brings the slots back)."""
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                n.start()
        self.wait_ok()

    def kill_all(self) -> None:
        for n in self.nodes:
            n.kill()

    def masters(self) -> list[RedisServer]:
        """The nodes that are masters now (a failover changes them)."""
        out = []
        live = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        for line in cli(live.port, "CLUSTER", "NODES").splitlines():
            f = line.split()
            if "master" in f[2] and "fail" not in f[2]:
                port = int(f[1].split("@")[0].rsplit(":", 1)[1])
                out += [n for n in self.nodes if n.port == port]
        return out

    def node_of(self, key: bytes) -> RedisServer:
        """The master serving `key`'s slot."""
        slot = int(cli(self.nodes[0].port, "CLUSTER", "KEYSLOT", key.decode("latin-1")))
        for line in cli(self.nodes[0].port, "CLUSTER", "NODES").splitlines():
            f = line.split()
            if "master" not in f[2]:
                continue
            for rng in f[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    port = int(f[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot}")
