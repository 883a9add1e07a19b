"""Operating the daemon, end to end: real `kvdepot serve` processes, real grpcurl, real
HTTP scrapes, real notify datagrams. No mocks.

- The operations guide (docs/operations.md) cannot rot: every `$ ` command in its
  ```console blocks runs against a live daemon after a known scenario, and its answer
  must match the output printed in the guide (volatile fields such as the boot id,
  uptimes and pids aside). The guide must also cover every Admin method and every
  kvdepot_ metric a live daemon exports.
- Metrics scraped over HTTP after a known sequence of stores, loads and evictions show
  exactly those counts and bytes, histogram counts, sums and buckets included.
- systemd notify: READY=1 only once the gRPC socket accepts, WATCHDOG=1 keeps coming,
  STATUS= about the pool warm-up, STOPPING=1 on SIGTERM.
- Health answers NOT_SERVING during shutdown; --no-destructive-admin refuses Evict and
  Clear with PERMISSION_DENIED.

The guide's outputs are captured from a live daemon by this file itself:

    python tests/test_operations.py --write-docs

reruns the scenario and rewrites the output under every command in the guide (review
the diff: the test then holds the guide to it).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

if __package__ in (None, ""):  # run as a script (--write-docs)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdepot.client import DepotClient
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, kvdepot_command
from tests.support.engine import Engine, Geometry, chunk_plan, make_key

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "operations.md"
# What the guide writes, replaced by the live daemon's socket and metrics address.
GUIDE_SOCKET = "/run/kvdepot/kvdepot.sock"
GUIDE_METRICS = "localhost:9477"
# Fields whose values differ from run to run; the guide's keys must still be there.
VOLATILE_FIELDS = {
    "boot_id",
    "uptime_seconds",
    "session_id",
    "pid",
    "connected_seconds",
    "version",
    "registration_id",
}  # registration ids start at random per boot
HEALTH = health_pb2.HealthCheckResponse
DaemonFactory = Callable[..., DaemonProcess]  # conftest's daemon_factory


# --- small helpers ----------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free right now (the daemon binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET /metrics -> {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(metrics: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in metrics, f"no sample {name}{labels} in the scrape"
    return metrics[key]


def admin(d: DaemonProcess) -> tuple[grpc.Channel, admin_pb2_grpc.AdminStub]:
    ch = d.channel()
    return ch, admin_pb2_grpc.AdminStub(ch)


def store(eng: Engine, chunks: range, base_block: int = 0, salt: bytes = b"") -> pb.TransferResult:
    """Fills `chunks` (every group) with their expected bytes and stores them."""
    keys, group_blocks, indices = chunk_plan(eng.geo, chunks, salt=salt, base_block=base_block)
    n = len(chunks)
    for g, blocks in enumerate(group_blocks):
        eng.fill(g, keys[g * n : (g + 1) * n], blocks, indices[g])
    res = eng.job(pb.STORE, keys, group_blocks, indices)
    assert res.success, res.error
    return res


def load(eng: Engine, chunks: range, base_block: int) -> pb.TransferResult:
    """Loads `chunks` into other blocks and checks every byte."""
    keys, group_blocks, indices = chunk_plan(eng.geo, chunks, base_block=base_block)
    res = eng.job(pb.LOAD, keys, group_blocks, indices)
    assert res.success, res.error
    n = len(chunks)
    for g, blocks in enumerate(group_blocks):
        assert eng.mismatches(g, keys[g * n : (g + 1) * n], blocks, indices[g]) == 0
    return res


def rank_bytes(geo: Geometry, chunks: int) -> int:
    """Bytes one rank's job moves for `chunks` chunks of every group."""
    return chunks * geo.blocks_per_chunk * sum(geo.layer_pages)


def connect(target: str, name: str) -> DepotClient:
    client = DepotClient(target, client_name=name, engine_id=name.split()[0]).start()
    assert client.wait_connected(10), f"{name}: no session"
    return client


# --- the guide's scenario -------------------------------------------------------------------


@dataclass
class DescribedGeometry(Geometry):
    """A Geometry whose namespace carries a description (ListNamespaces shows it)."""

    description: str = ""

    def layout(self) -> pb.NamespaceLayout:
        lay = super().layout()
        lay.description = self.description
        return lay


def _namespace_id(name: str) -> str:
    # Shaped like the connector's ids ("kvd1-" + 40 hex digits of a digest).
    return "kvd1-" + hashlib.sha256(name.encode()).hexdigest()[:40]


GEO_A = DescribedGeometry(
    namespace=_namespace_id("operations guide: engine A"),
    description="synthetic engine A: 2 groups (2 and 3 layers), bpc=2, world=2",
)
GEO_B = DescribedGeometry(
    groups=[[2048, 2048, 2048, 2048]],
    blocks_per_chunk=4,
    world_size=1,
    num_blocks=64,
    namespace=_namespace_id("operations guide: engine B"),
    description="synthetic engine B: 1 group (4 layers), bpc=4, world=1",
)


