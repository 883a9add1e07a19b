"""`kvdepot status --watch` in a real terminal (tmux, 80 columns) following a live daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import admin_pb2
from tests.support.daemon import DaemonProcess, connect, kvdepot_command
from tests.support.engine import Engine, Geometry
from tests.support.ops import admin, store
from tests.support.status_cli import WIDTH

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

    def wait_screen(self, predicate: Callable[[str], bool], what: str, timeout: float = 30) -> str:
        """The screen, once `predicate` holds for it."""

        def shown() -> tuple[str] | None:  # a tuple: a blank screen may be what is awaited
            text = self.screen()
            return (text,) if predicate(text) else None

        def last_screen() -> str:
            size = self.run("display-message", "-p", "-t", "w", "#{window_width}x#{window_height}")
            return f"the screen ({size.strip()}):\n{self.screen()}"

        return wait_for(shown, timeout, what, interval=0.2, detail=last_screen)[0]

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
        text = tmux.wait_screen(lambda t: "11 ready" in t and "engine-b" in t, "the first state")
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
            tmux.wait_screen(
                lambda t: "16 ready" in t and "engine-c (watch test)" in t,
                "five new blocks and the third engine",
            )
        finally:
            client.close()

        d.kill()
        # The error line names the operator socket and may wrap: read it unwrapped.
        text = tmux.wait_screen(
            lambda t: "connection refused" in " ".join(t.split()), "the daemon gone"
        )
        assert "retrying" in text
        d.start()
        with d.admin_channel() as ch2:
            from kvdepot.v1 import admin_pb2_grpc

            new_boot = (
                admin_pb2_grpc.AdminStub(ch2)
                .GetStats(admin_pb2.GetStatsRequest(), timeout=10)
                .boot_id
            )
        assert new_boot != boot
        tmux.wait_screen(
            lambda t: new_boot in t and "connection refused" not in t, "the restarted daemon"
        )

        tmux.run("send-keys", "-t", "w", "C-c")

        tmux.wait_screen(lambda _: tmux.exit_status() is not None, "the command's exit")
        assert tmux.exit_status() == 0, tmux.screen()
    finally:
        tmux.close()
