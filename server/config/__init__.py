"""`kvdepot serve` settings, written once.

`ServeConfig` is the table: each field that carries a `Setting` is one setting, with its
flag, its environment fallback (KVDEPOT_<FLAG>), its default, its help text and the
parser that turns text into its value. The `serve` flags, their help and the config the
daemon runs with are all derived from it, so adding a setting is adding one field.

Contract: a bad value, on the command line or in the environment, ends `kvdepot serve`
with exit status 2 and one line on stderr naming the flag or the variable; never a
traceback. An empty environment variable counts as unset (systemd's `KEY=`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvdepot.common.shards import MAX_SHARDS
from kvdepot.server import setting_parsers as parsers
from kvdepot.server.core.shares import NamespaceShares
from kvdepot.server.sizes import parse_size, pool_share_bytes


def default_socket_path() -> str:
    """/run/kvdepot/kvdepot.sock for root; the user's runtime directory otherwise."""
    if os.geteuid() == 0:
        return "/run/kvdepot/kvdepot.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvdepot-{os.geteuid()}"
    return str(Path(runtime) / "kvdepot" / "kvdepot.sock")


def _remote_url(text: str) -> str:
    from kvdepot.server.remote.url import parse_redis_url

    parse_redis_url(text)  # RemoteURLError is a ValueError that says what is wrong
    return text.strip()


def _numa(text: str) -> str:
    """Checks a --numa value and that the nodes it names have memory on this host."""
    from kvdepot.server.memory import numa

    value = numa.parse_setting(text)
    if value[0].isdigit():
        numa.check_nodes(value, numa.read_topology())  # NumaError is a ValueError
    return value


def _pool_share(text: str) -> str:
    """Checks a SIZE or PERCENT% setting; the text is kept (the pool size is known later)."""
    pool_share_bytes(text, 1 << 30)
    return text.strip()