@dataclass
class GuideScenario:
    """Two engines that stay connected while the guide's commands run."""

    clients: list[DepotClient] = field(default_factory=list)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def run_guide_scenario(target: str) -> GuideScenario:
    """The state the guide's outputs show:

    engine A (one session, TP ranks 0 and 1 registered): chunks 0-3 of both groups
    stored by both ranks (8 ready blocks), chunk 4 by rank 0 only (2 writing blocks),
    6 lookups (4 hits, 2 misses), chunk 0 of group 0 pinned, chunks 0-1 loaded by rank 0;
    engine B (world size 1): chunks 0-2 stored (3 ready blocks).
    """
    sc = GuideScenario()
    try:
        a = connect(target, "engine-a (synthetic, TP=2)")
        sc.clients.append(a)
        rank0, rank1 = Engine(a, GEO_A, 0), Engine(a, GEO_A, 1)
        store(rank0, range(0, 4))
        store(rank1, range(0, 4))
        store(rank0, range(4, 5), base_block=64)  # rank 1 never does: stays "writing"
        hits = a.lookup(GEO_A.namespace, [make_key(c, 0) for c in range(6)])
        assert hits == [True] * 4 + [False] * 2  # chunk 4 is still writing, 5 was never stored
        assert a.pin(GEO_A.namespace, [make_key(0, 0)]) == [True]
        load(rank0, range(0, 2), base_block=128)
        b = connect(target, "engine-b (synthetic)")
        sc.clients.append(b)
        store(Engine(b, GEO_B, 0), range(0, 3), salt=b"B")  # other prompts, other keys
    except BaseException:
        sc.close()
        raise
    return sc


def check_guide_state(d: DaemonProcess) -> None:
    """The scenario's figures, derived independently of the guide's printed outputs
    (so regenerating the guide from a broken daemon would not go unnoticed)."""
    ch, stub = admin(d)
    with ch:
        s = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    row = {
        g: GEO_A.world_size * GEO_A.blocks_per_chunk * sum(pages)
        for g, pages in enumerate(GEO_A.groups)
    }
    assert (s.namespaces, s.sessions, s.registrations) == (2, 2, 3)
    assert (s.ready_blocks, s.writing_blocks, s.pinned_blocks) == (8 + 3, 2, 1)
    assert (s.lookups, s.hits, s.misses) == (6, 4, 2)
    assert s.stores == 4 and s.loads == 1 and s.evictions == 0
    # Jobs and blocks: 2 ranks x 4 chunks x 2 groups, chunk 4 of both groups by rank 0,
    # engine B's 3 chunks; the load read chunks 0-1 of both groups.
    assert (s.store_jobs, s.stored_blocks) == (4, 2 * 4 * 2 + 2 + 3)
    assert (s.load_jobs, s.loaded_blocks) == (1, 2 * 2)
    assert (s.failed_store_jobs, s.failed_load_jobs) == (0, 0)
    assert (s.pin_calls, s.pin_keys, s.pinned_keys) == (1, 1, 1)
    assert s.stored_bytes == 2 * rank_bytes(GEO_A, 4) + rank_bytes(GEO_A, 1) + rank_bytes(GEO_B, 3)
    assert s.loaded_bytes == rank_bytes(GEO_A, 2)
    slot_b = GEO_B.blocks_per_chunk * sum(GEO_B.layer_pages)
    assert s.used_bytes == 5 * (row[0] + row[1]) + 3 * slot_b
    assert s.pinned_bytes == row[0]
    assert s.warmup_complete


# --- the guide's commands -------------------------------------------------------------------


@dataclass
class GuideCommand:
    """One `$ command` of a ```console block and the output printed under it."""

    line: int  # 1-based line of the "$ " in the guide
    command: str  # continuation lines joined
    expected: str
    daemon: str  # "main", or "readonly" (the block's <!-- ops-test: daemon=readonly -->)
    out_start: int  # 0-based line range of the printed output
    out_end: int


_DIRECTIVE = re.compile(r"<!--\s*ops-test:\s*daemon=(\w+)\s*-->")


