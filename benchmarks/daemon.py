"""The daemon under test: one the bench starts itself, or a running one (`--socket`)."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from kvdepot.common.libc import libc
from kvdepot.testing.daemon import ServeProcess, stats
from kvdepot.v1 import admin_pb2


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), to the nanosecond:
    the kernel's CPU-time clock of the process (clock_getcpuclockid). /proc/<pid>/stat
    counts 10 ms ticks, which a short run of a fast daemon read as 0. 0.0 when the
    process is gone."""
    clock = ctypes.c_int()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        return 0.0
    try:
        return time.clock_gettime(clock.value)
    except OSError:  # it exited meanwhile
        return 0.0


def target_of(socket_or_target: str) -> str:
    return socket_or_target if "://" in socket_or_target else f"unix://{socket_or_target}"


def wait_mapped(stats: Callable[[], admin_pb2.GetStatsResponse], timeout: float = 600.0) -> None:
    """Polls `stats` (a GetStats call) until the daemon has populated its mappings of
    the engines' memory (`populating_bytes` 0). That runs in the background after
    RegisterKV; until it ends, copies pay page faults and its CPU time lands in
    whatever is being measured."""
    deadline = time.monotonic() + timeout
    while (st := stats()).populating_bytes:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the daemon still maps {st.populating_bytes} bytes of engine memory "
                f"after {timeout:.0f} s"
            )
        time.sleep(0.1)


def admin_target_of(target: str) -> str:
    """The operator socket (Admin) of the daemon on the Unix socket `target`: the
    daemon's default, the data socket's path + ".admin" (Admin is never on TCP)."""
    if target.startswith("/"):
        target = f"unix://{target}"
    if not target.startswith("unix:"):
        raise ValueError(f"{target}: Admin is served on the daemon's operator socket only")
    return target + ".admin"


class DaemonUnderTest:
    """A daemon reachable at `target` (engines) and `admin_target` (Admin: the operator
    socket); `started` is True when the bench owns it."""

    def __init__(self, target: str, admin_target: str | None = None) -> None:
        self.target = target
        self.admin_target = admin_target or admin_target_of(target)
        self.started = False
        self.log_path: Path | None = None

    def stats(self, timeout: float = 5.0) -> admin_pb2.GetStatsResponse:
        return stats(self.admin_target, timeout)

    def wait_serving(self, timeout: float = 30.0) -> admin_pb2.GetStatsResponse:
        """Polls GetStats until the daemon answers."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                return self.stats(timeout=1.0)
            except grpc.RpcError as exc:
                last = exc
                time.sleep(0.05)
        raise TimeoutError(f"no kvdepot daemon answered at {self.target}: {last}{self._log_tail()}")

    def wait_warm(
        self, timeout: float = 600.0, on_progress: Callable[[int, int], None] | None = None
    ) -> admin_pb2.GetStatsResponse:
        """Blocks until the pool is pre-faulted: a cold pool would time page faults."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.wait_serving()
            if on_progress is not None:
                on_progress(st.warmup_done_bytes, st.capacity_bytes)
            if st.warmup_complete:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the daemon's pool is not warm after {timeout:.0f} s "
                    f"({st.warmup_done_bytes} of {st.capacity_bytes} bytes)"
                )
            time.sleep(0.1)

    def wait_mapped(self, timeout: float = 600.0) -> None:
        """`wait_mapped` for this daemon."""
        wait_mapped(self.wait_serving, timeout)

    def _check_alive(self) -> None:
        """Only a daemon the bench started can be seen to die."""

    def _log_tail(self) -> str:
        return ""

    def stop(self, keep_log: Path | None = None) -> None:
        """Leaves a daemon the bench did not start alone."""


class OwnDaemon(DaemonUnderTest):
    """`kvdepot serve` on a private socket in a temporary directory (a
    kvdepot.testing.daemon.ServeProcess, the test suite's daemon wrapper too)."""

    def __init__(
        self,
        pool_size: str,
        copy_threads: int | None = None,
        extra: list[str] | None = None,
        command: list[str] | None = None,
        log_level: str | None = "warning",
    ) -> None:
        """`command` replaces `kvdepot` (the control-plane ceiling's launcher, the GPU
        bench's CUDA launcher); `log_level` None keeps the daemon's own (info)."""
        # Short path: a Unix socket path must fit in 108 bytes.
        self.workdir = Path(tempfile.mkdtemp(prefix="kvdbench-"))
        args = ["--pool-size", pool_size, *(["--log-level", log_level] if log_level else [])]
        args += extra or []
        if copy_threads:
            args += ["--copy-threads", str(copy_threads)]
        self.serve = ServeProcess(self.workdir, *args, command=command).launch()
        super().__init__(self.serve.target, self.serve.admin_target)
        self.socket_path = self.serve.socket_path
        self.log_path = self.serve.log_path
        assert self.serve.proc is not None
        self.proc = self.serve.proc
        self.started = True

    def _check_alive(self) -> None:
        self.serve.check_alive()

    def _log_tail(self) -> str:
        text = self.serve.log()
        return f"\n--- daemon log ---\n{text[-4000:]}" if text else ""

    def log_text(self) -> str:
        return self._log_tail()

    def stop(self, keep_log: Path | None = None) -> None:
        """SIGTERM (SIGKILL after 20 s), then the directory goes; its log is copied to
        `keep_log` first when given."""
        with contextlib.suppress(subprocess.TimeoutExpired):  # killed: nothing more to wait for
            self.serve.stop()
        if keep_log is not None:
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            keep_log.write_text(self.serve.log())
        shutil.rmtree(self.workdir, ignore_errors=True)
