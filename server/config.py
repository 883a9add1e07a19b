"""`kvdepot serve` settings: flags with KVDEPOT_* environment fallbacks."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}  # fmt: skip


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736; '512MiB', '1.5GB', '4096' work too."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: use a number with an optional unit, e.g. 512MiB, 64GiB"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(value)


def size_argument(text: str) -> int:
    """parse_size for argparse: its message reaches the user."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_socket_path() -> str:
    """/run/kvdepot/kvdepot.sock for root; the user's runtime directory otherwise."""
    if os.geteuid() == 0:
        return "/run/kvdepot/kvdepot.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvdepot-{os.geteuid()}"
    return str(Path(runtime) / "kvdepot" / "kvdepot.sock")


@dataclass
class ServeConfig:
    socket: str
    listen: str | None = None
    pool_size: int = 1 << 30
    pool_file: str | None = None
    metrics_port: int | None = None
    log_level: str = "info"
    socket_mode: int = 0o660
    socket_group: str | None = None
    destructive_admin: bool = True
    copy_threads: int = 2
    max_job_keys: int = 4096
    reservation_timeout: float = 60.0
    slot_granularity: int = 4096
    keepalive_seconds: float = 5.0

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fd"


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVDEPOT_{name}", default)


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in {"1", "true", "yes", "on"}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", default=_env("SOCKET") or default_socket_path(),
        help="Unix socket path for gRPC (KVDEPOT_SOCKET; default %(default)s)",
    )
    parser.add_argument(
        "--listen", default=_env("LISTEN"),
        help="also listen on this TCP address, e.g. 127.0.0.1:50051 (KVDEPOT_LISTEN; off "
        "by default: TCP has no file-mode access control)",
    )
    parser.add_argument(
        "--pool-size", type=size_argument, default=_env("POOL_SIZE", "1GiB"),
        help="pool bytes, e.g. 512MiB or 64GiB (KVDEPOT_POOL_SIZE; default 1GiB)",
    )
    parser.add_argument(
        "--pool-file", default=_env("POOL_FILE"),
        help="keep the pool in this file (e.g. /dev/shm/kvdepot.pool or on hugetlbfs) so a "
        "restarted daemon serves its blocks again (KVDEPOT_POOL_FILE; default: a memfd)",
    )
    parser.add_argument(
        "--metrics-port", type=int,
        default=int(_env("METRICS_PORT")) if _env("METRICS_PORT") else None,
        help="serve Prometheus metrics on this port (KVDEPOT_METRICS_PORT; default off)",
    )
    parser.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"], help="(KVDEPOT_LOG_LEVEL)",
    )
    parser.add_argument(
        "--socket-mode", type=lambda s: int(s, 8), default=int(_env("SOCKET_MODE", "660"), 8),
        help="octal file mode of the sockets (KVDEPOT_SOCKET_MODE; default 660)",
    )
    parser.add_argument(
        "--socket-group", default=_env("SOCKET_GROUP"),
        help="group owning the sockets: engines in it may connect (KVDEPOT_SOCKET_GROUP)",
    )
    parser.add_argument(
        "--no-destructive-admin", action="store_true",
        default=_truthy(_env("NO_DESTRUCTIVE_ADMIN")),
        help="refuse Admin/Evict and Admin/Clear (KVDEPOT_NO_DESTRUCTIVE_ADMIN)",
    )
    parser.add_argument(
        "--copy-threads", type=int, default=int(_env("COPY_THREADS", "2") or 2),
        help="threads that copy bytes (KVDEPOT_COPY_THREADS; default 2)",
    )
    parser.add_argument(
        "--max-job-keys", type=int, default=int(_env("MAX_JOB_KEYS", "4096") or 4096),
        help="largest transfer job in keys (KVDEPOT_MAX_JOB_KEYS; default 4096)",
    )
    parser.add_argument(
        "--reservation-timeout", type=float,
        default=float(_env("RESERVATION_TIMEOUT", "60") or 60),
        help="seconds a partly written block row may wait for its other ranks "
        "(KVDEPOT_RESERVATION_TIMEOUT; default 60)",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        socket=args.socket,
        listen=args.listen,
        pool_size=args.pool_size,
        pool_file=args.pool_file,
        metrics_port=args.metrics_port,
        log_level=args.log_level,
        socket_mode=args.socket_mode,
        socket_group=args.socket_group,
        destructive_admin=not args.no_destructive_admin,
        copy_threads=max(1, args.copy_threads),
        max_job_keys=max(1, args.max_job_keys),
        reservation_timeout=args.reservation_timeout,
    )