def parse_guide(text: str) -> list[GuideCommand]:
    """The `$ ` commands of every ```console block, with their printed output.

    A block runs against the main daemon unless the line before it (blank lines
    aside) is `<!-- ops-test: daemon=NAME -->`. A command may continue over lines
    ending in a backslash.
    """
    lines = text.splitlines()
    commands: list[GuideCommand] = []
    daemon, i = "main", 0
    while i < len(lines):
        stripped = lines[i].strip()
        i += 1
        directive = _DIRECTIVE.fullmatch(stripped)
        if directive:
            daemon = directive.group(1)
            continue
        if stripped != "```console":
            if stripped:
                daemon = "main"  # a directive applies to the block right after it
            continue
        while i < len(lines) and lines[i].strip() != "```":
            if not lines[i].startswith("$ "):
                raise ValueError(f"{GUIDE.name}:{i + 1}: expected a `$ ` command line")
            start, parts = i, [lines[i][2:]]
            while parts[-1].endswith("\\"):
                parts[-1] = parts[-1][:-1]
                i += 1
                parts.append(lines[i])
            i += 1
            out_start = i
            while i < len(lines) and lines[i].strip() != "```" and not lines[i].startswith("$ "):
                i += 1
            commands.append(
                GuideCommand(
                    line=start + 1,
                    command=" ".join(p.strip() for p in parts),
                    expected="\n".join(lines[out_start:i]),
                    daemon=daemon,
                    out_start=out_start,
                    out_end=i,
                )
            )
        i += 1  # the closing fence
        daemon = "main"
    return commands


def guide_env() -> dict[str, str]:
    """The venv's bin first on PATH (its grpcurl, python3)."""
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def run_guide_command(
    cmd: GuideCommand, daemons: dict[str, DaemonProcess], metrics: str, env: dict[str, str]
) -> tuple[int, str]:
    live = cmd.command.replace(GUIDE_SOCKET, daemons[cmd.daemon].socket_path)
    live = live.replace(GUIDE_METRICS, metrics)
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", live],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        env=env,
    )
    return out.returncode, out.stdout.rstrip("\n")


def _mask(value: object) -> object:
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE_FIELDS else _mask(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def output_mismatch(expected: str, actual: str) -> str | None:
    """None when `actual` answers like `expected` (JSON compared as data)."""
    try:
        want, got = json.loads(expected), json.loads(actual)
    except json.JSONDecodeError:
        norm = [ln.rstrip() for ln in expected.strip("\n").splitlines()]
        if norm == [ln.rstrip() for ln in actual.strip("\n").splitlines()]:
            return None
        return f"expected:\n{expected}\ngot:\n{actual}"
    if _mask(want) == _mask(got):
        return None
    return (
        f"expected:\n{json.dumps(_mask(want), indent=1)}\ngot:\n{json.dumps(_mask(got), indent=1)}"
    )


def needs_tool(command: str) -> str | None:
    """A tool the command pipes into that this machine lacks (xxd is not everywhere)."""
    for tool in ("xxd", "curl"):
        if re.search(rf"(^|\|)\s*{tool}\b", command) and shutil.which(tool) is None:
            return tool
    return None


@contextlib.contextmanager
def guide_daemons(
    factory: DaemonFactory,
) -> Iterator[tuple[dict[str, DaemonProcess], int]]:
    """The guide's daemons (a 64 MiB pool with metrics; a read-only one), scenario run."""
    port = free_port()
    main = factory("--pool-size", "64MiB", "--metrics-port", str(port))
    readonly = factory("--pool-size", "16MiB", "--no-destructive-admin")
    ch, stub = admin(main)
    with ch:  # warm-up figures must be final before GetStats is compared
        deadline = time.monotonic() + 30
        while not stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10).warmup_complete:
            assert time.monotonic() < deadline, "pool warm-up did not finish"
            time.sleep(0.05)
    scenario = run_guide_scenario(main.target)
    try:
        check_guide_state(main)
        yield {"main": main, "readonly": readonly}, port
    finally:
        scenario.close()


def run_guide(daemons: dict[str, DaemonProcess], port: int) -> list[tuple[GuideCommand, int, str]]:
    env = guide_env()
    results = []
    for cmd in parse_guide(GUIDE.read_text()):
        if needs_tool(cmd.command):
            continue
        rc, out = run_guide_command(cmd, daemons, f"127.0.0.1:{port}", env)
        results.append((cmd, rc, out))
    return results


def test_guide_commands_answer_as_printed(daemon_factory: DaemonFactory) -> None:
    """Every command of the operations guide, in order, against a live daemon: same
    success or failure, same answer as printed (volatile fields aside)."""
    problems = []
    with guide_daemons(daemon_factory) as (daemons, port):
        results = run_guide(daemons, port)
    assert len(results) >= 15, "the guide lost its commands"
    for cmd, rc, out in results:
        failed = cmd.expected.startswith("ERROR:")
        if (rc != 0) != failed:
            problems.append(f"line {cmd.line}: `{cmd.command}` exited {rc}:\n{out}")
            continue
        diff = output_mismatch(cmd.expected, out)
        if diff:
            problems.append(f"line {cmd.line}: `{cmd.command}`\n{diff}")
    assert not problems, (
        "docs/operations.md is out of date (python tests/test_operations.py "
        "--write-docs regenerates the outputs; review the diff):\n\n" + "\n\n".join(problems)
    )


