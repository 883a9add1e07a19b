"""The systemd service notification protocol, implemented in-project (no libsystemd).

systemd starts a ``Type=notify`` service with ``NOTIFY_SOCKET`` in its environment: the
address of an ``AF_UNIX`` datagram socket, either a filesystem path (``/run/systemd/notify``)
or, when it starts with ``@``, a name in the Linux abstract namespace. The service tells
systemd about itself by sending newline-separated ``KEY=VALUE`` assignments, one datagram per
message: ``READY=1`` once it serves, ``STATUS=...`` for ``systemctl status``, ``STOPPING=1``
when it begins to shut down, and ``WATCHDOG=1`` keep-alives when the unit sets
``WatchdogSec=`` (systemd then exports ``WATCHDOG_USEC``, and ``WATCHDOG_PID`` naming the
process that is meant to send them). See sd_notify(3) and sd_watchdog_enabled(3).

Contract of this module:

- With ``NOTIFY_SOCKET`` unset (not under systemd, tests, containers) every send is a no-op
  that returns ``False``.
- A send never raises into the caller: a failure (systemd gone, queue full, bad address) is
  logged as a warning once per notifier, later ones at debug level, and the send returns
  ``False``. Notifications are advisory; the daemon must not die for them.
- A send never blocks for long. When systemd's receive queue is full (PID 1 busy, e.g. at
  boot; the kernel's default net.unix.max_dgram_qlen is 10 datagrams shared by all senders,
  which systemd's sysctl defaults raise to 512), a message waits at most ``SEND_TIMEOUT_S``
  for room, since losing ``READY=1`` would have systemd kill a healthy daemon at its start
  timeout. ``WATCHDOG=1`` never waits: a lost keep-alive costs nothing, the next one
  follows within half the watchdog timeout.
- Each message is exactly one datagram, sent from the calling process, so that systemd's
  ``NotifyAccess=main`` accepts it (systemd checks the sender's pid from the socket).
- Or, instead of ``NOTIFY_SOCKET``, a ``channel``: a connected socket of this process
  alone (a shard's end of the socketpair its supervisor made, server/shards.py). No
  other process can send into it, so nothing can crowd its keep-alives out, as a flood
  of a named socket's shared receive queue does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Mapping
from types import TracebackType

__all__ = ["SEND_TIMEOUT_S", "SystemdNotifier", "run_watchdog"]

log = logging.getLogger("kvdepot.sdnotify")

#: Longest time one message waits for room in systemd's receive queue.
SEND_TIMEOUT_S = 1.0


class SystemdNotifier:
    """Sends service notifications to systemd over ``$NOTIFY_SOCKET``.

    Built from the environment (``os.environ`` unless ``environ`` is given) once, at
    construction; later changes to the environment are not seen. The process environment is
    not modified, so children inherit ``NOTIFY_SOCKET``; with ``NotifyAccess=main`` systemd
    ignores their messages, and ``WATCHDOG_PID`` keeps them from running a watchdog.

    Safe to use from several threads (each send is one ``sendto`` on a shared socket) and
    from the event loop (a message waits at most ``SEND_TIMEOUT_S``, a keep-alive not at
    all, and only when systemd is not reading).
    """

    def __init__(
        self, environ: Mapping[str, str] | None = None, *, channel: socket.socket | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        # A channel is connected: messages go to its peer, NOTIFY_SOCKET is not read.
        self._channel = channel
        self._address: bytes | None = (
            None if channel is not None else self._parse_address(env.get("NOTIFY_SOCKET", ""))
        )
        self._watchdog_usec: int | None = self._parse_usec(env.get("WATCHDOG_USEC"))
        self._watchdog_pid: int | None = self._parse_pid(env.get("WATCHDOG_PID"))
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned = False
        if channel is not None:
            _set_send_timeout(channel)
            self._sock = channel

    # -- environment -------------------------------------------------------------------

    @staticmethod
    def _parse_address(value: str) -> bytes | None:
        if not value:
            return None
        if value.startswith("@"):
            # Abstract namespace: the kernel name is a NUL byte followed by the rest.
            return b"\0" + os.fsencode(value[1:])
        if value.startswith("/"):
            return os.fsencode(value)
        # sd_notify(3) rejects relative paths too; newer systemd also knows vsock: addresses,
        # which only matter inside VMs and are not supported here.
        log.warning(
            "NOTIFY_SOCKET=%r is not an absolute path or @abstract name; "
            "systemd notifications disabled",
            value,
        )
        return None

    @staticmethod
    def _parse_usec(value: str | None) -> int | None:
        if value is None or value == "":
            return None
        try:
            usec = int(value)
        except ValueError:
            log.warning("WATCHDOG_USEC=%r is not an integer; watchdog disabled", value)
            return None
        return usec if usec > 0 else None

    @staticmethod
    def _parse_pid(value: str | None) -> int | None:
        if value is None or value == "":
            return None
        try:
            return int(value)
        except ValueError:
            log.warning("WATCHDOG_PID=%r is not an integer; watchdog disabled", value)
            return -1  # matches no process, so the watchdog stays off

    @property
    def enabled(self) -> bool:
        """True when ``NOTIFY_SOCKET`` names a usable address (or a channel was given),
        i.e. sends are attempted."""
        return self._address is not None or self._channel is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between ``WATCHDOG=1`` messages: half of ``WATCHDOG_USEC``, as
        sd_watchdog_enabled(3) recommends.

        ``None`` when no watchdog is asked of this process: ``WATCHDOG_USEC`` unset, invalid
        or zero, ``WATCHDOG_PID`` set to another pid (we are a child that inherited the
        environment, or were forked after start), or notifications disabled.
        """
        if not self.enabled or self._watchdog_usec is None:
            return None
        # Compared at call time so a forked child, which has a new pid, sees None.
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2_000_000

    # -- sending -----------------------------------------------------------------------

    def notify(self, state: str | None = None, /, **fields: object) -> bool:
        """Send one notification datagram; return True if the kernel accepted it.

        Either a raw ``state`` string (``"READY=1\\nSTATUS=warming"``), sent as is, or
        keyword fields (``notify(READY=1, STATUS="warming")``), sent as ``KEY=value`` lines
        in the given order; both may be combined (raw part first). Newlines inside field
        values are replaced by spaces, since a newline would start a new assignment.
        Waits at most ``SEND_TIMEOUT_S`` for room in a full queue. Returns False, without
        raising, when disabled, when there is nothing to send, or when the send failed.
        """
        return self._notify(state, fields, wait=True)

    def _notify(self, state: str | None, fields: Mapping[str, object], *, wait: bool) -> bool:
        if not self.enabled:
            return False
        lines: list[str] = []
        if state:
            lines.append(state)
        for key, value in fields.items():
            text = str(value).replace("\r", " ").replace("\n", " ")
            lines.append(f"{key}={text}")
        if not lines:
            return False
        return self._send("\n".join(lines).encode("utf-8", "replace"), wait=wait)

    def ready(self) -> bool:
        """Send ``READY=1``: start-up is complete and the service accepts requests."""
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        """Send ``STATUS=text``, shown by ``systemctl status`` (one line)."""
        return self.notify(STATUS=text)

    def stopping(self) -> bool:
        """Send ``STOPPING=1``: the service has begun to shut down."""
        return self.notify(STOPPING=1)

    def watchdog(self) -> bool:
        """Send ``WATCHDOG=1``: a keep-alive that resets systemd's watchdog timer.

        Never waits: with the queue full, this keep-alive is dropped (returns False).
        """
        return self._notify(None, {"WATCHDOG": 1}, wait=False)

    def extend_timeout(self, seconds: float) -> bool:
        """Send ``EXTEND_TIMEOUT_USEC``: ask systemd for ``seconds`` more before it times out
        the current start-up or shut-down phase (for slow phases that make progress)."""
        return self.notify(EXTEND_TIMEOUT_USEC=max(0, int(seconds * 1_000_000)))

    def _send(self, payload: bytes, *, wait: bool) -> bool:
        flags = 0 if wait else socket.MSG_DONTWAIT
        try:
            if self._channel is not None:
                self._channel.send(payload, flags)
                return True
            assert self._address is not None
            with self._lock:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    _set_send_timeout(sock)
                    self._sock = sock
                sock = self._sock
            # sendto per message rather than connect(): systemd may re-create its socket
            # (daemon-reexec), and an unconnected socket simply follows the path.
            sock.sendto(payload, flags, self._address)
        except OSError as exc:
            self._report_failure(exc)
            return False
        return True

    def _report_failure(self, exc: OSError) -> None:
        target = self._address.replace(b"\0", b"@", 1) if self._address else b"the supervisor"
        if not self._warned:
            self._warned = True
            log.warning(
                "systemd notification to %s failed: %s (further failures are "
                "logged at debug level)",
                os.fsdecode(target),
                exc,
            )
        else:
            log.debug("systemd notification to %s failed: %s", os.fsdecode(target), exc)

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Close the sending socket; a later send opens a new one (a channel, once
        closed, stays so: later sends return False)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        addr = os.fsdecode(self._address.replace(b"\0", b"@", 1)) if self._address else None
        if self._channel is not None:
            addr = f"channel fd {self._channel.fileno()}"
        return f"SystemdNotifier(address={addr!r}, watchdog_interval={self.watchdog_interval()})"


def _set_send_timeout(sock: socket.socket) -> None:
    """Blocking sends that give up after SEND_TIMEOUT_S: the kernel then waits on the
    receiver's queue itself (Python's own timeouts would poll, and poll reports an
    unconnected datagram socket always writable)."""
    sock.setblocking(True)
    sec = int(SEND_TIMEOUT_S)
    usec = int((SEND_TIMEOUT_S - sec) * 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec))


async def run_watchdog(notifier: SystemdNotifier, stop_event: asyncio.Event) -> None:
    """Send ``WATCHDOG=1`` at ``notifier.watchdog_interval()`` until ``stop_event`` is set.

    The first keep-alive goes out at once. Returns immediately when no watchdog is asked of
    this process (``watchdog_interval()`` is None), and promptly once ``stop_event`` is set
    (no keep-alive is sent after that). Because the keep-alives come from the event loop,
    a loop that stops turning (blocked by a stuck call) stops them, and systemd restarts the
    daemon: that is the point, so run this on the daemon's main loop, not in a thread.
    """
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    log.debug("systemd watchdog: keep-alive every %.3f s", interval)
    while not stop_event.is_set():
        notifier.watchdog()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop_event.wait(), timeout=interval)
