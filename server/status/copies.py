"""How busy the daemon's threads were between two GetStats readings: its copy threads,
for `kvdepot status`'s "copies" line (server/copy_queue.CopyTimes are what the daemon
counts), and its event loop, for the "event loop" line. Together they say which limits
the daemon: its copies or its control plane. Sans I/O: the readings in, plain dicts
out; report.py puts them in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvdepot.server.copy_queue import STALLED_COPY_SECONDS
from kvdepot.v1 import admin_pb2

# GetStats' fields of the copy threads' and the event loop's load.
THREAD_LOAD_FIELDS = (
    "copy_threads",
    "copies_started",
    "copy_wait_seconds",
    "copy_busy_seconds",
    "gpu_copies_started",
    "gpu_copy_wait_seconds",
    "gpu_copy_busy_seconds",
    "copy_longest_running_seconds",
    "gpu_copy_longest_running_seconds",
    "loop_cpu_seconds",
)


def copy_load(
    prev: admin_pb2.GetStatsResponse | None, s: admin_pb2.GetStatsResponse
) -> dict[str, Any] | None:
    """How loaded the copy threads are, over the interval since the reading `prev` (of
    the same daemon run) or else since start: for the shared CPU threads and the GPUs'
    own (summed, and the busiest GPU), each with its threads, copies, busy fraction
    (busy seconds over threads x wall seconds) and mean wait in the queue; and under
    "stalled", each copy-thread set whose oldest running copy has run
    STALLED_COPY_SECONDS or more ("CPU" or a GPU's UUID: seconds). None from a daemon
    older than the copy-time fields."""
    if "copies_started" not in s.DESCRIPTOR.fields_by_name:
        return None
    p, wall = _since(prev, s)

    def load(threads: int, copies: float, wait: float, busy: float) -> dict[str, Any]:
        return {
            "threads": threads,
            "copies": int(copies),
            "busy_fraction": busy / (threads * wall) if threads and wall > 0 else 0.0,
            "wait_ms_mean": 1e3 * wait / copies if copies else 0.0,
        }

    fields = ("copies_started", "copy_wait_seconds", "copy_busy_seconds")
    cpu = [getattr(s, f) - (getattr(p, f) if p is not None else 0) for f in fields]
    out: dict[str, Any] = {
        "over": "interval" if p is not None else "since start",
        "cpu": load(s.copy_threads, *cpu),
    }
    # Each GPU's figures since `prev` (a GPU that registered since then: since start).
    gpus = _per_gpu(s, fields)
    before = _per_gpu(p, fields) if p is not None else {}
    each = getattr(s, "gpu_copy_threads", 0)
    if gpus and each:
        deltas = {
            d: [v - w for v, w in zip(now, before.get(d, (0, 0.0, 0.0)), strict=True)]
            for d, now in gpus.items()
        }
        totals = [sum(column) for column in zip(*deltas.values(), strict=True)]
        out["gpu"] = load(each * len(gpus), *totals)
        if len(gpus) > 1:
            device, busiest = max(deltas.items(), key=lambda kv: kv[1][2])
            out["gpu"]["busiest"] = {"device": device, **load(each, *busiest)}
    out["stalled"] = _stalled(s)
    return out


def loop_load(
    prev: admin_pb2.GetStatsResponse | None, s: admin_pb2.GetStatsResponse
) -> dict[str, Any] | None:
    """The event loop's CPU over the wall time since the reading `prev` (of the same
    daemon run) or else since start, as a fraction of one core ("busy_fraction"; the
    loop is one thread). None from a daemon that does not count it."""
    if not getattr(s, "loop_cpu_seconds", 0.0):  # an older daemon's message: not counted
        return None
    p, wall = _since(prev, s)
    cpu = s.loop_cpu_seconds - (p.loop_cpu_seconds if p is not None else 0.0)
    return {
        "over": "interval" if p is not None else "since start",
        "busy_fraction": cpu / wall if wall > 0 else 0.0,
    }


def _since(
    prev: admin_pb2.GetStatsResponse | None, s: admin_pb2.GetStatsResponse
) -> tuple[admin_pb2.GetStatsResponse | None, float]:
    """The reading the figures count from (`prev`, if of the same daemon run; else None:
    since start) and the wall seconds since it."""
    p = prev if prev is not None and prev.boot_id == s.boot_id else None
    return p, s.uptime_seconds - (p.uptime_seconds if p is not None else 0.0)


def _stalled(s: admin_pb2.GetStatsResponse) -> dict[str, float]:
    """The copy threads whose oldest running copy is STALLED_COPY_SECONDS old or more."""
    if "copy_longest_running_seconds" not in s.DESCRIPTOR.fields_by_name:
        return {}
    ages = {"CPU": s.copy_longest_running_seconds}
    devices = getattr(s, "gpu_copy_devices", ())
    ages.update(zip(devices, getattr(s, "gpu_copy_longest_running_seconds", ()), strict=False))
    return {who: age for who, age in ages.items() if age >= STALLED_COPY_SECONDS}


def _per_gpu(s: admin_pb2.GetStatsResponse, fields: Sequence[str]) -> dict[str, list[float]]:
    """Each GPU's (copies, wait, busy) by UUID, from the gpu_-prefixed lists."""
    columns = [list(getattr(s, f"gpu_{f}", ())) for f in fields]
    devices = list(getattr(s, "gpu_copy_devices", ()))
    if any(len(c) != len(devices) for c in columns):  # a daemon without per-GPU figures
        return {}
    return {d: [c[i] for c in columns] for i, d in enumerate(devices)}
