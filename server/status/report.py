"""What `kvdepot status` reports, gathered over the daemon's public gRPC API only.

`connect` checks the socket itself first (missing, not a socket, permission, refused)
so that each failure gets its own one-line `StatusError` instead of gRPC's generic
"failed to connect"; `Sampler.sample` then calls Admin/GetStats, ListNamespaces and
ListEngines; `build_report` turns two samples into one plain dict (what `--json`
prints and what the screen shows): the state of the second sample, and rates over
the interval between the two.

Nothing here imports rich: the dict is the contract, the screen is one rendering.
GetStats fields this module does not know (a newer daemon, e.g. a remote tier) are
passed through generically under "remote" (names containing "remote"), "disk" (names
starting "disk_") and "other".
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdepot.common.shards import shard_socket
from kvdepot.server.status.copies import THREAD_LOAD_FIELDS, copy_load, loop_load
from kvdepot.v1 import admin_pb2, admin_pb2_grpc

# GetStats' NUMA placement fields (`kvdepot serve --numa`): the "numa" line.
NUMA_FIELDS = (
    "numa_host_nodes",
    "numa_policy",
    "numa_pool_nodes",
    "numa_basis",
    "numa_copy_thread_nodes",
    "numa_copy_thread_cpus",
    "gpu_copy_devices",
    "gpu_copy_threads",
    "gpu_copy_nodes",
)
# GetStats fields shown in their own sections; any other field goes to "remote"/"other".
KNOWN_STATS = frozenset(
    {
        "version",
        "boot_id",
        "uptime_seconds",
        "shard",
        "shard_count",
        "capacity_bytes",
        "used_bytes",
        "pinned_bytes",
        "largest_free_extent_bytes",
        "warmup_done_bytes",
        "warmup_complete",
        "ready_blocks",
        "writing_blocks",
        "pinned_blocks",
        "sessions",
        "registrations",
        "namespaces",
        "lookups",
        "hits",
        "misses",
        "evictions",
        "stores",
        "loads",
        "stored_bytes",
        "loaded_bytes",
        "dropped_stores",
        "inflight_jobs",
        "job_lanes_open",
        "page_locking",
        "page_locked_bytes",
        "page_locking_error",
        "populating_bytes",
        "pool_backing",
        "warm_restarted",
        "evictions_by_reason",
        *NUMA_FIELDS,
        *THREAD_LOAD_FIELDS,
    }
)
# Fields of newer daemons that this command shows where they exist (older daemons lack
# them; the report then leaves them out): job, block and pin counters.
OPTIONAL_COUNTERS = (
    "store_jobs", "load_jobs", "stored_blocks", "loaded_blocks", "failed_store_jobs",
    "failed_load_jobs", "pin_calls", "pin_keys", "pinned_keys", "lane_jobs",
    "lane_pins", "lane_unpins",
)  # fmt: skip
# Counts since start, shown as they are.
TOTALS = (
    "sessions",
    "registrations",
    "namespaces",
    "lookups",
    "hits",
    "misses",
    "stores",
    "loads",
    "stored_bytes",
    "loaded_bytes",
    "evictions",
    "evictions_by_reason",
    "dropped_stores",
)
# Counters turned into per-second rates (name in the report -> GetStats field).
RATE_COUNTERS = {
    "stores": "stores",
    "loads": "loads",
    "store_bytes": "stored_bytes",
    "load_bytes": "loaded_bytes",
    "evictions": "evictions",
    "lookups": "lookups",
    "hits": "hits",
    "dropped_stores": "dropped_stores",
}
# Crash recovery of a --pool-file daemon: blocks its journal listed, verified, dropped.
RECOVERY = (
    "recovery_blocks_total", "recovery_blocks_verified", "recovery_blocks_rejected",
    "recovery_complete",
)  # fmt: skip
# The remote tier's counters (`kvdepot serve --remote`), per second over the interval.
REMOTE_COUNTERS = (
    "remote_writes", "remote_write_bytes", "remote_write_present", "remote_write_drops",
    "remote_reads", "remote_read_bytes", "remote_hits", "remote_misses", "remote_fetch_drops",
    "remote_verify_failures", "remote_errors",
)  # fmt: skip
# The disk tier's counters (`kvdepot serve --disk`), per second over the interval.
DISK_COUNTERS = (
    "disk_writes", "disk_write_bytes", "disk_reads", "disk_read_bytes", "disk_hits", "disk_misses",
)  # fmt: skip
OPTIONAL_RATES = {
    "pin_keys": "pin_keys",
    "pinned_keys": "pinned_keys",
    "failed_store_jobs": "failed_store_jobs",
    "failed_load_jobs": "failed_load_jobs",
}
# What each memory path means, for daemons whose RegistrationInfo carries no reason.
MEMORY_PATH_MEANING = {
    "shm": "KV tensors in shared memory (a memfd; a CPU engine's KV cache is moved into "
    "one), daemon copies pages",
    "cuda_ipc": "GPU tensors via CUDA IPC, daemon's DMA engine copies",
    "pvm": "plain CPU memory, daemon copies it in place with process_vm_readv/writev",
    "inline": "bytes inside gRPC messages (slow): memory the daemon cannot reach, "
    "or kvdepot_memory_path=inline",
}


class StatusError(Exception):
    """A failure the user can act on; str() is one line."""


def socket_path_of(target: str) -> str:
    """'unix:///run/x.sock', 'unix:/run/x.sock' or a plain path -> the path."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            return target[len(prefix) :]
    return target


