"""The operators' side of the daemon, apart from the engines' (docs/security.md).

Engines use the data socket (Depot, health); operators use the admin socket (Admin,
health), a Unix socket of its own with mode 0600, or 0660 for an operator group
(`--admin-socket`, `--admin-group`). An engine can reach the data socket but not
the admin socket, so no engine lists the other engines or clears the pool.

`--listen` (TCP) carries the data side only, and only over mutual TLS unless the
address is loopback: `listen_credentials` decides, before anything starts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from kvdepot.server.config import ServeConfig
from kvdepot.v1 import admin_pb2

ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"]


def admin_refusal(admin_socket: str) -> grpc.GenericRpcHandler:
    """kvdepot.v1.Admin on the data socket (and TCP): every method answers
    PERMISSION_DENIED with where Admin is served, instead of gRPC's bare
    UNIMPLEMENTED "Method not found!". Requests are not read."""
    message = f"Admin is served on the operator socket {admin_socket}, not on the engines' socket"

    async def refuse(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        raise AssertionError("unreachable: abort raises")

    # A request stream to the server (the wire is the same as a unary call's), never
    # read: nothing of the request is received beyond what flow control let through.
    handlers = {m.name: grpc.stream_unary_rpc_method_handler(refuse) for m in ADMIN_SERVICE.methods}
    return grpc.method_handlers_generic_handler(ADMIN_SERVICE.full_name, handlers)


class ListenError(RuntimeError):
    """--listen cannot be served as configured (no TLS off loopback, unreadable files)."""


def is_loopback(listen: str) -> bool:
    """Whether HOST of HOST:PORT is a loopback address (127.0.0.0/8, ::1, localhost)."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _read_pem(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ListenError(f"{flag} {path}: {exc.strerror or exc}") from None


def listen_credentials(cfg: ServeConfig) -> grpc.ServerCredentials | None:
    """The TLS credentials for --listen: None for plaintext (loopback without TLS
    files); ListenError, one line, when the configuration must not be served."""
    files = {
        "--tls-cert": cfg.tls_cert,
        "--tls-key": cfg.tls_key,
        "--tls-client-ca": cfg.tls_client_ca,
    }
    given = [flag for flag, path in files.items() if path]
    if not cfg.listen:
        if given:
            raise ListenError(f"{given[0]} is for --listen, which is not set")
        return None
    if not given and is_loopback(cfg.listen):
        return None  # this host's processes only; the daemon warns
    missing = [flag for flag, path in files.items() if not path]
    if missing:
        why = (
            f"--listen {cfg.listen} is not a loopback address: it needs mutual TLS"
            if not given
            else "--listen with TLS needs all of --tls-cert, --tls-key and --tls-client-ca"
        )
        raise ListenError(f"{why}; missing {', '.join(missing)}")
    # none missing: checked just above
    cert = _read_pem("--tls-cert", files["--tls-cert"])  # type: ignore[arg-type]
    key = _read_pem("--tls-key", files["--tls-key"])  # type: ignore[arg-type]
    client_ca = _read_pem("--tls-client-ca", files["--tls-client-ca"])  # type: ignore[arg-type]
    try:
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=True
        )
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ListenError(f"--tls-cert/--tls-key/--tls-client-ca: {exc}") from None
