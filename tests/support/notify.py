"""A stand-in for systemd's notification socket, for tests of the daemon's
READY=1, STATUS=, WATCHDOG=1 and STOPPING=1 (server/sdnotify.py, server/shards.py)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time

from tests.support.daemon import DaemonProcess


class NotifyListener:
    """A stand-in for systemd's NOTIFY_SOCKET (WATCHDOG_USEC 2 s) given to daemon `d`;
    keeps every datagram with the pid that sent it (the kernel's word: SO_PASSCRED)."""

    def __init__(self, d: DaemonProcess) -> None:
        self.d = d
        self.got: list[tuple[int, list[str]]] = []
        self.arrived: list[float] = []  # time.monotonic() of each of `got`, as read
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = str(d.workdir / "notify")
        self.sock.bind(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        d.env = {**d.env, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}
        d.env.pop("WATCHDOG_PID", None)

    def until(self, field: str, timeout: float) -> None:
        """Reads datagrams until one has `field` (a line such as READY=1)."""
        deadline = time.monotonic() + timeout
        while not any(field in fields for _, fields in self.got):
            left = deadline - time.monotonic()
            assert left > 0, f"no {field}; got {self.got}\n{self.d.log()}"
            self.sock.settimeout(min(left, 0.5))
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except TimeoutError:
                continue
            self._keep(data, ancillary)

    def drain(self) -> None:
        """Reads what came, without waiting (a full queue would slow the daemon down)."""
        self.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self._keep(*self.sock.recvmsg(4096, socket.CMSG_SPACE(12))[:2])

    def _keep(self, data: bytes, ancillary: list[tuple[int, int, bytes]]) -> None:
        pid = next(struct.unpack("3i", p[:12])[0] for _, _, p in ancillary)
        self.got.append((pid, data.decode().split("\n")))
        self.arrived.append(time.monotonic())

    def times_of(self, field: str) -> list[float]:
        """When each datagram with `field` (e.g. WATCHDOG=1) was read."""
        return [t for t, (_, fields) in zip(self.arrived, self.got, strict=True) if field in fields]

    def senders(self) -> set[int]:
        return {pid for pid, _ in self.got}