ADMIN_SUFFIX = ".admin"


def admin_socket_of(data_socket: str) -> str:
    """The operator socket beside a data socket (the daemon's default for
    --admin-socket); a path that already names one is kept."""
    return data_socket if data_socket.endswith(ADMIN_SUFFIX) else data_socket + ADMIN_SUFFIX


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _blocking_directory(path: str) -> Path | None:
    """The first ancestor of `path` this process may not search (x bit), if any."""
    for parent in reversed(Path(path).parents):
        if parent.is_dir() and not os.access(parent, os.X_OK):
            return parent
    return None


def _permission_error(path: str, what: Path) -> StatusError:
    try:
        st = os.stat(what)
        group, mode = _group_name(st.st_gid), f"{stat.S_IMODE(st.st_mode):04o}"
    except OSError:
        return StatusError(f"{path}: permission denied; run as root or as the daemon's group")
    kind = "socket" if what == Path(path) else f"directory {what}"
    owner_only = st.st_mode & 0o700 and not st.st_mode & 0o070  # the operator socket's default
    if what == Path(path) and owner_only:
        return StatusError(
            f"{path}: permission denied (socket is mode {mode}, owner {_user_name(st.st_uid)} "
            "only): run as that user or root, or start the daemon with --admin-group GROUP "
            "and join that group"
        )
    return StatusError(
        f"{path}: permission denied ({kind} is mode {mode}, group {group}): join the group "
        f"{group} (sudo usermod -aG {group} $USER, then log in again) or run as root"
    )


def check_socket(path: str, timeout: float = 2.0) -> None:
    """Raises StatusError unless something accepts connections on the Unix socket `path`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StatusError(
            f"{path}: no such socket: is the daemon running? (systemctl status kvdepot; "
            "another socket: --socket PATH or KVDEPOT_SOCKET)"
        ) from None
    except PermissionError:
        raise _permission_error(path, _blocking_directory(path) or Path(path)) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise StatusError(f"{path}: not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except PermissionError:
            raise _permission_error(path, Path(path)) from None
        except ConnectionRefusedError:
            raise StatusError(
                f"{path}: connection refused: no daemon listens on this socket (left behind "
                "by a daemon that was killed?)"
            ) from None
        except OSError as exc:
            raise StatusError(f"{path}: cannot connect: {exc.strerror or exc}") from None


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS_FRAME = 4


def speaks_http2(path: str, timeout: float) -> bool | None:
    """Whether the listener answers an HTTP/2 preface with a SETTINGS frame, as every
    gRPC server does first; None when it says nothing within `timeout` (stopped, stuck)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall(_HTTP2_PREFACE)
            head = b""
            while len(head) < 9:
                chunk = s.recv(9 - len(head))
                if not chunk:
                    return False  # closed on us
                head += chunk
        except TimeoutError:
            return None
        except OSError:
            return False
    return head[3] == _SETTINGS_FRAME


