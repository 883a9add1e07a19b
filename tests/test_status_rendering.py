"""`kvdepot status` rendering reports from other daemon versions: counters an older daemon
lacks, fields it does not know, the remote tier's health.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from kvdepot.v1 import admin_pb2
from tests.support.daemon import DaemonProcess
from tests.support.ops import admin
from tests.support.status_cli import WIDTH, status_json


def _screen(report: dict[str, Any]) -> str:
    """The screen `kvdepot status` prints for `report`, WIDTH columns wide."""
    from rich.console import Console

    from kvdepot.server.status.render import render

    console = Console(width=WIDTH)
    with console.capture() as cap:
        console.print(render(report))
    return cap.get()


def _screen_words(report: dict[str, Any]) -> str:
    """`_screen` with its line breaks and runs of spaces as single spaces."""
    return " ".join(_screen(report).split())


def _stats_class(add: dict[str, int], drop: Iterable[str] = ()) -> Any:
    """GetStatsResponse as another daemon version would have it: fields added (name ->
    FieldDescriptorProto type) and dropped, in a descriptor pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto()
    admin_pb2.DESCRIPTOR.CopyToProto(proto)
    (msg,) = [m for m in proto.message_type if m.name == "GetStatsResponse"]
    kept = [f for f in msg.field if f.name not in set(drop)]
    del msg.field[:]
    msg.field.extend(kept)
    for number, (name, kind) in enumerate(add.items(), start=9000):
        msg.field.add(
            name=name,
            number=number,
            type=kind,  # type: ignore[arg-type]
            label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("kvdepot.v1.GetStatsResponse")
    )


def test_older_daemon_without_job_and_pin_counters(guide_daemon: DaemonProcess) -> None:
    """A daemon that predates the job, block and pin counters: shown without them."""
    from rich.console import Console

    from kvdepot.server.status.render import render
    from kvdepot.server.status.report import OPTIONAL_COUNTERS, Sample, build_report

    older = _stats_class({}, drop=OPTIONAL_COUNTERS)
    ch, stub = admin(guide_daemon)
    with ch:
        first = older.FromString(stub.GetStats(admin_pb2.GetStatsRequest()).SerializeToString())
        time.sleep(0.1)
        second = older.FromString(stub.GetStats(admin_pb2.GetStatsRequest()).SerializeToString())
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(1, second, [], []))
    assert not set(OPTIONAL_COUNTERS) & set(report["totals"])
    assert "pin_keys_per_second" not in report["rates"]
    assert not set(report["other"]) & set(OPTIONAL_COUNTERS) and report["totals"]["stores"] == 4
    console = Console(width=WIDTH)
    with console.capture() as cap:
        console.print(render(report))
    assert "failed jobs" not in cap.get() and "11 ready" in cap.get()


def test_remote_tier_and_unknown_fields(guide_daemon: DaemonProcess) -> None:
    """The remote tier: one line when off; health, rates and trouble when on. Fields a
    newer daemon adds to GetStats reach --json and the screen without this version
    knowing them (GetStatsResponse rebuilt with three more fields, filled from a live
    reading plus values)."""
    from google.protobuf.descriptor_pb2 import FieldDescriptorProto as F

    from kvdepot.server.status.report import Sample, build_report

    off = status_json(guide_daemon.socket_path, "--interval", "0")
    if off["remote"] is not None:  # a daemon with a remote tier, started without one
        assert off["remote"]["remote_enabled"] is False
        assert re.search(r"^remote\s+off\b", _screen(off), re.M), _screen(off)

    newer = _stats_class(
        {"remote_future_gauge": F.TYPE_BOOL, "remote_future_bytes": F.TYPE_UINT64,
         "future_spill_files": F.TYPE_UINT64}
    )  # fmt: skip
    ch, stub = admin(guide_daemon)
    with ch:
        live = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    first, second = newer.FromString(live.SerializeToString()), newer()
    first.remote_future_gauge, first.remote_future_bytes, first.future_spill_files = True, 5, 7
    second.CopyFrom(first)
    second.uptime_seconds += 2.0
    has_tier = "remote_enabled" in newer.DESCRIPTOR.fields_by_name
    if has_tier:
        for m in (first, second):
            m.remote_enabled = True
        second.remote_writes, second.remote_write_bytes = 8, 8 << 20  # 4/s, 4 MiB/s
        second.remote_hits, second.remote_misses, second.remote_errors = 3, 1, 2
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    # (Containment: the daemon may already send fields this version does not know.)
    assert report["remote"].items() >= {"remote_future_bytes": 5}.items()
    assert report["other"]["future_spill_files"] == 7
    assert report["blocks"]["ready"] == 11  # the known fields as before
    text = _screen(report)
    for needle in ("remote_future_bytes 5", "remote_future_gauge True", "future_spill_files 7"):
        assert needle in text, text
    if has_tier:
        assert report["rates"]["remote_writes_per_second"] == 4
        assert "DOWN" in text and "writes 4.0/s 4.0 MiB/s" in text and "75% hit" in text, text
        assert "errors 2" in text
        second.remote_healthy = True
        text = _screen(build_report("/x.sock", None, Sample(2, second, [], [])))
        assert re.search(r"^remote\s+healthy\s*$", text, re.M), text