def test_guide_covers_every_operation() -> None:
    """The guide shows every Admin method, paging, filters, both kinds of Evict, the
    refusal of destructive calls, health, reflection and the metrics scrape."""
    commands = parse_guide(GUIDE.read_text())
    grpcurl = [c for c in commands if c.command.startswith("grpcurl ")]
    for c in grpcurl:
        assert f"-unix {GUIDE_SOCKET}" in c.command, f"line {c.line}: use the standard socket"
    text = "\n".join(c.command for c in grpcurl)
    methods = admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods
    for m in methods:
        assert f"kvdepot.v1.Admin/{m.name}" in text, f"the guide never calls Admin/{m.name}"
    for needle in (
        " list",
        " describe ",
        "grpc.health.v1.Health/Check",
        '"page_token"',
        '"has_group"',
        '"group"',
        '"keys"',
        "-emit-defaults",
    ):
        assert needle in text, f"the guide shows no grpcurl command with {needle!r}"
    evicts = [c for c in grpcurl if c.command.endswith("kvdepot.v1.Admin/Evict")]
    assert any('"keys"' not in c.command for c in evicts), "no Evict of a whole namespace"
    denied = [c for c in grpcurl if "Code: PermissionDenied" in c.expected]
    assert {c.command.rsplit("/", 1)[-1] for c in denied} >= {"Evict", "Clear"}
    assert all(c.daemon == "readonly" for c in denied)
    assert any(c.command.startswith("curl ") and "/metrics" in c.command for c in commands)
    assert "scrape_configs" in GUIDE.read_text()


# --- metrics ---------------------------------------------------------------------------------

GEO_M = Geometry(
    groups=[[4096, 4096]],
    blocks_per_chunk=2,
    world_size=1,
    num_blocks=128,
    namespace="metrics-test",
)
SLOT_M = GEO_M.blocks_per_chunk * sum(GEO_M.layer_pages)  # 16 KiB: 16 slots in 256 KiB


def keys_m(chunks: Iterable[int]) -> list[bytes]:
    """Group-0 keys of GEO_M's chunks."""
    return [make_key(c, 0) for c in chunks]