def rpc_error(path: str, err: grpc.RpcError, timeout: float) -> StatusError:
    """A one-line StatusError for a failed Admin call."""
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return StatusError(
            f"{path}: not a kvdepot daemon: it speaks gRPC but has no kvdepot.v1.Admin service"
        )
    # gRPC cannot tell a listener that is no gRPC server from a stuck daemon: ask.
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and (
        speaks_http2(path, min(timeout, 2.0)) is False
    ):
        return StatusError(f"{path}: not a kvdepot daemon: the listener does not speak gRPC")
    if code == grpc.StatusCode.UNAVAILABLE:
        return StatusError(f"{path}: the daemon is unavailable (shutting down?): {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return StatusError(
            f"{path}: the daemon did not answer within {timeout:g}s (busy or stuck; "
            "journalctl -u kvdepot)"
        )
    name = code.name if code is not None else "error"
    return StatusError(f"{path}: {name}: {details}")


@contextlib.contextmanager
def connect(path: str, timeout: float = 5.0) -> Iterator[grpc.Channel]:
    """A channel to the daemon on `path`, after check_socket passed."""
    check_socket(path, timeout=min(timeout, 2.0))
    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        yield channel
    finally:
        channel.close()


def health_probe(path: str, timeout: float = 3.0) -> None:
    """Raises StatusError unless grpc.health.v1 answers SERVING for the whole daemon."""
    with connect(path, timeout) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError as err:
            raise rpc_error(path, err, timeout) from None
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        raise StatusError(f"{path}: health is {name}")


def shard_sockets(data: str, admin: str, shard: int, count: int) -> list[tuple[str, str]]:
    """(data socket, operator socket) of every shard of a daemon run with `--shards
    count`, from shard `shard`'s (kvdepot.common.shards.shard_socket: shard 0 on PATH,
    shard i on PATH.shardI; a derived operator socket beside each data socket, a named
    one split the same way)."""
    base = data.removesuffix(f".shard{shard}") if shard else data
    named = admin != admin_socket_of(data)
    base_admin = admin.removesuffix(f".shard{shard}") if named and shard else admin
    return [
        (
            shard_socket(base, i),
            shard_socket(base_admin, i) if named else admin_socket_of(shard_socket(base, i)),
        )
        for i in range(count)
    ]


def read_shards(
    report: dict[str, Any],
    timeout: float,
    before: Mapping[int, admin_pb2.GetStatsResponse] | None = None,
) -> tuple[list[dict[str, Any]], dict[int, admin_pb2.GetStatsResponse]]:
    """Every shard's pool, sessions, jobs and event loop in one GetStats each, for the
    node's view; a shard that does not answer is listed with its error. The loop's share
    of a core is over the interval since `before` (each shard's previous reading, by
    shard), else since the shard started. Returns the rows and this reading, by shard."""
    d = report["daemon"]
    rows = []
    readings: dict[int, admin_pb2.GetStatsResponse] = {}
    for i, (data, admin) in enumerate(
        shard_sockets(report["socket"], report["admin_socket"], d["shard"], d["shard_count"])
    ):
        row: dict[str, Any] = {"shard": i, "socket": data}
        try:
            with connect(admin, timeout) as channel:
                s = Sampler(admin, channel, timeout).stats()
        except StatusError as err:
            row["error"] = str(err)
        else:
            readings[i] = s
            row.update(
                capacity_bytes=s.capacity_bytes,
                used_bytes=s.used_bytes,
                ready_blocks=s.ready_blocks,
                sessions=s.sessions,
                registrations=s.registrations,
                lane_jobs=s.lane_jobs,
                boot_id=s.boot_id,
                loop=loop_load((before or {}).get(i), s),
            )
        rows.append(row)
    return rows, readings


@dataclass(frozen=True)
class Sample:
    """One reading of the daemon: GetStats, ListNamespaces, ListEngines."""

    taken_at: float  # time.time() on this side
    stats: admin_pb2.GetStatsResponse
    namespaces: list[admin_pb2.NamespaceInfo]
    engines: list[admin_pb2.EngineInfo]