def test_gpu_copy_threads_line(guide_daemon: DaemonProcess) -> None:
    """Once GPUs have registered, the numa part says how many copy threads each has of its
    own; a daemon older than --gpu-copy-threads shows none."""

    from kvdepot.server.status.report import Sample, build_report

    ch, stub = admin(guide_daemon)
    with ch:
        live = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    live.gpu_copy_devices.extend(["GPU-0c1d", "GPU-77ab"])
    live.gpu_copy_threads = 3
    report = build_report("/x.sock", None, Sample(0, live, [], []))
    assert report["numa"]["gpu_copy_devices"] == ["GPU-0c1d", "GPU-77ab"]
    assert "GPU copy threads: 3 for each of 2 GPUs" in _screen(report)
    assert "GPU copy threads: 3 for each of 2 GPUs;" not in _screen(report)  # one node here
    # On a host of two nodes, where each GPU's threads run (-1: not on one node).
    live.numa_host_nodes = 2
    live.gpu_copy_devices.append("GPU-9e2f")
    live.gpu_copy_nodes.extend([1, 0, -1])
    report = build_report("/x.sock", None, Sample(0, live, [], []))
    assert report["numa"]["gpu_copy_nodes"] == [1, 0, -1]
    assert (
        "GPU copy threads: 3 for each of 3 GPUs; on node 0 (1 GPU), node 1 (1 GPU), "
        "no one node (1 GPU)" in _screen_words(report)
    )
    older = _stats_class({}, drop=("gpu_copy_devices", "gpu_copy_threads", "gpu_copy_nodes"))
    old = older.FromString(live.SerializeToString())
    report = build_report("/x.sock", None, Sample(0, old, [], []))
    assert report["numa"]["gpu_copy_devices"] == [] and "GPU copy" not in _screen(report)


