"""`kvdepot serve`: assembles the state, the gRPC server and the sockets, and runs
until SIGTERM/SIGINT; with --shards N > 1, hands the process to the shards' supervisor
(server/shards.py), whose shards run `serve_one` each."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import kvdepot
from kvdepot.common.escape import EscapingFormatter
from kvdepot.server.config import ServeConfig
from kvdepot.server.core.index import IndexEvent
from kvdepot.server.core.kinds import EventKind
from kvdepot.server.core.planner import planning
from kvdepot.server.core.tier import Tier, TierStartError
from kvdepot.server.cuda import enable_cuda
from kvdepot.server.fd_receiver import FdReceiver
from kvdepot.server.gc_policy import GcPolicy
from kvdepot.server.health import HealthServicer
from kvdepot.server.memory import private_files
from kvdepot.server.memory.copy_engine import copier
from kvdepot.server.memory.pool_file import PoolFileBusy
from kvdepot.server.metrics_token import MetricsTokenError, read_token
from kvdepot.server.operator import ListenError, admin_refusal, listen_credentials
from kvdepot.server.pvm import enable_pvm
from kvdepot.server.resources import Headroom, raise_nofile_limit
from kvdepot.server.sdnotify import SystemdNotifier, run_watchdog
from kvdepot.server.service import bounds, wire
from kvdepot.server.service.admin import AdminServicer
from kvdepot.server.service.call_caps import CallCaps
from kvdepot.server.service.depot import DepotServicer
from kvdepot.server.service.gate import SessionGate
from kvdepot.server.shards import serve_shards
from kvdepot.server.sizes import format_size
from kvdepot.server.state import DepotState
from kvdepot.server.tier_registry import start_tiers
from kvdepot.v1 import admin_pb2, admin_pb2_grpc, depot_pb2, depot_pb2_grpc

if TYPE_CHECKING:
    from kvdepot.server.kv_events import KvEventPublisher

log = logging.getLogger("kvdepot")

MAX_SEND_BYTES = 512 << 20  # a Get answers a whole section inline
SHUTDOWN_GRACE_SECONDS = 5.0
SERVICES = ("kvdepot.v1.Depot", "kvdepot.v1.Admin")  # the data socket's, the operators'


def _server_options(cfg: ServeConfig) -> list[tuple[str, int]]:
    return [
        # Every method's, so the largest legal request's (bounds.receive_limit): a Put
        # of a section larger than a part goes in parts (PutParts).
        ("grpc.max_receive_message_length", bounds.receive_limit(cfg)),
        ("grpc.max_send_message_length", MAX_SEND_BYTES),
        ("grpc.so_reuseport", 0),
    ]


class SocketPathError(RuntimeError):
    """The socket path is unusable (not a socket, someone else's, or in use)."""


def prepare_socket_path(path: str) -> None:
    """Creates the directory; removes a stale socket of ours; refuses anything else."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        st = p.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:  # no permission, a file where a directory should be
        raise SocketPathError(f"cannot use socket path {path}: {exc}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket: refusing to replace it")
    if st.st_uid != os.geteuid():
        raise SocketPathError(
            f"{path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()}): refusing it"
        )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            p.unlink()  # stale: left by a daemon that died
            return
    raise SocketPathError(f"another process is listening on {path}: is a daemon running?")


def apply_socket_access(path: str, mode: int, group: str | None) -> None:
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    os.chmod(path, mode)


class PoolFilePathError(RuntimeError):
    """--pool-file names a path the daemon cannot use (a directory, no such parent
    directory, no permission)."""


def check_pool_file_path(path: str) -> None:
    """Refuses an unusable --pool-file (and its `.lock` beside it) with one line that
    says what to change, before anything is created or mapped."""
    p = Path(path)
    parent = p.parent
    try:  # the daemon's own directory (created 0700 when missing): see private_files
        private_files.prepare_directory(parent)
    except FileNotFoundError:
        raise PoolFilePathError(
            f"--pool-file {path}: directory {parent.parent} does not exist: create it or "
            f"choose a path in an existing directory (e.g. /dev/shm/kvdepot/kvdepot.pool)"
        ) from None
    except NotADirectoryError:
        raise PoolFilePathError(f"--pool-file {path}: {parent} is not a directory") from None
    except PermissionError as exc:  # UnsafeFileError, or no right to create it
        raise PoolFilePathError(f"--pool-file {path}: {exc}") from None
    for target, what in ((p, "the pool file"), (Path(path + ".lock"), "its lock file")):
        if target.is_dir():
            raise PoolFilePathError(
                f"--pool-file {path}: {target} ({what}) is a directory: remove it or give "
                f"a path where a file can be created"
            )
        try:  # a symlink, another user's file or one others may write: refused
            private_files.check_existing(str(target), what)
        except private_files.UnsafeFileError as exc:
            raise PoolFilePathError(f"--pool-file {path}: {exc}") from None
        if target.exists():
            wanted, checked, verb = os.R_OK | os.W_OK, target, "read and write"
        else:
            wanted, checked, verb = os.W_OK | os.X_OK, parent, "create files in"
        if not os.access(checked, wanted):
            raise PoolFilePathError(
                f"--pool-file {path}: no permission to {verb} {checked} as uid "
                f"{os.geteuid()}: fix the ownership or mode, or choose another path"
            )
    for suffix, what in ((".index", "its index snapshot"), (".journal", "its journal")):
        try:
            private_files.check_existing(path + suffix, what)
        except private_files.UnsafeFileError as exc:
            raise PoolFilePathError(f"--pool-file {path}: {exc}") from None


class Daemon:
    def __init__(self, config: ServeConfig, notify_channel: socket.socket | None = None) -> None:
        self.config = config
        self.state: DepotState | None = None
        self.server: grpc.aio.Server | None = None
        self.admin_server: grpc.aio.Server | None = None  # the operators' socket
        self.health = HealthServicer()  # its Watch streams end at shutdown
        self.admin_health = HealthServicer()  # the operator socket's
        # systemd's $NOTIFY_SOCKET, or a shard's channel to its supervisor (shards.py).
        self.notifier = SystemdNotifier(channel=notify_channel)
        self._stop = asyncio.Event()
        self._ready = False  # READY=1 sent (read by the warm-up thread's STATUS lines)
        self.tiers: list[Tier] = []  # below the pool, nearest first (tier_registry.py)
        self.kv_events: KvEventPublisher | None = None
        self.depot: DepotServicer | None = None
        self.gc = GcPolicy()  # keeps the index out of full collections

    async def run(self) -> None:
        cfg = self.config
        tcp_credentials = listen_credentials(cfg)  # refuses TCP without mTLS off loopback
        metrics_token = self._metrics_token()  # exit 2, before anything is made, if unusable
        prepare_socket_path(cfg.socket)
        prepare_socket_path(cfg.fd_socket)
        prepare_socket_path(cfg.admin_socket_path)
        if cfg.pool_file:
            check_pool_file_path(cfg.pool_file)
        # Every registration holds an fd: take what the hard limit allows (the
        # headroom checks read the limit from here on).
        nofile, _ = raise_nofile_limit()
        try:
            self.state = st = DepotState.create(cfg)
        except (IsADirectoryError, NotADirectoryError, FileNotFoundError, PermissionError) as exc:
            if not cfg.pool_file:
                raise
            # What the check above could not foresee (e.g. a read-only file system).
            raise PoolFilePathError(f"--pool-file {cfg.pool_file}: {exc}") from None
        log.info(
            "kvdepot %s starting: pool %s in %s (eviction %s), boot id %s; open files up to "
            "%d (%d kept free), at most %d sessions of %d registrations",
            kvdepot.__version__,
            format_size(st.arena.size),
            st.arena.backing,
            cfg.eviction_policy,
            st.boot_id,
            nofile,
            cfg.fd_reserve,
            cfg.max_sessions,
            cfg.max_registrations_per_session,
        )
        log.info("shared-memory copies: %s", copier())
        log.info("%s", st.arena.placement.describe())
        log.info("copy planning: %s", planning())
        # Memory paths beyond shared memory; each logs whether it is on, and why.
        enable_cuda(st, st.arena)  # before the warm-up: it page-locks each warm chunk
        enable_pvm(st, cfg.pvm)  # engines' plain memory (process_vm_readv/writev); --pvm
        self._start_warmup(st)
        self.tiers = start_tiers(cfg, st)  # --disk, --remote
        if cfg.kv_events:  # before any server: its port taken stops the start cleanly
            self.kv_events = start_kv_events(st, cfg.kv_events, cfg.kv_events_topic)

        # Two servers on this loop: one grpc server cannot serve different services on
        # different ports, and Admin must never be on the engines' socket (or TCP).
        server = self.server = grpc.aio.server(
            options=_server_options(cfg),
            maximum_concurrent_rpcs=bounds.max_concurrent_rpcs(cfg),
        )
        admin_server = self.admin_server = grpc.aio.server(options=_server_options(cfg))
        # Undecodable requests get INVALID_ARGUMENT, not grpcio's UNKNOWN, and requests
        # larger than any legal one are refused unparsed (see wire.py).
        depot = self.depot = DepotServicer(st)
        wire.add_servicer(
            depot_pb2_grpc.add_DepotServicer_to_server,
            depot,
            server,
            bounds.receive_limit(cfg),
            bounds.type_bytes(cfg),
            depot.request_parsers(),
            # Depot calls but Session need a session before their request is read
            # (gate.py); the caps count only the calls the gate lets through.
            SessionGate(
                lambda sid: sid in st.sessions, CallCaps(st.open_call, st.close_call).counted
            ),
        )
        server.add_generic_rpc_handlers((admin_refusal(cfg.admin_socket_path),))
        wire.add_servicer(
            admin_pb2_grpc.add_AdminServicer_to_server,
            AdminServicer(st, depot.lanes),
            admin_server,
        )
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        for srv, health, service in (
            (server, self.health, depot_pb2.DESCRIPTOR.services_by_name["Depot"]),
            (admin_server, self.admin_health, admin_pb2.DESCRIPTOR.services_by_name["Admin"]),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(health, srv)
            reflection.enable_server_reflection(
                (service.full_name, health_name, reflection.SERVICE_NAME), srv
            )
        old_umask = os.umask(0o177)  # no window where the socket is world-accessible
        try:
            server.add_insecure_port(f"unix:{cfg.socket}")
            admin_server.add_insecure_port(f"unix:{cfg.admin_socket_path}")
            fd_receiver = FdReceiver(
                cfg.fd_socket,
                lambda sid: sid in st.sessions,
                headroom=Headroom(cfg.fd_reserve),
                authorize=st.attest,  # binds sessions to processes (kernel identity)
                issue_ticket=st.issue_ticket,  # sessions owned from their open
                loop=asyncio.get_running_loop(),
            )
            st.attach_fd_receiver(fd_receiver)
        finally:
            os.umask(old_umask)
        if cfg.listen and tcp_credentials is not None:
            server.add_secure_port(cfg.listen, tcp_credentials)
            log.info("also listening on TCP %s (mutual TLS; Depot only)", cfg.listen)
        elif cfg.listen:
            server.add_insecure_port(cfg.listen)
            log.warning(
                "also listening on TCP %s: anyone who reaches it can use the pool", cfg.listen
            )
        # grpcio's health servicer starts with "" SERVING: not before we are.
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.admin_health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        await admin_server.start()
        for path in (cfg.socket, cfg.fd_socket):
            apply_socket_access(path, cfg.socket_mode, cfg.socket_group)
        apply_socket_access(cfg.admin_socket_path, cfg.admin_socket_mode, cfg.admin_group)
        fd_receiver.start()
        if cfg.metrics_port is not None:
            from kvdepot.server.metrics import Metrics

            metrics = Metrics(st, gc=self.gc.stats)
            for tier in reversed(self.tiers):  # farthest first: the order of /metrics
                metrics.registry.register(tier.collector())
            metrics.serve(cfg.metrics_port, cfg.metrics_addr, metrics_token)
            log.info(
                "Prometheus metrics on http://%s:%d/metrics", cfg.metrics_addr, cfg.metrics_port
            )
        # SERVING only once everything (fd socket, metrics) is up.
        for health, name in zip((self.health, self.admin_health), SERVICES, strict=True):
            for service in ("", name):
                await health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving on unix:%s (fd socket %s, mode %o); Admin on unix:%s (mode %o)",
            cfg.socket,
            cfg.fd_socket,
            cfg.socket_mode,
            cfg.admin_socket_path,
            cfg.admin_socket_mode,
        )
        # Before READY=1: whoever stops us on hearing it must find the handlers in place.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.notifier.ready()
        self._ready = True
        self.notifier.status(f"serving; pool warm-up {self._warmup_percent(st)}%")

        tasks = [
            asyncio.create_task(self._housekeeping(st)),
            asyncio.create_task(self.gc.run(self._stop)),
            asyncio.create_task(run_watchdog(self.notifier, self._stop)),
        ]
        await self._stop.wait()
        await self._shutdown(st, tasks)

    def _metrics_token(self) -> str | None:
        """The bearer token scrapes must send (`--metrics-token-file`), or None."""
        path = self.config.metrics_token_file
        if path is None:
            return None
        return read_token(path)

    @staticmethod
    def _warmup_percent(st: DepotState) -> int:
        return int(100 * st.arena.warmup_done_bytes / st.arena.size)

    def _start_warmup(self, st: DepotState) -> None:
        last = [-1]

        def progress(done: int, total: int) -> None:
            pct = int(100 * done / total)
            if pct // 10 != last[0] // 10 or done == total:
                last[0] = pct
                log.info(
                    "pool warm-up: %s of %s (%d%%)", format_size(done), format_size(total), pct
                )
                phase = "serving" if self._ready else "starting"
                self.notifier.status(f"{phase}; pool warm-up {pct}%")

        st.arena.start_warmup(on_progress=progress)

    async def _housekeeping(self, st: DepotState) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)
            st.housekeeping()

    async def _shutdown(self, st: DepotState, tasks: list[asyncio.Task[None]]) -> None:
        log.info("shutting down")
        self.notifier.stopping()
        st.begin_shutdown()
        if self.depot is not None:  # job lanes answer what runs, then close
            await self.depot.lanes.shutdown(SHUTDOWN_GRACE_SECONDS)
        await self.health.enter_graceful_shutdown()
        await self.admin_health.enter_graceful_shutdown()
        assert self.server is not None and self.admin_server is not None
        await asyncio.gather(
            self.server.stop(SHUTDOWN_GRACE_SECONDS),
            self.admin_server.stop(SHUTDOWN_GRACE_SECONDS),
        )
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for tier in reversed(self.tiers):  # their I/O must end before the pool is unmapped
            await tier.close()
        if self.kv_events is not None:
            self.kv_events.close()
        st.close()
        for path in (self.config.socket, self.config.fd_socket, self.config.admin_socket_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        log.info("stopped; sockets removed")


class KvEventsError(RuntimeError):
    """--kv-events cannot be served (its port is taken, the address is not one)."""


def start_kv_events(st: DepotState, endpoint: str, topic: str) -> KvEventPublisher:
    """The node's KV-event stream (--kv-events): AllBlocksCleared, then the rows the
    pool holds already (a warm restart's), then every change as it happens."""
    import zmq

    from kvdepot.server.kv_events import KvEventPublisher

    try:
        publisher = KvEventPublisher(endpoint, st.chunk_events, topic)
    except zmq.ZMQError as exc:
        raise KvEventsError(f"--kv-events {endpoint}: {exc}") from None
    for namespace_id in list(st.index.namespaces):
        keys = st.ready_keys(namespace_id)
        if keys:
            publisher.on_event(IndexEvent(namespace_id, EventKind.STORED, tuple(keys)))
    st.add_event_listener(publisher.on_event)
    st.event_stream = publisher
    publisher.start()
    log.info(
        "KV events on %s (replay requests on %s), topic %r",
        publisher.endpoint,
        publisher.replay or "none: the PUB socket connects",
        topic,
    )
    return publisher


def configure_logging(level: str, tag: str = "") -> None:
    """The process's log format; `tag` (e.g. "shard 1/4") starts every line of a shard."""
    prefix = f"{tag} " if tag else ""
    log_format = f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"
    logging.basicConfig(level=level.upper(), format=log_format)
    for handler in logging.getLogger().handlers:  # clients' strings reach the log escaped
        handler.setFormatter(EscapingFormatter(log_format))
    logging.getLogger("grpc").setLevel(max(logging.INFO, logging.getLogger().level))


def serve(config: ServeConfig) -> int:
    """`kvdepot serve`: the daemon in this process, or with --shards N > 1 a supervisor
    of N shard processes, each running `serve_one` (server/shards.py)."""
    if config.shards > 1:
        configure_logging(config.log_level)
        return serve_shards(config, serve_one)
    return serve_one(config)


def serve_one(config: ServeConfig, notify_channel: socket.socket | None = None) -> int:
    """One daemon process: the whole daemon, or shard `config.shard` of `config.shards`
    (then in a process of the supervisor's, `notify_channel` its socket to it). Its exit
    status: 2 when it cannot start."""
    tag = f"shard {config.shard}/{config.shards}" if config.shards > 1 else ""
    configure_logging(config.log_level, tag)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        log.warning("uvloop is not installed; using asyncio's default loop")
    try:
        asyncio.run(Daemon(config, notify_channel).run())
    except (
        SocketPathError,
        PoolFileBusy,
        PoolFilePathError,
        TierStartError,
        ListenError,
        MetricsTokenError,
        KvEventsError,
    ) as exc:
        log.error("%s", exc)
        return 2
    return 0