def test_metrics_show_exactly_what_happened(daemon_factory: DaemonFactory) -> None:
    """A known sequence of stores, loads, lookups, LRU/admin/clear evictions, dropped
    stores, inline Put/Get and a failed load; then one scrape over HTTP must show exactly
    those counts and bytes, histogram buckets, counts and sums included."""
    port = free_port()
    d = daemon_factory("--pool-size", "256KiB", "--metrics-port", str(port))
    before = scrape(port)
    # Every series exists (at 0) before anything happens, so rate() and alerts work.
    for direction in ("store", "load"):
        assert sample(before, "kvdepot_transfer_size_bytes_count", direction=direction) == 0
        assert sample(before, "kvdepot_failed_transfers_total", direction=direction) == 0
    for reason in ("lru", "admin", "clear"):
        assert sample(before, "kvdepot_evictions_total", reason=reason) == 0
    assert sample(before, "kvdepot_dropped_stores_total", reason="pool_full") == 0

    client = connect(d.target, "metrics-test")
    ns = GEO_M.namespace
    stores: list[int] = []  # bytes of each successful store transfer, in order
    loads: list[int] = []
    stored_blocks = loaded_blocks = 0  # keys written / read by them
    copy_seconds = 0.0  # the jobs' own copy times (Put/Get report none)
    inline_wall = 0.0  # wall time of the Put/Get calls: bounds their copy times
    try:
        eng = Engine(client, GEO_M, 0)
        res = store(eng, range(0, 10))  # 10 of the 16 slots
        stores.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 10 * SLOT_M and res.stored_keys == 10
        stored_blocks += res.stored_keys

        res = load(eng, range(0, 4), base_block=64)  # 0-3 become the youngest
        loads.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 4 * SLOT_M
        loaded_blocks += 4

        keys, gb, idx = chunk_plan(GEO_M, range(50, 51), base_block=100)
        res = eng.job(pb.LOAD, keys, gb, idx)  # never stored: fails, counted as failed
        assert not res.success and res.error_code == "NOT_FOUND"

        res = store(eng, range(10, 18))  # 6 free slots: LRU evicts chunks 4 and 5
        stores.append(res.bytes)
        copy_seconds += res.copy_seconds
        assert res.bytes == 8 * SLOT_M and res.stored_keys == 8
        stored_blocks += res.stored_keys

        hits = client.lookup(ns, keys_m(range(18)))
        assert hits == [c not in (4, 5) for c in range(18)]

        # Inline Put of one section (pool full: LRU evicts chunk 6), then Get it back.
        data = os.urandom(GEO_M.blocks_per_chunk * sum(GEO_M.layer_pages))
        t0 = time.perf_counter()
        put = client.put(ns, make_key(40, 0), 0, data)
        got = client.get(ns, make_key(40, 0), 0)
        inline_wall = time.perf_counter() - t0
        assert put.outcome == "stored" and put.ready and got == data
        stores.append(len(data))
        loads.append(len(data))
        stored_blocks += 1
        loaded_blocks += 1

        ch, stub = admin(d)
        with ch:
            ev = stub.Evict(admin_pb2.EvictRequest(namespace_id=ns, keys=keys_m([7, 8])))
            assert (ev.evicted_blocks, ev.skipped_blocks, ev.not_found_blocks) == (2, 0, 0)
            ready = [*range(0, 4), *range(9, 18), 40]  # 14 blocks
            assert client.pin(ns, keys_m(ready)) == [True] * 14
            res = store(eng, range(20, 24))  # 2 free slots, the rest pinned: 2 dropped
            assert (res.stored_keys, res.dropped_keys) == (2, 2)
            assert res.bytes == 2 * SLOT_M  # only what was copied
            stores.append(res.bytes)
            stored_blocks += res.stored_keys
            copy_seconds += res.copy_seconds
            client.unpin(ns, keys_m(range(0, 4)), wait=True)
            cleared = stub.Clear(admin_pb2.ClearRequest())  # 20, 21 and 0-3
            assert (cleared.evicted_blocks, cleared.skipped_blocks) == (6, 10)
            stats = stub.GetStats(admin_pb2.GetStatsRequest())
        m = scrape(port)
    finally:
        client.close()

    # Transfers: histogram counts, sums and every bucket, per direction.
    for direction, sizes in (("store", stores), ("load", loads)):
        assert sample(m, "kvdepot_transfer_size_bytes_count", direction=direction) == len(sizes)
        assert sample(m, "kvdepot_transfer_size_bytes_sum", direction=direction) == sum(sizes)
        for (name, labels), value in m.items():
            if (
                name == "kvdepot_transfer_size_bytes_bucket"
                and dict(labels)["direction"] == direction
            ):
                le = float(dict(labels)["le"])
                assert value == sum(s <= le for s in sizes), (direction, le)
        assert sample(m, "kvdepot_transfer_copy_seconds_count", direction=direction) == len(sizes)
    seconds = sum(
        sample(m, "kvdepot_transfer_copy_seconds_sum", direction=d) for d in ("store", "load")
    )
    assert copy_seconds <= seconds + 1e-9 <= copy_seconds + inline_wall + 1e-6
    assert sample(m, "kvdepot_failed_transfers_total", direction="load") == 1
    assert sample(m, "kvdepot_failed_transfers_total", direction="store") == 0
    # The index.
    assert sample(m, "kvdepot_evictions_total", reason="lru") == 3  # chunks 4, 5, 6
    assert sample(m, "kvdepot_evictions_total", reason="admin") == 2
    assert sample(m, "kvdepot_evictions_total", reason="clear") == 6
    assert sample(m, "kvdepot_dropped_stores_total", reason="pool_full") == 2
    assert sample(m, "kvdepot_lookups_total") == 18
    assert sample(m, "kvdepot_lookup_hits_total") == 16
    assert sample(m, "kvdepot_lookup_misses_total") == 2
    assert sample(m, "kvdepot_pin_keys_total") == sample(m, "kvdepot_pinned_keys_total") == 14
    assert stored_blocks == 10 + 8 + 1 + 2 and loaded_blocks == 4 + 1
    assert sample(m, "kvdepot_transfer_blocks_total", direction="store") == stored_blocks
    assert sample(m, "kvdepot_transfer_blocks_total", direction="load") == loaded_blocks
    assert sample(m, "kvdepot_blocks", state="ready") == 10
    assert sample(m, "kvdepot_blocks", state="writing") == 0
    assert sample(m, "kvdepot_pinned_blocks") == 10
    # The pool.
    assert sample(m, "kvdepot_pool_capacity_bytes") == 256 << 10
    assert sample(m, "kvdepot_pool_used_bytes") == 10 * SLOT_M
    assert sample(m, "kvdepot_pool_pinned_bytes") == 10 * SLOT_M
    assert sample(m, "kvdepot_pool_largest_free_extent_bytes") <= 6 * SLOT_M
    # Sessions and jobs (the client was still connected at the scrape).
    assert sample(m, "kvdepot_engines") == 1
    assert sample(m, "kvdepot_registrations") == 1
    assert sample(m, "kvdepot_namespaces") == 1
    assert sample(m, "kvdepot_inflight_jobs") == 0
    # Admin/GetStats tells the same story.
    assert (stats.stores, stats.stored_bytes) == (len(stores), sum(stores))
    assert (stats.loads, stats.loaded_bytes) == (len(loads), sum(loads))
    assert (stats.store_jobs, stats.stored_blocks) == (len(stores), stored_blocks)
    assert (stats.load_jobs, stats.loaded_blocks) == (len(loads), loaded_blocks)
    assert (stats.failed_store_jobs, stats.failed_load_jobs) == (0, 1)
    assert (stats.pin_calls, stats.pin_keys, stats.pinned_keys) == (1, 14, 14)
    assert dict(stats.evictions_by_reason) == {"lru": 3, "admin": 2, "clear": 6}
    assert stats.evictions == 11 and stats.dropped_stores == 2


