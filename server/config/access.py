"""`kvdepot serve` settings: who may reach the daemon (socket modes, operators, TLS)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting


@dataclass
class AccessSettings:
    """Who may reach the daemon: the sockets' modes and groups, the operators' socket,
    TLS, destructive Admin calls."""

    socket_mode: int = setting(
        "--socket-mode",
        0o660,
        parse=parsers.octal_mode,
        shown="660",
        metavar="MODE",
        help="octal file mode of the sockets",
    )
    socket_group: str | None = setting(
        "--socket-group",
        parse=parsers.group,
        metavar="GROUP",
        shown="the daemon's own group",
        help="group owning the sockets: engines in it may connect",
    )
    admin_socket: str | None = setting(
        "--admin-socket",
        metavar="PATH",
        shown="the socket's path + .admin",
        help="Unix socket of the Admin service (kvdepot status, grpcurl, Evict, Clear): the "
        "operators' socket, apart from the engines' one, which never serves Admin",
    )
    admin_group: str | None = setting(
        "--admin-group",
        parse=parsers.group,
        metavar="GROUP",
        shown="none: mode 600, the daemon's user only",
        help="operator group: its members may use the admin socket (mode 660)",
    )
    tls_cert: str | None = setting(
        "--tls-cert",
        metavar="PATH",
        help="server certificate chain (PEM) for --listen; required, with --tls-key and "
        "--tls-client-ca, on any address but loopback",
    )
    tls_key: str | None = setting(
        "--tls-key",
        metavar="PATH",
        help="private key (PEM) of --tls-cert",
    )
    tls_client_ca: str | None = setting(
        "--tls-client-ca",
        metavar="PATH",
        help="CA certificates (PEM) that client certificates must chain to: --listen with "
        "TLS admits only clients that present one (mutual TLS)",
    )
    destructive_admin: bool = setting(
        "--no-destructive-admin",
        True,
        switch=True,
        help="refuse Admin/Evict and Admin/Clear",
    )
