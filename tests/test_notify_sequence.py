"""systemd notify from a real `kvdepot serve`: READY=1 only once the gRPC socket accepts,
WATCHDOG=1 keeps coming, STATUS= about the pool warm-up, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.daemon import kvdepot_command
from tests.support.ops import HEALTH


@dataclass
class Datagram:
    text: str
    at: float  # monotonic receipt time
    socket_existed: bool  # the gRPC socket file existed when it arrived

    @property
    def fields(self) -> list[str]:
        return self.text.split("\n")


def test_systemd_notify_sequence() -> None:
    """NOTIFY_SOCKET is a datagram socket this test binds; WATCHDOG_USEC=200000 with no
    WATCHDOG_PID. READY=1 comes only once the gRPC socket accepts (connected to the
    moment READY=1 arrives, without retrying), nothing claims "serving" before it,
    WATCHDOG=1 keeps coming every ~0.1 s, STATUS= tells the pool warm-up, and SIGTERM
    brings STOPPING=1, after which no keep-alive follows and the daemon exits 0."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-ops-"))  # short: AF_UNIX paths <= 108 bytes
    notify_path = str(workdir / "notify")
    sock_path = str(workdir / "kvdepot.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    log_path = workdir / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*kvdepot_command(), "serve", "--socket", sock_path, "--pool-size", "64MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    got: list[Datagram] = []

    def receive(timeout: float) -> Datagram:
        listener.settimeout(timeout)
        data = listener.recv(4096)
        dg = Datagram(data.decode(), time.monotonic(), os.path.exists(sock_path))
        got.append(dg)
        return dg

    def until(pred: Callable[[Datagram], bool], timeout: float, what: str) -> Datagram:
        """The next datagram that satisfies `pred` (earlier ones are kept in `got`)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, (
                f"no {what} within {timeout}s; got {[g.text for g in got]}\n"
                f"{log_path.read_text(errors='replace')}"
            )
            try:
                dg = receive(min(left, 0.5))
            except TimeoutError:
                # Only once the queue is empty: a daemon that exited may have left some.
                assert proc.poll() is None, f"daemon exited {proc.returncode} before {what}"
                continue
            if pred(dg):
                return dg

    try:
        ready = until(lambda dg: "READY=1" in dg.fields, 30, "READY=1")
        # Now, with no retry: the socket exists, accepts, and gRPC health answers.
        assert ready.socket_existed
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(sock_path)
        with grpc.insecure_channel(f"unix://{sock_path}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert status.status == HEALTH.SERVING
        before = got[:-1]
        assert not any("WATCHDOG=1" in g.fields for g in before), "keep-alive before READY=1"
        assert not any(f.startswith("STATUS=serving") for g in before for f in g.fields)

        # Keep-alives keep coming; the warm-up status reaches 100% while serving.
        keepalives: list[float] = []
        deadline = time.monotonic() + 20
        while len(keepalives) < 8 or not any(
            "STATUS=serving; pool warm-up 100%" in g.fields for g in got
        ):
            assert time.monotonic() < deadline, [g.text for g in got]
            dg = until(lambda dg: True, 5, "datagram")
            if "WATCHDOG=1" in dg.fields:
                keepalives.append(dg.at)
        gaps = [b - a for a, b in itertools.pairwise(keepalives)]
        assert 0.03 < sum(gaps) / len(gaps) < 0.3, gaps  # every 0.1 s, give or take
        assert all(
            f.startswith("STATUS=") and "pool warm-up" in f
            for g in got
            for f in g.fields
            if f.startswith("STATUS=")
        )

        proc.send_signal(signal.SIGTERM)
        stopping = until(lambda dg: "STOPPING=1" in dg.fields, 20, "STOPPING=1")
        assert proc.wait(timeout=20) == 0, log_path.read_text(errors="replace")
        listener.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(Datagram(listener.recv(4096).decode(), time.monotonic(), False))
        after = got[got.index(stopping) + 1 :]
        assert not any("WATCHDOG=1" in g.fields for g in after), [g.text for g in after]
        assert not os.path.exists(sock_path), "the socket outlived the daemon"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)