class Sampler:
    """Reads samples over one channel; every failure becomes a StatusError."""

    def __init__(self, path: str, channel: grpc.Channel, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout
        self.stub = admin_pb2_grpc.AdminStub(channel)

    def stats(self) -> admin_pb2.GetStatsResponse:
        """GetStats alone."""
        try:
            return self.stub.GetStats(admin_pb2.GetStatsRequest(), timeout=self.timeout)
        except grpc.RpcError as err:
            raise rpc_error(self.path, err, self.timeout) from None

    def sample(self) -> Sample:
        stats = self.stats()
        try:
            namespaces = self.stub.ListNamespaces(
                admin_pb2.ListNamespacesRequest(), timeout=self.timeout
            ).namespaces
            engines = self.stub.ListEngines(
                admin_pb2.ListEnginesRequest(), timeout=self.timeout
            ).engines
        except grpc.RpcError as err:
            raise rpc_error(self.path, err, self.timeout) from None
        return Sample(time.time(), stats, list(namespaces), list(engines))


def plain(msg: Message) -> dict[str, Any]:
    """Every field of a message (zero values included) as JSON-ready Python values;
    numbers stay numbers (protobuf's JSON mapping would quote 64-bit integers)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vtype = field.message_type.fields_by_name["value"]
            out[field.name] = {
                k: plain(v) if vtype.message_type is not None else v for k, v in value.items()
            }
        elif field.message_type is not None:
            if field.is_repeated:
                out[field.name] = [plain(v) for v in value]
            else:
                out[field.name] = plain(value)
        elif field.is_repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out


def _engine(e: admin_pb2.EngineInfo) -> dict[str, Any]:
    regs = []
    for r in e.registrations:
        reg = plain(r)
        # A daemon that says why it chose the path (a newer one) is shown as is.
        reg.setdefault("memory_path_reason", MEMORY_PATH_MEANING.get(r.memory_path, ""))
        regs.append(reg)
    return {
        "client_name": e.client_name,
        "engine_id": e.engine_id,
        "session_id": e.session_id,
        "pid": e.pid,
        "connected_seconds": e.connected_seconds,
        "ranks": sorted(
            {u for r in e.registrations for u in range(r.rank, r.rank + max(1, r.unit_count))}
        ),
        "memory_paths": sorted({r.memory_path for r in e.registrations}),
        "registered_bytes": sum(r.registered_bytes for r in e.registrations),
        "pinned_blocks": e.pinned_blocks,
        "registrations": regs,
    }


def rates(prev: Sample | None, cur: Sample) -> dict[str, Any] | None:
    """Per-second rates between two samples of the same daemon run; None when there is
    no earlier sample, the daemon restarted in between, or no time passed."""
    if prev is None or prev.stats.boot_id != cur.stats.boot_id:
        return None
    dt = cur.stats.uptime_seconds - prev.stats.uptime_seconds  # the daemon's own clock
    if dt <= 0:
        return None
    out: dict[str, Any] = {"interval_seconds": dt}
    fields = cur.stats.DESCRIPTOR.fields_by_name
    optional = {k: f for k, f in OPTIONAL_RATES.items() if f in fields}
    optional |= {k: k for k in (*REMOTE_COUNTERS, *DISK_COUNTERS) if k in fields}
    for name, field in (RATE_COUNTERS | optional).items():
        out[f"{name}_per_second"] = (getattr(cur.stats, field) - getattr(prev.stats, field)) / dt
    before = prev.stats.evictions_by_reason
    out["evictions_by_reason_per_second"] = {
        reason: (n - before.get(reason, 0)) / dt
        for reason, n in sorted(cur.stats.evictions_by_reason.items())
    }
    return out


def _extras(stats: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """GetStats fields this version does not know: (remote tier's, everything else)."""
    known = KNOWN_STATS.union(OPTIONAL_COUNTERS, RECOVERY)
    unknown = {k: v for k, v in stats.items() if k not in known}
    remote = {k: v for k, v in unknown.items() if "remote" in k}
    return remote, {k: v for k, v in unknown.items() if k not in remote}


def _numa(s: admin_pb2.GetStatsResponse) -> dict[str, Any] | None:
    """The NUMA placement; None from a daemon older than --numa."""
    if "numa_policy" not in s.DESCRIPTOR.fields_by_name or not s.numa_policy:
        return None
    return {
        "host_nodes": s.numa_host_nodes,
        "policy": s.numa_policy,
        "pool_nodes": list(s.numa_pool_nodes),
        "basis": s.numa_basis,
        "copy_threads": [
            {"node": n if n >= 0 else None, "cpus": c or None}
            for n, c in zip(s.numa_copy_thread_nodes, s.numa_copy_thread_cpus, strict=False)
        ],
        # Absent from a daemon older than --gpu-copy-threads: no GPU threads shown.
        "gpu_copy_devices": list(getattr(s, "gpu_copy_devices", ())),
        "gpu_copy_threads": getattr(s, "gpu_copy_threads", 0),
        "gpu_copy_nodes": list(getattr(s, "gpu_copy_nodes", ())),
    }


def build_report(
    path: str, prev: Sample | None, cur: Sample, *, admin_socket: str | None = None
) -> dict[str, Any]:
    """The status as a plain dict: the state at `cur`, rates since `prev`. `path` is the
    data socket; `admin_socket` the operator socket the samples were read on."""
    s = cur.stats
    everything = plain(s)
    remote, other = _extras(everything)
    disk = {k: other.pop(k) for k in list(other) if k.startswith("disk_")}
    capacity = s.capacity_bytes
    return {
        "socket": path,
        "admin_socket": admin_socket or admin_socket_of(path),
        "taken_at": cur.taken_at,
        "daemon": {
            "version": s.version,
            "boot_id": s.boot_id,
            "uptime_seconds": s.uptime_seconds,
            "pool_backing": s.pool_backing,
            "warm_restarted": s.warm_restarted,
            # Shard `shard` of `shard_count` (kvdepot serve --shards); 1: not sharded
            # (an older daemon says 0, read as 1).
            "shard": s.shard,
            "shard_count": max(1, s.shard_count),
        },
        "pool": {
            "capacity_bytes": capacity,
            "used_bytes": s.used_bytes,
            "pinned_bytes": s.pinned_bytes,
            "free_bytes": max(0, capacity - s.used_bytes),
            "largest_free_extent_bytes": s.largest_free_extent_bytes,
            "used_fraction": s.used_bytes / capacity if capacity else 0.0,
        },
        "warmup": {
            "done_bytes": s.warmup_done_bytes,
            "capacity_bytes": capacity,
            "fraction": s.warmup_done_bytes / capacity if capacity else 1.0,
            "complete": s.warmup_complete,
            # Engine memory (shm registrations) the daemon is still mapping.
            "populating_bytes": getattr(s, "populating_bytes", 0),
        },
        # None on a daemon that serves no CUDA device (nothing to page-lock), or one
        # older than the page-locking fields.
        "page_locking": {
            "locked_bytes": s.page_locked_bytes,
            "fraction": s.page_locked_bytes / capacity if capacity else 1.0,
            "complete": s.page_locked_bytes >= capacity,
            "error": s.page_locking_error or None,
        }
        if getattr(s, "page_locking", False)
        else None,
        "numa": _numa(s),
        "copies": copy_load(prev.stats if prev is not None else None, s),
        "loop": loop_load(prev.stats if prev is not None else None, s),
        "blocks": {
            "ready": s.ready_blocks,
            "writing": s.writing_blocks,
            "pinned": s.pinned_blocks,
            "inflight_jobs": s.inflight_jobs,
            "job_lanes_open": s.job_lanes_open,
        },
        "namespaces": [plain(ns) for ns in cur.namespaces],
        "engines": [_engine(e) for e in cur.engines],
        "rates": rates(prev, cur),
        "totals": {k: everything[k] for k in (*TOTALS, *OPTIONAL_COUNTERS) if k in everything},
        "recovery": {k: everything[k] for k in RECOVERY if k in everything} or None,
        "remote": remote or None,
        "disk": disk or None,
        "other": other,
    }
