"""A real `kvdepot serve` process on a Unix socket of its own: started, watched,
stopped. The one daemon wrapper of the test suite (tests/support/daemon.py) and of
`kvdepot bench` (kvdepot.bench.daemon), and the one way both read Admin/GetStats.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import grpc

from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc


def kvdepot_command() -> list[str]:
    """The `kvdepot` of this interpreter's environment (or the module, if not on PATH);
    TESTS_KVDEPOT_COMMAND replaces it (e.g. another tree's daemon, to run the security
    tests' attacks against the code before a fix)."""
    if other := os.environ.get("TESTS_KVDEPOT_COMMAND"):
        return shlex.split(other)
    exe = shutil.which("kvdepot", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "kvdepot.server.cli"]


class HasAdminTarget(Protocol):
    @property
    def admin_target(self) -> str: ...


def stats(
    of: str | HasAdminTarget | admin_pb2_grpc.AdminStub, timeout: float = 5.0
) -> admin_pb2.GetStatsResponse:
    """Admin/GetStats of a daemon. `of` is its operator socket's gRPC target, anything
    with an `admin_target` (a ServeProcess, a DepotClient, the bench's daemons) or an
    Admin stub. (INTERNAL here: a debug daemon found a broken invariant.)"""
    request = admin_pb2.GetStatsRequest()
    if isinstance(of, admin_pb2_grpc.AdminStub):
        return of.GetStats(request, timeout=timeout)
    target = of if isinstance(of, str) else of.admin_target
    with grpc.insecure_channel(target) as ch:
        return admin_pb2_grpc.AdminStub(ch).GetStats(request, timeout=timeout)


class ServeProcess:
    """`kvdepot serve --socket WORKDIR/kvdepot.sock ARGS` (`command` replaces
    `kvdepot`: a launcher script that wires something in first). `target` is the
    engines' gRPC target (Depot, health); `admin_target` the operators' (Admin),
    served on a socket of its own. The log is WORKDIR/daemon.log, kept across starts."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.socket_path = str(self.workdir / "kvdepot.sock")
        self.args = list(args)
        # Never the caller's service manager's business: no NOTIFY_SOCKET unless `env` says so.
        base = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        self.env = {**base, **(env or {})}
        self.command = list(command) if command else kvdepot_command()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "daemon.log"
        self.starts = 0

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def admin_socket_path(self) -> str:
        """`--admin-socket` when given, else the daemon's default beside the data socket."""
        if "--admin-socket" in self.args:
            return self.args[self.args.index("--admin-socket") + 1]
        return self.socket_path + ".admin"

    @property
    def admin_target(self) -> str:
        return f"unix://{self.admin_socket_path}"

    def launch(self) -> ServeProcess:
        """Starts the process without waiting for it to serve."""
        self.starts += 1
        with open(self.log_path, "ab") as log:  # the child has its own copy of the fd
            self.proc = subprocess.Popen(
                [*self.command, "serve", "--socket", self.socket_path, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self

    def start(self, timeout: float = 20.0) -> ServeProcess:
        self.launch()
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 20.0) -> None:
        """Until the health service on the data socket says SERVING."""
        wait_for(
            self._serving,
            timeout,
            f"kvdepot to serve on {self.socket_path}",
            interval=0.05,
            detail=self.log,
        )

    def _serving(self) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # the daemon's extra

        self.check_alive()
        if not os.path.exists(self.socket_path):
            return False
        try:
            with grpc.insecure_channel(self.target) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def check_alive(self) -> None:
        """RuntimeError, with the log, if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"kvdepot exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first match of `pattern` in the log, once it is there."""
        return wait_for(
            lambda: re.search(pattern, self.log()),
            timeout,
            f"{pattern!r} in the daemon log",
            interval=0.05,
            detail=self.log,
        )

    def stats(self, timeout: float = 5.0) -> admin_pb2.GetStatsResponse:
        return stats(self.admin_target, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: a clean shutdown. One that takes longer than `timeout` is
        SIGKILLed and raises subprocess.TimeoutExpired."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise
        return self.proc.returncode

    def restart(self) -> ServeProcess:
        self.kill()
        return self.start()

    def channel(self) -> grpc.Channel:
        """The engines' channel: Depot and health (Admin answers PERMISSION_DENIED)."""
        return grpc.insecure_channel(self.target)

    def admin_channel(self) -> grpc.Channel:
        """The operators' channel: Admin and health."""
        return grpc.insecure_channel(self.admin_target)
