"""`kvdepot serve --shards N`: runs N shard daemons and supervises them.

Contract:

- `shard_config(cfg, i)` is pure: the settings shard i runs with (its own sockets, pool
  file, share of the pool and of the disk tier, metrics port). It raises ValueError,
  one line naming the flag, for settings that cannot be split N ways.
- `serve_shards(cfg, run)` is called by `kvdepot.server.daemon.serve` on the main thread
  of the `kvdepot serve` process, which becomes the supervisor: it owns N child processes
  (multiprocessing's "spawn": each a fresh interpreter running `run(shard_config(cfg, i))`
  with its own event loop, copy threads, pool and index; called as `run(cfg, channel)`,
  `channel` its notification socket) and nothing else of the daemon.
  `run` is passed in, not imported, because the daemon sits above this module
  (docs/architecture.md §2).
- systemd sees one service: only the supervisor talks to $NOTIFY_SOCKET (the unit's
  NotifyAccess=main). The shards inherit no NOTIFY_SOCKET of systemd's; each gets instead
  its end of a socketpair of the supervisor's (passed at spawn, named nowhere: no other
  process can send into it, so no flood can crowd a shard's keep-alives out, as one did
  when this was a named socket in the abstract namespace). The supervisor reads their
  READY=1, STATUS= and WATCHDOG=1 and sends READY=1 once every shard serves (its socket
  accepts), STATUS= lines naming each shard, WATCHDOG=1 while every shard keeps sending
  its own, STOPPING=1 when it stops.
- SIGTERM/SIGINT: forwarded to every shard as SIGTERM; a shard still running after
  `STOP_GRACE_SECONDS` is SIGKILLed. Exit 0 when every shard stopped cleanly.
- A shard that exits on its own (a crash, a kill) stops the others and the supervisor
  exits 1, so that systemd restarts the lot; one that could not start (exit 2: socket
  busy, pool file locked...) stops the others and the supervisor exits 2. A shard whose
  keep-alives stop for the whole watchdog timeout is sent SIGABRT (a core to look at),
  which ends the same way.
- Each shard asks the kernel for SIGTERM when the supervisor dies (PR_SET_PDEATHSIG), so
  a supervisor killed with SIGKILL leaves no shard behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvdepot.common.libc import set_parent_death_signal
from kvdepot.common.shards import shard_socket
from kvdepot.server.config import ServeConfig
from kvdepot.server.memory import private_files
from kvdepot.server.sdnotify import SystemdNotifier
from kvdepot.server.sizes import format_size

log = logging.getLogger("kvdepot.shards")

#: The smallest pool a shard is given: below it a shard holds too few rows to be of use.
MIN_SHARD_POOL_BYTES = 16 << 20
#: The smallest disk tier a shard is given.
MIN_SHARD_DISK_BYTES = 16 << 20
#: How long the shards have to stop after SIGTERM before they are SIGKILLed: longer
#: than a shard's own shutdown grace, shorter than the unit's TimeoutStopSec.
STOP_GRACE_SECONDS = 30.0
#: Exit status of a shard (and of the supervisor) that could not start.
START_FAILED = 2
#: The variables of systemd's notification protocol (server/sdnotify.py).
_NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

#: A shard's body: its settings and its notification channel (for SystemdNotifier).
RunShard = Callable[[ServeConfig, socket.socket], int]


def shard_config(cfg: ServeConfig, i: int) -> ServeConfig:
    """The settings of shard `i` of `cfg.shards`: everything of `cfg` but what two
    processes cannot share (sockets, files, ports) and what is split between them (the
    pool, the disk tier). One shard: `cfg` itself, unchanged."""
    n = cfg.shards
    if not 0 <= i < n:
        raise ValueError(f"shard {i} is outside --shards {n}")
    if n == 1:
        return cfg
    if cfg.listen:
        raise ValueError(
            f"--listen {cfg.listen} with --shards {n}: one TCP address cannot serve "
            f"several shards; drop --listen or run one shard"
        )
    changes: dict[str, object] = {
        "shard": i,
        "socket": shard_socket(cfg.socket, i),
        "pool_size": _share(cfg, cfg.pool_size, "--pool-size", MIN_SHARD_POOL_BYTES),
    }
    # A derived admin socket follows the socket (PATH.shardI.admin); a named one is split.
    if cfg.admin_socket:
        changes["admin_socket"] = shard_socket(cfg.admin_socket, i)
    if cfg.pool_file and i > 0:  # its .lock, .index and .journal follow it
        changes["pool_file"] = f"{cfg.pool_file}.shard{i}"
    if cfg.metrics_port:  # 0 (any free port) stays 0
        port = cfg.metrics_port + i
        if port > 65535:
            raise ValueError(
                f"--metrics-port {cfg.metrics_port} with --shards {n}: shard {i} would "
                f"listen on {port}, past 65535: choose a lower port"
            )
        changes["metrics_port"] = port
    if cfg.disk:
        disk_size = _share(cfg, cfg.disk_size, "--disk-size", MIN_SHARD_DISK_BYTES)
        # Every shard in a directory of its own, also shard 0: a tier's file holds one
        # shard's sections, and is locked by the process that uses it.
        changes["disk"] = str(Path(cfg.disk) / f"shard{i}")
        changes["disk_size"] = disk_size
    # each change is its ServeConfig field's type (a dict of mixed values)
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def _share(cfg: ServeConfig, size: int, flag: str, minimum: int) -> int:
    """One shard's share of `size` (the value of `flag`), in whole slots; ValueError
    when that is below `minimum`."""
    n = cfg.shards
    share = size // n // cfg.slot_granularity * cfg.slot_granularity
    if share < minimum:
        raise ValueError(
            f"{flag} {format_size(size)} split over --shards {n} gives each shard "
            f"{format_size(share)}, less than the {format_size(minimum)} a shard needs: "
            f"raise {flag} or lower --shards"
        )
    return share


def check_shards(cfg: ServeConfig) -> None:
    """Raises ValueError (one line, naming the flag) unless every shard's settings can
    be made: `kvdepot serve` checks this with the other settings, before it starts."""
    for i in range(cfg.shards):
        shard_config(cfg, i)


def serve_shards(cfg: ServeConfig, run: RunShard) -> int:
    """Runs `cfg.shards` shards, each `run(shard_config(cfg, i))` in a process of its
    own, until SIGTERM/SIGINT or until one of them exits. The exit status of
    `kvdepot serve` (see the module's contract)."""
    try:
        configs = [shard_config(cfg, i) for i in range(cfg.shards)]
    except ValueError as exc:
        log.error("%s", exc)
        return START_FAILED
    if cfg.disk:
        # The shards' directories are created inside it, so it must exist and be the
        # daemon's own (the rules of the pool file's directory; a missing one is 0700).
        try:
            private_files.prepare_directory(Path(cfg.disk))
        except (OSError, private_files.UnsafeFileError) as exc:
            log.error("--disk %s: %s", cfg.disk, exc)
            return START_FAILED
    return Supervisor(configs, run).run()


# --- the shards' side ---------------------------------------------------------------------


def _shard_main(
    run: RunShard,
    cfg: ServeConfig,
    supervisor: int,
    channel: socket.socket,
    notify: dict[str, str],
) -> None:
    """The first code a shard runs (in the child, after spawn's imports): `channel` is
    its end of the supervisor's socketpair, `notify` the notification variables it gets
    instead of systemd's (WATCHDOG_USEC)."""
    # Before anything else: a supervisor that dies from here on takes this shard along.
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before the line above
        os._exit(1)
    channel.set_inheritable(False)  # spawn passed it on: none of the shard's children
    for name in _NOTIFY_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(notify)
    sys.exit(run(cfg, channel))


# --- the supervisor -----------------------------------------------------------------------


@dataclass
class _Shard:
    index: int
    config: ServeConfig
    process: BaseProcess
    channel: socket.socket  # the supervisor's end of the shard's socketpair
    ready: bool = False
    status: str = "starting"
    last_keepalive: float | None = None  # monotonic
    aborted_at: float | None = None  # monotonic: sent SIGABRT for a stuck loop

    @property
    def pid(self) -> int | None:
        return self.process.pid


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


class Supervisor:
    """The supervisor's one loop (main thread): the shards' exits, their notifications,
    the signals and the watchdog, multiplexed with a selector."""

    def __init__(self, configs: list[ServeConfig], run: RunShard) -> None:
        self.configs = configs
        self.run_shard = run
        self.n = len(configs)
        self.notifier = SystemdNotifier()  # systemd's, read before the shards' is set up
        self.shards: list[_Shard] = []
        self.selector = selectors.DefaultSelector()
        self._signal: int | None = None
        self._ready_sent = False
        self._last_status = ""

    # -- start --------------------------------------------------------------------------

    def run(self) -> int:
        watchdog = self.notifier.watchdog_interval()
        # The shards must never reach systemd's socket (NotifyAccess=main): drop its
        # variables before any child exists, so none can inherit them.
        for name in _NOTIFY_VARIABLES:
            os.environ.pop(name, None)
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        try:
            self.selector.register(wake_r, selectors.EVENT_READ, "signal")
            notify: dict[str, str] = {}
            if watchdog is not None:  # each shard keeps its own, and the supervisor reads it
                notify["WATCHDOG_USEC"] = str(int(watchdog * 2_000_000))
            try:
                self._start(notify)
                self.notifier.status(f"starting {self.n} shards")
                code = self._supervise(watchdog)
            except BaseException:  # never leave a shard running without its supervisor
                self._stop_all()
                raise
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.selector.close()
            for shard in self.shards:
                shard.channel.close()
            wake_r.close()
            wake_w.close()
        return code

    def _start(self, notify: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for i, cfg in enumerate(self.configs):
            # The shard's notification channel: a socketpair, so that only the shard can
            # send into its end (SEQPACKET: messages kept whole, and an end of file when
            # the shard is gone). spawn hands the child its end by fd.
            mine, theirs = socket.socketpair(
                socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
            )
            try:
                process = ctx.Process(
                    target=_shard_main,
                    args=(self.run_shard, cfg, os.getpid(), theirs, notify),
                    name=f"kvdepot-shard{i}",
                )
                process.start()
            except BaseException:
                mine.close()
                raise
            finally:
                theirs.close()  # the shard's own copy lives on
            mine.setblocking(False)
            shard = _Shard(i, cfg, process, mine)
            self.shards.append(shard)
            self.selector.register(process.sentinel, selectors.EVENT_READ, shard)
            self.selector.register(mine, selectors.EVENT_READ, ("notify", shard))
            log.info("shard %d/%d started (pid %d) on unix:%s", i, self.n, shard.pid, cfg.socket)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is None:
            self._signal = signum

    # -- the loop -----------------------------------------------------------------------

    def _supervise(self, watchdog: float | None) -> int:
        """Runs until a signal or a shard's exit; then stops every shard. The exit status."""
        next_keepalive = time.monotonic()
        exited: _Shard | None = None
        while self._signal is None and exited is None:
            timeout = 1.0
            if watchdog is not None and self._ready_sent:
                timeout = max(0.0, min(timeout, next_keepalive - time.monotonic()))
            for key, _ in self.selector.select(timeout):
                if key.data == "signal":
                    with contextlib.suppress(OSError):
                        # the signal key's file object is the wake-up socket
                        key.fileobj.recv(64)  # type: ignore[union-attr]
                elif isinstance(key.data, tuple):
                    self._read_notifications(key.data[1])
                elif isinstance(key.data, _Shard) and exited is None:
                    exited = key.data
            if watchdog is not None and self._ready_sent and time.monotonic() >= next_keepalive:
                next_keepalive = time.monotonic() + watchdog
                self._keepalive(watchdog)
        if exited is not None:
            exited.process.join(1.0)
            code = exited.process.exitcode
            log.error("shard %d %s; stopping the other shards", exited.index, _describe_exit(code))
            status = START_FAILED if code == START_FAILED else 1
        else:
            log.info("%s: stopping %d shards", signal.Signals(self._signal or 15).name, self.n)
            status = 0
        self.notifier.stopping()
        if not self._stop_all() and status == 0:
            status = 1
        log.info("stopped")
        return status

    def _stop_all(self) -> bool:
        """SIGTERM to every shard still running, SIGKILL to those left after the grace
        period. True when every shard that was running stopped cleanly (exit 0, or ended
        by that SIGTERM before its handlers were in place: it was still starting)."""
        running = [s for s in self.shards if s.process.exitcode is None]
        for s in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.pid or 0, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for s in running:
            s.process.join(max(0.0, deadline - time.monotonic()))
        clean = True
        for s in running:
            if s.process.exitcode is None:
                log.error(
                    "shard %d did not stop within %.0f s: SIGKILL", s.index, STOP_GRACE_SECONDS
                )
                s.process.kill()
                s.process.join(10.0)
                clean = False
            elif s.process.exitcode not in (0, -signal.SIGTERM):  # -SIGTERM: not up yet
                log.error("shard %d %s while stopping", s.index, _describe_exit(s.process.exitcode))
                clean = False
        return clean

    # -- notifications ------------------------------------------------------------------

    def _read_notifications(self, shard: _Shard) -> None:
        """What `shard` sent on its channel (nobody else can send there)."""
        while True:
            try:
                data = shard.channel.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the shard closed its end (it is ending): its exit says more
                self.selector.unregister(shard.channel)
                break
            for line in data.decode("utf-8", "replace").split("\n"):
                key, _, value = line.partition("=")
                if key == "READY" and value == "1" and not shard.ready:
                    shard.ready = True
                    # Its keep-alives are due from now on: one that never comes is stale.
                    shard.last_keepalive = time.monotonic()
                    log.info(
                        "shard %d/%d serving on unix:%s", shard.index, self.n, shard.config.socket
                    )
                elif key == "STATUS":
                    shard.status = value
                elif key == "WATCHDOG" and value == "1":
                    shard.last_keepalive = time.monotonic()
        self._report()

    def _report(self) -> None:
        """READY=1 once every shard serves; a STATUS= line of every shard's own."""
        serving = sum(s.ready for s in self.shards)
        if serving == self.n and not self._ready_sent:
            self._ready_sent = True
            self.notifier.ready()
            log.info("all %d shards serving", self.n)
        head = (
            f"serving {self.n} shards"
            if self._ready_sent
            else f"starting: {serving} of {self.n} shards serving"
        )
        text = head + " | " + " | ".join(f"shard {s.index}: {s.status}" for s in self.shards)
        if text != self._last_status:
            self._last_status = text
            self.notifier.status(text)

    def _keepalive(self, interval: float) -> None:
        """WATCHDOG=1 to systemd while every shard's own keep-alives come; a shard silent
        for the whole timeout (twice the interval) is sent SIGABRT, for a core to look at,
        and SIGKILL if that has not ended it one timeout later (a stopped process)."""
        now = time.monotonic()
        timeout = 2 * interval
        stale = [
            s
            for s in self.shards
            if s.last_keepalive is not None and now - s.last_keepalive > timeout
        ]
        for s in stale:
            if s.aborted_at is None:
                s.aborted_at = now
                log.error(
                    "shard %d sent no watchdog keep-alive for %.1f s (its event loop is "
                    "stuck): SIGABRT",
                    s.index,
                    now - (s.last_keepalive or now),
                )
                sig = signal.SIGABRT
            elif now - s.aborted_at > timeout:
                log.error("shard %d is still there after SIGABRT: SIGKILL", s.index)
                sig = signal.SIGKILL
            else:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.pid or 0, sig)
        if not stale:
            self.notifier.watchdog()
