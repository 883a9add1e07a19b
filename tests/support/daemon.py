"""The daemon under test and how a test reaches it.

The process wrapper, `kvdepot_command` and `stats` are kvdepot.testing.daemon's,
shared with `kvdepot bench`; `DaemonProcess` is the suite's name for it. Waiting
is kvdepot.testing.waiting's `wait_for`.
"""

from __future__ import annotations

from kvdepot.client import DepotClient
from kvdepot.testing.daemon import HasAdminTarget, ServeProcess, kvdepot_command, stats

DaemonProcess = ServeProcess

__all__ = ["DaemonProcess", "HasAdminTarget", "connect", "kvdepot_command", "stats"]


def connect(
    to: str | DaemonProcess | DepotClient,
    name: str = "",
    *,
    engine_id: str | None = None,
    timeout: float = 10.0,
) -> DepotClient:
    """A DepotClient with its session open: to a daemon (or its target), or the
    client given, started. `engine_id` is the name's first word unless given.
    Fails the test if no session opens within `timeout`."""
    if isinstance(to, DepotClient):
        client = to
    else:
        target = to if isinstance(to, str) else to.target
        if engine_id is None:
            engine_id = name.split()[0] if name else ""
        client = DepotClient(target, client_name=name, engine_id=engine_id)
    assert client.start().wait_connected(timeout), f"{client.client_name}: no session"
    return client