# --- the table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One `kvdepot serve` setting (see `ServeConfig` for the rows).

    flag: the command-line flag; env: its environment fallback (derived from the flag).
    parse: text -> value, raising ValueError with what is allowed.
    shown: how the default reads in --help ("" = say nothing about a default).
    switch: a flag without a value that sets the opposite of the default; its
        environment variable takes 1/true/yes/on or 0/false/no/off.
    """

    flag: str
    help: str
    parse: Callable[[str], Any] = parsers.text
    shown: str = ""
    switch: bool = False
    metavar: str | None = None

    @property
    def env(self) -> str:
        return "KVDEPOT_" + self.flag.removeprefix("--").replace("-", "_").upper()

    def from_env(self, raw: str) -> Any:
        if not self.switch:
            return self.parse(raw)
        word = raw.strip().lower()
        if word in parsers.TRUE | parsers.FALSE:
            return word in parsers.TRUE
        raise ValueError(f"{raw!r} is not one of 1, true, yes, on, 0, false, no, off")


def setting(
    flag: str,
    default: Any = None,
    *,
    help: str,
    parse: Callable[[str], Any] = parsers.text,
    shown: str | None = None,
    default_factory: Callable[[], Any] | None = None,
    switch: bool = False,
    metavar: str | None = None,
) -> Any:
    """A `ServeConfig` field that is also a setting (one row of the table). A parser
    that names its own value in --help (`parsers.one_of`: its choices) gives the metavar."""
    if shown is None:
        shown = "" if default is None or switch else str(default)
    metavar = metavar or getattr(parse, "metavar", None)
    meta = {"setting": Setting(flag, help, parse, shown, switch, metavar)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


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
class DaemonSettings(DerivedSockets):
    """The daemon's own settings (the first part of `ServeConfig`'s table): sockets, the
    pool, sessions and their quotas, operators, TLS, copy threads and job bounds."""

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
    metrics_port: int | None = setting(
        "--metrics-port",
        parse=parsers.whole_number(0, 65535),
        metavar="PORT",
        shown="off",
        help="serve Prometheus metrics on this port",
    )
    metrics_addr: str = setting(
        "--metrics-addr",
        "127.0.0.1",
        parse=parsers.address,
        metavar="ADDR",
        help="address the metrics endpoint listens on: loopback by default, 0.0.0.0 (or "
        "the pod IP) for a scrape from another host or pod",
    )
    metrics_token_file: str | None = setting(
        "--metrics-token-file",
        metavar="PATH",
        shown="none: every request is answered",
        help="a bearer token (the file's first line) that every scrape must send "
        "(`Authorization: Bearer TOKEN`; Prometheus: `authorization: {credentials_file: ...}`); "
        "others get 401. Others must not read it (chmod o-rwx)",
    )
    kv_events: str | None = setting(
        "--kv-events",
        parse=parsers.zmq_tcp,
        metavar="tcp://HOST:PORT",
        shown="off",
        help="publish the pool's blocks to KV-cache-aware routers (llm-d, Dynamo) in "
        "vLLM's KV-event format, as vLLM does: tcp://*:PORT binds PORT (replay requests "
        "on PORT+1), tcp://HOST:PORT connects to a router's SUB socket",
    )
    kv_events_topic: str = setting(
        "--kv-events-topic",
        "",
        metavar="TOPIC",
        shown="none",
        help="the ZMQ topic of --kv-events' messages (llm-d expects kv@POD-IP@MODEL)",
    )
    max_sessions: int = setting(
        "--max-sessions",
        256,
        parse=parsers.whole_number(1),
        metavar="N",
        help="open sessions (engine processes) at most; more are refused with RESOURCE_EXHAUSTED",
    )
    max_registrations_per_session: int = setting(
        "--max-registrations-per-session",
        64,
        parse=parsers.whole_number(1),
        metavar="N",
        help="registrations one session may hold (each holds an fd and mappings); more "
        "are refused with RESOURCE_EXHAUSTED",
    )
    max_pinned_per_session: str = setting(
        "--max-pinned-per-session",
        "50%",
        parse=_pool_share,
        shown="50%%",  # argparse %-formats the help
        metavar="SIZE|PERCENT%",
        help="bytes of blocks one session, and every session of its process together, "
        "may hold pinned, as a size or a share of --pool-size; a Pin beyond it is "
        "refused with RESOURCE_EXHAUSTED",
    )
    max_writing_per_session: str = setting(
        "--max-writing-per-session",
        "50%",
        parse=_pool_share,
        shown="50%%",  # argparse %-formats the help
        metavar="SIZE|PERCENT%",
        help="bytes of block rows one session, and every session of its process together, "
        "may hold reserved while they are written, as a size or a share of --pool-size; "
        "stores beyond it are dropped, with that reason",
    )
    max_watches_per_session: int = setting(
        "--max-watches-per-session",
        16,
        parse=parsers.whole_number(1),
        metavar="N",
        help="Watch streams one session may hold open; more are refused with RESOURCE_EXHAUSTED",
    )
    max_sessions_per_pid: int = setting(
        "--max-sessions-per-pid",
        16,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions one process may hold (the kernel names it on the fd socket); more "
        "are refused with RESOURCE_EXHAUSTED",
    )
    max_sessions_per_uid: int = setting(
        "--max-sessions-per-uid",
        128,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions the processes of one user may hold together, shared fairly: past "
        "it a process below its share takes the place of the largest holder's oldest",
    )
    max_unattested_sessions: int = setting(
        "--max-unattested-sessions",
        32,
        parse=parsers.whole_number(1),
        metavar="N",
        help="sessions not yet bound to a process, per opener (one TCP peer, or every "
        "unnamed local caller; kvdepot's client binds its own from the open); beyond "
        "them the opener's own oldest is ended, never another's",
    )
    pvm: bool = setting(
        "--pvm",
        False,
        switch=True,
        help="serve the pvm memory path: copy engines' plain memory with "
        "process_vm_readv/writev (each registration copies only the process that made it)",
    )
    fd_reserve: int = setting(
        "--fd-reserve",
        256,
        parse=parsers.whole_number(16),
        metavar="N",
        help="file descriptors kept free below RLIMIT_NOFILE for connections and files: "
        "fds and registrations that would eat into them are refused",
    )
    log_level: str = setting(
        "--log-level",
        "info",
        parse=parsers.one_of("debug", "info", "warning", "error"),
        help="log level",
    )
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
    copy_threads: int = setting(
        "--copy-threads",
        2,
        parse=parsers.whole_number(1),
        metavar="N",
        help="threads that copy bytes with the CPUs (shared memory, process memory, "
        "inline and tier copies), shared by every engine",
    )
    gpu_copy_threads: int = setting(
        "--gpu-copy-threads",
        2,
        parse=parsers.whole_number(1),
        metavar="N",
        help="copy threads of each GPU's own, which queue its DMA and wait for it: no "
        "GPU's jobs wait behind another's (--copy-threads: the threads that copy with the "
        "CPUs, shared)",
    )
    numa: str = setting(
        "--numa",
        "auto",
        parse=_numa,
        metavar="auto|off|interleave|NODE[,NODE]",
        help="NUMA placement of the pool and the copy threads: auto puts the pool on the "
        "node of the host's GPUs (interleaved over their nodes if several; without GPUs, "
        "the nodes of the daemon's CPUs) and the copy threads on those nodes' CPUs; "
        "interleave spreads the pool over every node; NODE[,NODE] binds it there; off "
        "leaves both to the kernel",
    )
    shards: int = setting(
        "--shards",
        1,
        parse=parsers.whole_number(1, MAX_SHARDS),
        metavar="N",
        help="run the daemon as N processes (shards), each with its own event loop, copy "
        "threads, pool (--pool-size / N) and index; shard i > 0 listens on PATH.shardI. "
        "Engines started after it find N by themselves (kvdepot_shards auto)",
    )
    max_job_keys: int = setting(
        "--max-job-keys",
        4096,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in keys",
    )
    # Bounds on what one request may make the event loop do (docs/security.md):
    # checked on the message's counts before anything is built from it.
    max_job_blocks: int = setting(
        "--max-job-blocks",
        16384,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in GPU block ids (16384 blocks of 16 tokens: 256k tokens)",
    )
    max_job_pages: int = setting(
        "--max-job-pages",
        1 << 20,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in pages (block ids x layers of their group; Llama-3-405B's "
        "126 layers x 8192 blocks fit); larger jobs are refused with RESOURCE_EXHAUSTED",
    )
    # (setting() makes a dataclass field; the default is built per ServeConfig.)
    namespace_share: NamespaceShares = setting(  # noqa: RUF009
        "--namespace-share",
        default_factory=NamespaceShares,
        parse=NamespaceShares.parse,
        metavar="NS=FRACTION,...",
        shown="",
        help="a share of the pool per namespace (an id, or a prefix of ids ending in *), "
        "e.g. 'kvd1-3f9c*=0.25': while a namespace holds no more than its share, other "
        "namespaces' stores do not evict its rows; shares add up to at most 1 (default: "
        "none, every row competes in one LRU)",
    )
    max_batch_keys: int = setting(
        "--max-batch-keys",
        16384,
        parse=parsers.whole_number(1),
        metavar="N",
        help="keys in one Lookup, Pin, Unpin or Prefetch call",
    )
    reservation_timeout: float = setting(
        "--reservation-timeout",
        60.0,
        parse=parsers.seconds,
        shown="60",
        metavar="SECONDS",
        help="seconds a partly written block row may wait for its other ranks",
    )
    eviction_policy: str = setting(
        "--eviction-policy",
        "lru",
        parse=parsers.one_of("lru", "arc"),
        help="which rows a full pool evicts first: lru (the least recently used) or arc "
        "(adaptive replacement: rows used again are kept from rows used once)",
    )


@dataclass
class ServeConfig(DaemonSettings):
    """What the daemon runs with. Fields with a `setting(...)` are the settings table: the
    daemon's own (`DaemonSettings`, first) and then the tiers' below the pool (the
    fleet's Redis, the local disk), in the order --help and the docs list them."""

    remote: str | None = setting(
        "--remote",
        parse=_remote_url,
        metavar="URL",
        shown="off",
        help="a shared tier below the pool: redis://HOST:PORT[,HOST:PORT...] (a Redis "
        "cluster is discovered from any seed; a standalone server works too; rediss:// for "
        "TLS). The password comes from KVDEPOT_REMOTE_PASSWORD or --remote-password-file, "
        "never from the URL",
    )
    remote_ttl: int = setting(
        "--remote-ttl",
        86400,
        parse=parsers.whole_number(0),
        metavar="SECONDS",
        help="time to live of rows written to the remote tier (0: no expiry)",
    )
    remote_write: str = setting(
        "--remote-write",
        "ready",
        parse=parsers.one_of("ready", "evict"),
        help="write a row to the remote tier when it becomes ready, or only when LRU evicts it",
    )
    remote_max_inflight_bytes: int = setting(
        "--remote-max-inflight-bytes",
        256 << 20,
        parse=parse_size,
        shown="256MiB",
        metavar="SIZE",
        help="bytes queued or in flight to the remote tier (each way); past it, writes are "
        "dropped and counted",
    )
    remote_password_file: str | None = setting(
        "--remote-password-file",
        metavar="PATH",
        help="file whose first line is the remote tier's password (KVDEPOT_REMOTE_PASSWORD wins)",
    )
    remote_ca_file: str | None = setting(
        "--remote-ca-file",
        metavar="PATH",
        shown="the system's CAs",
        help="CA certificates for rediss:// (PEM)",
    )
    remote_key_file: str | None = setting(
        "--remote-key-file",
        metavar="PATH",
        shown="none: --remote refuses to start without it",
        help="the fleet key: rows written to the remote tier carry a MAC under it and only "
        "rows that verify are loaded. First line: the current key (32+ characters, e.g. "
        "`openssl rand -hex 32`); an optional second line: the previous key, still accepted "
        "on reads. Mode 0600 (refused if the group or others may read or write it)",
    )
    remote_insecure: bool = setting(
        "--remote-insecure",
        False,
        switch=True,
        help="run --remote without a fleet key: rows are checked with a CRC only, so anyone "
        "who can write to the store can plant rows this node loads",
    )
    disk: str | None = setting(
        "--disk",
        metavar="DIR",
        shown="off",
        help="a disk tier below the pool, in the daemon's own directory DIR (one "
        "preallocated file): ready rows are written behind, misses in RAM read back",
    )
    disk_size: int = setting(
        "--disk-size",
        64 << 30,
        parse=parse_size,
        shown="64GiB",
        metavar="SIZE",
        help="bytes of the disk tier's file, reserved at start; past it, LRU evicts",
    )
    disk_write: str = setting(
        "--disk-write",
        "ready",
        parse=parsers.one_of("ready", "evict"),
        help="write a row to the disk tier when it becomes ready, or only ahead of eviction "
        "(the pool's least recently used rows, once the pool is over 80 percent full)",
    )
    disk_write_priority: str = setting(
        "--disk-write-priority",
        "low",
        parse=parsers.one_of("low", "normal"),
        help="CPU and I/O priority of the disk tier's write threads: low (nice 19, the "
        "lowest best-effort I/O class: stores and loads always win the CPU, and writes the "
        "disk cannot take in time are dropped) or normal (as the daemon's other threads)",
    )
    # Not settings: fixed for the daemon, changed only by tests that build a state directly.
    slot_granularity: int = 4096
    keepalive_seconds: float = 5.0
    # Which of the `shards` this process is: set only by the supervisor (server/shards.py).
    shard: int = 0


def settings() -> Iterator[tuple[str, Setting]]:
    """(field name, setting) for every row of the table, in --help order."""
    for f in dataclasses.fields(ServeConfig):
        if "setting" in f.metadata:
            yield f.name, f.metadata["setting"]


def _builtin_default(name: str) -> Any:
    f = ServeConfig.__dataclass_fields__[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _argparse_type(s: Setting) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


class SettingsParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage dump), exit status 2.

    Errors found in the environment while the arguments were added are reported when
    this parser is used, before --help, so a bad variable is never silently ignored.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.environment_errors: list[str] = []

    # one signature for argparse's overloads: the daemon passes no namespace type
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self.environment_errors:
            self.error(self.environment_errors[0])
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_serve_arguments(parser: argparse.ArgumentParser, only: Sequence[str] = ()) -> None:
    """Adds the settings' flags (all, or the fields named in `only`) to `parser`.

    Each flag's default is its environment variable when set, else the table's default.
    """
    if not only:
        parser.epilog = (
            "A flag on the command line wins over its environment variable; an empty "
            "variable counts as unset."
        )
    errors: list[str] = []
    for name, s in settings():
        if only and name not in only:
            continue
        default = _builtin_default(name)
        raw = os.environ.get(s.env, "")
        if raw.strip():
            try:
                value = s.from_env(raw)
                # A switch's variable says whether the flag is given, not the value.
                default = (not default if value else default) if s.switch else value
            except ValueError as exc:
                errors.append(f"{s.env}: {exc} (the environment fallback of {s.flag})")
        shown = f"; default {s.shown}" if s.shown else ""
        # A switch stores the opposite of the table's default; the others parse a value.
        kind: dict[str, Any] = (
            {"action": "store_const", "const": not _builtin_default(name)}
            if s.switch
            else {"type": _argparse_type(s), "metavar": s.metavar}
        )
        parser.add_argument(
            s.flag, dest=name, default=default, help=f"{s.help} ({s.env}{shown})", **kind
        )
    if not errors:
        return
    if isinstance(parser, SettingsParser):
        parser.environment_errors.extend(errors)
    else:
        parser.error(errors[0])


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(**{name: getattr(args, name) for name, _ in settings()})
