"""Runs a real `kvdepot serve` process for tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def kvdepot_command() -> list[str]:
    exe = shutil.which("kvdepot", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "kvdepot.server.cli"]


class DaemonProcess:
    """A daemon on a temporary Unix socket. `target` is the engines' gRPC target (Depot,
    health); `admin_target` the operators' (Admin), served on a socket of its own."""

    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.socket_path = str(workdir / "kvdepot.sock")
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "daemon.log"
        self.starts = 0

    @property
    def target(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def admin_socket_path(self) -> str:
        """`--admin-socket` when the test gave one, else the daemon's default beside the
        data socket."""
        if "--admin-socket" in self.args:
            return self.args[self.args.index("--admin-socket") + 1]
        return self.socket_path + ".admin"

    @property
    def admin_target(self) -> str:
        return f"unix://{self.admin_socket_path}"

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(
            [*kvdepot_command(), "serve", "--socket", self.socket_path, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        log.close()
        self.wait_serving(timeout)
        return self

    def wait_serving(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvdepot exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket_path):
                try:
                    with grpc.insecure_channel(self.target) as ch:
                        resp = health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=1.0
                        )
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"kvdepot did not serve within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: a clean shutdown."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
        return self.proc.returncode

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()

    def channel(self) -> grpc.Channel:
        """The engines' channel: Depot and health (Admin answers PERMISSION_DENIED)."""
        return grpc.insecure_channel(self.target)

    def admin_channel(self) -> grpc.Channel:
        """The operators' channel: Admin and health."""
        return grpc.insecure_channel(self.admin_target)