def test_guide_lists_every_metric(daemon_factory: DaemonFactory) -> None:
    """Every kvdepot_ metric family a live daemon exports is in the guide's table."""
    port = free_port()
    daemon_factory("--pool-size", "16MiB", "--metrics-port", str(port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        families = {f.name for f in text_string_to_metric_families(resp.read().decode())}
    guide = GUIDE.read_text()
    missing = sorted(f for f in families if f.startswith("kvdepot_") and f"`{f}" not in guide)
    assert not missing, f"docs/operations.md does not list {missing}"
    assert any(f.startswith("process_") for f in families)  # memory, CPU, fds of the daemon


# --- systemd notify ---------------------------------------------------------------------------


@dataclass
class Datagram:
    text: str
    at: float  # monotonic receipt time
    socket_existed: bool  # the gRPC socket file existed when it arrived

    @property
    def fields(self) -> list[str]:
        return self.text.split("\n")


def test_systemd_notify_sequence() -> None:
    """NOTIFY_SOCKET is a datagram socket this test binds; WATCHDOG_USEC=200000 with no
    WATCHDOG_PID. READY=1 comes only once the gRPC socket accepts (connected to the
    moment READY=1 arrives, without retrying), nothing claims "serving" before it,
    WATCHDOG=1 keeps coming every ~0.1 s, STATUS= tells the pool warm-up, and SIGTERM
    brings STOPPING=1, after which no keep-alive follows and the daemon exits 0."""
    workdir = Path(tempfile.mkdtemp(prefix="kvd-ops-"))  # short: AF_UNIX paths <= 108 bytes
    notify_path = str(workdir / "notify")
    sock_path = str(workdir / "kvdepot.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    log_path = workdir / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*kvdepot_command(), "serve", "--socket", sock_path, "--pool-size", "64MiB"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    got: list[Datagram] = []

    def receive(timeout: float) -> Datagram:
        listener.settimeout(timeout)
        data = listener.recv(4096)
        dg = Datagram(data.decode(), time.monotonic(), os.path.exists(sock_path))
        got.append(dg)
        return dg

    def until(pred: Callable[[Datagram], bool], timeout: float, what: str) -> Datagram:
        """The next datagram that satisfies `pred` (earlier ones are kept in `got`)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, (
                f"no {what} within {timeout}s; got {[g.text for g in got]}\n"
                f"{log_path.read_text(errors='replace')}"
            )
            try:
                dg = receive(min(left, 0.5))
            except TimeoutError:
                # Only once the queue is empty: a daemon that exited may have left some.
                assert proc.poll() is None, f"daemon exited {proc.returncode} before {what}"
                continue
            if pred(dg):
                return dg

    try:
        ready = until(lambda dg: "READY=1" in dg.fields, 30, "READY=1")
        # Now, with no retry: the socket exists, accepts, and gRPC health answers.
        assert ready.socket_existed
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(sock_path)
        with grpc.insecure_channel(f"unix://{sock_path}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert status.status == HEALTH.SERVING
        before = got[:-1]
        assert not any("WATCHDOG=1" in g.fields for g in before), "keep-alive before READY=1"
        assert not any(f.startswith("STATUS=serving") for g in before for f in g.fields)

        # Keep-alives keep coming; the warm-up status reaches 100% while serving.
        keepalives: list[float] = []
        deadline = time.monotonic() + 20
        while len(keepalives) < 8 or not any(
            "STATUS=serving; pool warm-up 100%" in g.fields for g in got
        ):
            assert time.monotonic() < deadline, [g.text for g in got]
            dg = until(lambda dg: True, 5, "datagram")
            if "WATCHDOG=1" in dg.fields:
                keepalives.append(dg.at)
        gaps = [b - a for a, b in itertools.pairwise(keepalives)]
        assert 0.03 < sum(gaps) / len(gaps) < 0.3, gaps  # every 0.1 s, give or take
        assert all(
            f.startswith("STATUS=") and "pool warm-up" in f
            for g in got
            for f in g.fields
            if f.startswith("STATUS=")
        )

        proc.send_signal(signal.SIGTERM)
        stopping = until(lambda dg: "STOPPING=1" in dg.fields, 20, "STOPPING=1")
        assert proc.wait(timeout=20) == 0, log_path.read_text(errors="replace")
        listener.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            while True:
                got.append(Datagram(listener.recv(4096).decode(), time.monotonic(), False))
        after = got[got.index(stopping) + 1 :]
        assert not any("WATCHDOG=1" in g.fields for g in after), [g.text for g in after]
        assert not os.path.exists(sock_path), "the socket outlived the daemon"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)


# --- health during shutdown -------------------------------------------------------------------


def test_health_reports_not_serving_during_shutdown(daemon_factory: DaemonFactory) -> None:
    """A Health/Watch stream open across SIGTERM gets NOT_SERVING and then ends; a Check
    made after that answers NOT_SERVING or fails (the listener is closing), never
    SERVING; the open watch does not hold the daemon for the shutdown grace period."""
    d = daemon_factory("--pool-size", "16MiB")
    engine = connect(d.target, "shutdown-test")  # a Session stream open across shutdown too
    checks: list[str] = []
    with d.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="kvdepot.v1.Depot"))
        assert next(watch).status == HEALTH.SERVING
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        statuses = []
        with contextlib.suppress(grpc.RpcError):  # the stream may end with an error status
            for resp in watch:
                statuses.append(resp.status)
                if resp.status == HEALTH.NOT_SERVING:
                    # From here on no Check may say SERVING (new channel or old).
                    with d.channel() as fresh:
                        for channel in (ch, fresh):
                            try:
                                r = health_pb2_grpc.HealthStub(channel).Check(
                                    health_pb2.HealthCheckRequest(), timeout=2
                                )
                                checks.append(HEALTH.ServingStatus.Name(r.status))
                            except grpc.RpcError as exc:
                                checks.append(exc.code().name)
        assert statuses == [HEALTH.NOT_SERVING], statuses
        assert d.proc.wait(timeout=20) == 0, d.log()
        took = time.monotonic() - t0
    engine.close()
    assert checks and "SERVING" not in checks, checks
    # The daemon waits up to 5 s (SHUTDOWN_GRACE_SECONDS) for open calls: a health watch
    # must not be one of them.
    assert took < 4.5, f"shutdown took {took:.1f}s with a health watch open"


# --- admin: refusals, paging, validation --------------------------------------------------------


def test_no_destructive_admin_refuses_evict_and_clear(daemon_factory: DaemonFactory) -> None:
    """With --no-destructive-admin, Evict (by namespace and by keys) and Clear answer
    PERMISSION_DENIED with a message naming the setting, and delete nothing; the
    read-only calls still answer."""
    d = daemon_factory("--pool-size", "16MiB", "--no-destructive-admin")
    client = connect(d.target, "readonly-test")
    try:
        store(Engine(client, GEO_M, 0), range(0, 3))
        ch, stub = admin(d)
        with ch:
            for call, req in (
                (stub.Evict, admin_pb2.EvictRequest(namespace_id=GEO_M.namespace)),
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(namespace_id=GEO_M.namespace, keys=keys_m([0])),
                ),
                (stub.Clear, admin_pb2.ClearRequest()),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "--no-destructive-admin" in err.value.details()
                assert "KVDEPOT_NO_DESTRUCTIVE_ADMIN" in err.value.details()
            blocks = stub.ListBlocks(admin_pb2.ListBlocksRequest(), timeout=10)
            assert blocks.total_blocks == 3
            stats = stub.GetStats(admin_pb2.GetStatsRequest(), timeout=10)
            assert stats.ready_blocks == 3 and stats.evictions == 0
    finally:
        client.close()


def test_list_blocks_paging_filters_and_evict_validation(daemon_factory: DaemonFactory) -> None:
    """Pages cover every block once even when blocks go away between pages; the group
    filter works with has_group (group 0) and without (non-zero); bad input gets
    INVALID_ARGUMENT or NOT_FOUND with a message, and the daemon goes on."""
    d = daemon_factory("--pool-size", "16MiB")
    client = connect(d.target, "paging-test")
    geo = Geometry(namespace="paging-test", world_size=1)  # 2 groups
    try:
        store(Engine(client, geo, 0), range(0, 10))  # 20 blocks
        ch, stub = admin(d)
        with ch:
            every = stub.ListBlocks(admin_pb2.ListBlocksRequest(page_size=100))
            assert every.total_blocks == 20 and not every.next_page_token
            assert [b.key for b in every.blocks] == sorted(b.key for b in every.blocks)
            assert all(bytes.fromhex(b.key_hex) == b.key for b in every.blocks)

            seen: list[bytes] = []
            token = ""
            evicted_mid_way: list[bytes] = []
            while True:
                page = stub.ListBlocks(admin_pb2.ListBlocksRequest(page_size=3, page_token=token))
                seen += [b.key for b in page.blocks]
                if len(seen) == 6:  # evict two blocks not yet listed and the first one
                    evicted_mid_way = [
                        every.blocks[0].key,
                        every.blocks[10].key,
                        every.blocks[11].key,
                    ]
                    ev = stub.Evict(
                        admin_pb2.EvictRequest(namespace_id="paging-test", keys=evicted_mid_way)
                    )
                    assert ev.evicted_blocks == 3
                token = page.next_page_token
                if not token:
                    break
            want = [b.key for b in every.blocks if b.key not in evicted_mid_way[1:]]
            assert seen == want  # no block twice, none skipped, in order

            for req, group in (
                (admin_pb2.ListBlocksRequest(has_group=True, group=0), 0),
                (admin_pb2.ListBlocksRequest(group=1), 1),
            ):
                blocks = stub.ListBlocks(req).blocks
                assert blocks and all(b.group == group for b in blocks)

            # Duplicated keys count once; unknown ones are reported.
            key = next(b.key for b in stub.ListBlocks(admin_pb2.ListBlocksRequest()).blocks)
            ev = stub.Evict(
                admin_pb2.EvictRequest(namespace_id="paging-test", keys=[key, key, make_key(99, 0)])
            )
            assert (ev.evicted_blocks, ev.skipped_blocks, ev.not_found_blocks) == (1, 0, 1)

            bad = [
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(page_token="garbage"),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "page_token",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(page_size=10001),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "page_size",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(namespace_id="paging-test", group=7),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "group 7",
                ),
                (
                    stub.ListBlocks,
                    admin_pb2.ListBlocksRequest(namespace_id="nope"),
                    grpc.StatusCode.NOT_FOUND,
                    "ListNamespaces",
                ),
                (stub.Evict, admin_pb2.EvictRequest(), grpc.StatusCode.INVALID_ARGUMENT, "Clear"),
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(namespace_id="nope"),
                    grpc.StatusCode.NOT_FOUND,
                    "ListNamespaces",
                ),
                # A hex key pasted where base64 belongs decodes to the wrong length.
                (
                    stub.Evict,
                    admin_pb2.EvictRequest(
                        namespace_id="paging-test", keys=[base64.b64decode(key.hex())]
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "base64",
                ),
            ]
            for call, req, code, hint in bad:
                with pytest.raises(grpc.RpcError) as err:
                    call(req, timeout=10)
                assert err.value.code() == code, (req, err.value.details())
                assert hint in err.value.details(), err.value.details()
            assert stub.GetStats(admin_pb2.GetStatsRequest()).ready_blocks == 20 - 3 - 1
    finally:
        client.close()


def test_list_engines_reports_registrations_and_pins(daemon_factory: DaemonFactory) -> None:
    """ListEngines: process, ranks, registered bytes, memory path, pinned blocks."""
    d = daemon_factory("--pool-size", "16MiB")
    client = connect(d.target, "engines-test")
    try:
        r0, r1 = Engine(client, GEO_A, 0), Engine(client, GEO_A, 1)
        store(r0, range(0, 2))
        store(r1, range(0, 2))
        client.pin(GEO_A.namespace, [make_key(0, 0), make_key(1, 1)])
        client.pin(GEO_A.namespace, [make_key(0, 0)])  # twice: still one block
        ch, stub = admin(d)
        with ch:
            (e,) = stub.ListEngines(admin_pb2.ListEnginesRequest()).engines
        assert (e.client_name, e.engine_id, e.pid) == ("engines-test", "engines-test", os.getpid())
        assert e.pinned_blocks == 2
        assert [(r.rank, r.memory_path, r.namespace_id) for r in e.registrations] == [
            (0, "shm", GEO_A.namespace),
            (1, "shm", GEO_A.namespace),
        ]
        assert all(r.registered_bytes == r0.buffer.size for r in e.registrations)
    finally:
        client.close()


# --- regenerating the guide's outputs ---------------------------------------------------------


def write_guide_outputs() -> int:
    """Reruns the scenario and rewrites each command's output in docs/operations.md."""
    made: list[DaemonProcess] = []

    def factory(*args: str) -> DaemonProcess:
        d = DaemonProcess(Path(tempfile.mkdtemp(prefix="kvd-doc-")), *args)
        made.append(d)
        return d.start()

    try:
        with guide_daemons(factory) as (daemons, port):
            results = run_guide(daemons, port)
    finally:
        for d in made:
            d.stop()
            shutil.rmtree(d.workdir, ignore_errors=True)
    lines = GUIDE.read_text().splitlines()
    for cmd, _rc, out in sorted(results, key=lambda r: -r[0].out_start):
        live = out.replace(str(made[0].socket_path), GUIDE_SOCKET)
        lines[cmd.out_start : cmd.out_end] = live.splitlines()
    GUIDE.write_text("\n".join(lines) + "\n")
    print(f"rewrote the outputs of {len(results)} commands in {GUIDE}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-docs"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --write-docs")
    raise SystemExit(write_guide_outputs())
