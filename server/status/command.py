"""`kvdepot status`: the daemon at a glance, for the operator on the node.

    kvdepot status [--socket PATH] [--admin-socket PATH] [--watch] [--json] [--interval S]
                   [--probe]

The figures come from the Admin service, on the daemon's operator socket: PATH.admin
beside the data socket unless --admin-socket names another (as for serve). It is the
daemon's user's only (mode 0600) or an operator group's (serve --admin-group).

One screen (rendered with rich, 80 columns is enough): the pool with a bar (used,
pinned, free, largest free extent), warm-up progress and, on CUDA hosts, page-locking
progress, blocks, traffic rates over the last interval, namespaces, engines (pid, ranks,
memory path and what it means, age), the remote tier when the daemon reports one, and
boot id, version and uptime. A daemon run with `--shards N` is N daemons, each on
sockets of its own: the header then says "shard i of N" and how to read the others, and
the screen (once, or at every `--watch` reading) adds a table of every shard's pool,
sessions and jobs.

Rates need two readings: a one-shot status reads twice, `--interval` apart (default
1 s; `--interval 0` reads once and shows no rates). `--watch` redraws every interval
until Ctrl-C and keeps retrying, on screen, while the daemon is away. `--json` prints
the same content as one JSON object (one per line with `--watch`). `--probe` is the
container health check (on the data socket, as engines see it): exit 0 when
grpc.health.v1 answers SERVING, else 1. Strings that clients chose (client names,
engine ids, namespace descriptions) are shown escaped (kvdepot.common.escape).

Errors are one line on stderr, exit status 1: no socket, permission (names the group
to join), nothing listening, not a kvdepot daemon, no answer in time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvdepot.common.escape import escaped
from kvdepot.server.config import default_socket_path
from kvdepot.server.status.render import render
from kvdepot.server.status.report import (
    Sample,
    Sampler,
    StatusError,
    admin_socket_of,
    build_report,
    connect,
    health_probe,
    read_shards,
    socket_path_of,
)

if TYPE_CHECKING:
    from kvdepot.v1 import admin_pb2


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        default=os.environ.get("KVDEPOT_SOCKET") or default_socket_path(),
        help="the daemon's Unix socket, as for serve (KVDEPOT_SOCKET; default %(default)s)",
    )
    parser.add_argument(
        "--admin-socket",
        default=os.environ.get("KVDEPOT_ADMIN_SOCKET") or None,
        help="the daemon's operator socket, as for serve (KVDEPOT_ADMIN_SOCKET; default: "
        "the --socket path + .admin)",
    )
    parser.add_argument("--watch", action="store_true", help="redraw every interval until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the screen")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the two readings that give rates, and between redraws "
        "(default %(default)s; 0: one reading, no rates)",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)"
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="health check only: exit 0 if the daemon's gRPC health service says SERVING",
    )


def run_status(args: argparse.Namespace) -> int:
    data = socket_path_of(args.socket)
    path = socket_path_of(args.admin_socket) if args.admin_socket else admin_socket_of(data)
    try:
        if args.probe:
            health_probe(data, timeout=args.timeout)
            return 0
        if args.watch:
            return _watch(data, path, args)
        _print_once(data, path, args)
        return 0
    except StatusError as exc:
        print(f"kvdepot status: {escaped(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _read(data: str, path: str, timeout: float, interval: float) -> dict[str, Any]:
    """A report of the daemon whose data socket is `data`, read on its operator socket `path`."""
    with connect(path, timeout) as channel:
        sampler = Sampler(path, channel, timeout)
        first = sampler.sample()
        if interval <= 0:
            return build_report(data, None, first, admin_socket=path)
        time.sleep(interval)
        return build_report(data, first, sampler.sample(), admin_socket=path)


def _node_view(
    report: dict[str, Any],
    timeout: float,
    before: dict[int, admin_pb2.GetStatsResponse] | None = None,
) -> dict[int, admin_pb2.GetStatsResponse]:
    """Adds every shard's pool, jobs and event loop (`shards`) to `report` when its daemon
    is one shard of several: the node, beside the shard it was read from. `before`: the
    shards' previous reading (rates over the interval since). Returns this reading."""
    if report["daemon"]["shard_count"] <= 1:
        return {}
    report["shards"], readings = read_shards(report, timeout, before)
    return readings


def _print_once(data: str, path: str, args: argparse.Namespace) -> None:
    report = _read(data, path, args.timeout, args.interval)
    _node_view(report, args.timeout)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    from rich.console import Console

    Console(highlight=False).print(render(report))


def _watch(data: str, path: str, args: argparse.Namespace) -> int:
    """Redraws until Ctrl-C; a daemon that goes away is shown, and picked up again.

    Ctrl-C sets a flag that the loop checks between readings: a KeyboardInterrupt
    raised inside a gRPC call can leave the process hanging at exit.
    """
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    interval = args.interval if args.interval > 0 else 1.0
    console = Console(highlight=False)
    stop = threading.Event()
    prev: Sample | None = None
    shards_before: dict[int, admin_pb2.GetStatsResponse] = {}
    last_good: Any = None

    def frames() -> Iterator[Any]:
        nonlocal prev, shards_before, last_good
        while not stop.is_set():
            try:
                with connect(path, args.timeout) as channel:
                    sampler = Sampler(path, channel, args.timeout)
                    while not stop.is_set():
                        cur = sampler.sample()
                        report = build_report(data, prev, cur, admin_socket=path)
                        shards_before = _node_view(report, args.timeout, shards_before)
                        prev = cur
                        last_good = report
                        yield report
                        stop.wait(interval)
            except StatusError as exc:
                prev = None  # rates restart with the next daemon
                yield exc
                stop.wait(interval)

    def view(item: Any) -> Any:
        if isinstance(item, StatusError):
            stamp = time.strftime("%H:%M:%S")
            line = escaped(f"{stamp} {item} (retrying every {interval:g}s)")
            err = Text(line, style="bold red")
            if last_good is None:
                return err
            return Group(err, Text("last reading:", style="dim"), render(last_good))
        return render(item)

    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        if args.json:
            for item in frames():
                if isinstance(item, StatusError):
                    print(json.dumps({"error": str(item), "taken_at": time.time()}), flush=True)
                else:
                    print(json.dumps(item), flush=True)
        elif not console.is_terminal:  # piped: frames one after another
            for item in frames():
                console.print(view(item))
                console.rule()
        else:
            with Live(console=console, screen=True, auto_refresh=False) as live:
                for item in frames():
                    live.update(view(item), refresh=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
