"""`kvdepot serve` settings: where the daemon serves, and its pool."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting
from kvdepot.server.sizes import parse_size


def default_socket_path() -> str:
    """/run/kvdepot/kvdepot.sock for root; the user's runtime directory otherwise."""
    if os.geteuid() == 0:
        return "/run/kvdepot/kvdepot.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvdepot-{os.geteuid()}"
    return str(Path(runtime) / "kvdepot" / "kvdepot.sock")


class DerivedSockets:
    """The socket paths and modes derived from three settings, so the table holds only
    settings. `ServeConfig` inherits them (`cfg.fd_socket` reads like a setting); the
    annotations name the settings they read (a plain class: no dataclass fields)."""

    socket: str
    admin_socket: str | None
    admin_group: str | None

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fd"

    @property
    def admin_socket_path(self) -> str:
        """The operators' socket: Admin is served there and nowhere else."""
        return self.admin_socket or self.socket + ".admin"

    @property
    def admin_socket_mode(self) -> int:
        # The daemon's user only, unless an operator group is named.
        return 0o660 if self.admin_group else 0o600


@dataclass
class ServingSettings(DerivedSockets):
    """Where the daemon serves (its socket, TCP) and its pool (size, file)."""

    socket: str = setting(
        "--socket",
        default_factory=default_socket_path,
        shown="%(default)s",
        metavar="PATH",
        help="Unix socket path for gRPC; the fd socket is created next to it (PATH.fd)",
    )
    listen: str | None = setting(
        "--listen",
        parse=parsers.host_port,
        metavar="HOST:PORT",
        shown="off: TCP has no file-mode access control",
        help="also serve Depot (never Admin) on this TCP address, e.g. 127.0.0.1:50051; any "
        "address but loopback needs --tls-cert, --tls-key and --tls-client-ca",
    )
    pool_size: int = setting(
        "--pool-size",
        1 << 30,
        parse=parse_size,
        shown="1GiB",
        metavar="SIZE",
        help="pool bytes, e.g. 512MiB or 64GiB",
    )
    pool_file: str | None = setting(
        "--pool-file",
        metavar="PATH",
        shown="a memfd",
        help="keep the pool in this file so a restarted daemon serves its blocks again; its "
        "directory must be the daemon's alone (a missing one is created 0700), e.g. "
        "/dev/shm/kvdepot/kvdepot.pool or on hugetlbfs",
    )