def test_copies_line_reads_busy_share_and_wait_over_the_interval(
    guide_daemon: DaemonProcess,
) -> None:
    """Two readings 2 s apart: 2 CPU threads busy 3 s of their 4 (75%), 100 copies that
    waited 0.5 s in all (5 ms each); 2 GPUs with 2 threads each, busy 1 s of 8, the
    first GPU's 0.75 s of its 4 (19%). A copy running for seconds: a STALLED warning
    naming its threads. One reading: the same since start. A daemon before the
    copy-time fields: no line."""

    from kvdepot.server.status.report import Sample, build_report

    ch, stub = admin(guide_daemon)
    with ch:
        first = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    first.uptime_seconds = 10.0
    first.copy_threads, first.gpu_copy_threads = 2, 2
    first.gpu_copy_devices.extend(["GPU-0c1d", "GPU-77ab"])
    first.copies_started, first.copy_wait_seconds, first.copy_busy_seconds = 400, 1.0, 6.0
    first.gpu_copies_started.extend([10, 5])
    first.gpu_copy_wait_seconds.extend([0.0, 0.0])
    first.gpu_copy_longest_running_seconds.extend([0.0, 0.0])
    first.gpu_copy_busy_seconds.extend([0.25, 0.5])
    second = admin_pb2.GetStatsResponse.FromString(first.SerializeToString())
    second.uptime_seconds = 12.0
    second.copies_started, second.copy_wait_seconds, second.copy_busy_seconds = 500, 1.5, 9.0
    second.gpu_copies_started[:] = [40, 15]  # 30 and 10 more
    second.gpu_copy_busy_seconds[:] = [1.0, 0.75]  # 0.75 s and 0.25 s more
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    cpu, gpu = report["copies"]["cpu"], report["copies"]["gpu"]
    assert (cpu["threads"], cpu["copies"]) == (2, 100)
    assert abs(cpu["busy_fraction"] - 0.75) < 1e-9 and abs(cpu["wait_ms_mean"] - 5.0) < 1e-9
    assert (gpu["threads"], gpu["copies"], gpu["wait_ms_mean"]) == (4, 40, 0.0)
    assert abs(gpu["busy_fraction"] - 1 / 8) < 1e-9
    assert gpu["busiest"]["device"] == "GPU-0c1d" and gpu["busiest"]["copies"] == 30
    assert abs(gpu["busiest"]["busy_fraction"] - 0.1875) < 1e-9
    text = _screen_words(report)
    assert "copies CPU 2 threads 75% busy, wait 5.00 ms a copy (100 copies)" in text
    assert "GPU 4 threads 12% busy, wait 0.00 ms a copy (40 copies)" in text
    assert "busiest GPU GPU-0c1d: 19% busy, wait 0.00 ms a copy" in text
    assert report["copies"]["stalled"] == {} and "STALLED" not in text
    # A copy on the first GPU running 42 s (its DMA hung): a warning; the other GPU's
    # copy, running 1 s, is not one.
    second.gpu_copy_longest_running_seconds[:] = [42.0, 1.0]
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    assert report["copies"]["stalled"] == {"GPU-0c1d": 42.0}
    assert "STALLED: a copy on GPU GPU-0c1d has run 42 s (a hung DMA?)" in _screen_words(report)
    second.copy_longest_running_seconds = 6.0
    second.gpu_copy_longest_running_seconds[:] = [0.0, 0.0]
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    assert report["copies"]["stalled"] == {"CPU": 6.0}
    assert "STALLED: a copy on the CPU threads has run 6 s" in _screen_words(report)
    # One reading: since start (busy 9 s of 2 threads x 12 s).
    alone = build_report("/x.sock", None, Sample(2, second, [], []))["copies"]
    assert alone["over"] == "since start" and abs(alone["cpu"]["busy_fraction"] - 0.375) < 1e-9
    older = _stats_class({}, drop=("copy_threads", "copies_started", "copy_wait_seconds"))
    old = older.FromString(second.SerializeToString())
    report = build_report("/x.sock", None, Sample(0, old, [], []))
    assert report["copies"] is None and "copies " not in _screen_words(report)


def test_event_loop_line_reads_its_share_of_a_core_and_says_when_to_shard(
    guide_daemon: DaemonProcess,
) -> None:
    """Two readings 2 s apart, the loop's CPU 1.9 s more: 95% of a core, and the hint
    to run more shards. One reading: 4.9 s of CPU in 12 s since start, 41%, no hint. A
    daemon that does not count it (0, or a version before the field): no line."""

    from kvdepot.server.status.report import Sample, build_report

    ch, stub = admin(guide_daemon)
    with ch:
        first = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    first.uptime_seconds, first.loop_cpu_seconds = 10.0, 3.0
    second = admin_pb2.GetStatsResponse.FromString(first.SerializeToString())
    second.uptime_seconds, second.loop_cpu_seconds = 12.0, 4.9
    report = build_report("/x.sock", Sample(0, first, [], []), Sample(2, second, [], []))
    assert report["loop"]["over"] == "interval"
    assert abs(report["loop"]["busy_fraction"] - 0.95) < 1e-9
    assert (
        "event loop 95% of a core busy — the control plane is this daemon's limit: run "
        "more --shards" in _screen_words(report)
    )
    alone = build_report("/x.sock", None, Sample(2, second, [], []))
    assert alone["loop"]["over"] == "since start"
    assert abs(alone["loop"]["busy_fraction"] - 4.9 / 12) < 1e-9
    text = _screen_words(alone)
    assert "event loop 41% of a core busy since start" in text and "--shards" not in text
    second.loop_cpu_seconds = 0.0
    report = build_report("/x.sock", None, Sample(2, second, [], []))
    assert report["loop"] is None and "event loop" not in _screen_words(report)
    older = _stats_class({}, drop=("loop_cpu_seconds",))  # a daemon before the field
    report = build_report("/x.sock", None, Sample(2, older.FromString(b""), [], []))
    assert report["loop"] is None
