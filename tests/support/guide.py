"""The operations guide (docs/operations.md): the state its outputs show (two synthetic
engines) and the machinery that parses its ```console commands and runs them against
live daemons. tests/test_operations.py holds the guide to it and, with --write-docs,
rewrites the guide's outputs; tests/test_status.py does the same for the status screen.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvdepot.client import DepotClient
from kvdepot.server.status.report import NUMA_FIELDS
from kvdepot.v1 import admin_pb2
from kvdepot.v1 import depot_pb2 as pb
from tests.support.daemon import DaemonProcess, connect
from tests.support.engine import Engine, Geometry, make_key
from tests.support.faults import DaemonFactory
from tests.support.ops import admin, free_port, load, rank_bytes, store

REPO = Path(__file__).resolve().parents[2]
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
    # The NUMA placement is the host's (its nodes, GPUs and CPUs): tests/test_numa.py.
    *NUMA_FIELDS,
    # How long copies waited and took: the machine's timing (test_copy_queues.py).
    "copy_wait_seconds",
    "copy_busy_seconds",
    "gpu_copy_wait_seconds",
    "gpu_copy_busy_seconds",
    "copy_longest_running_seconds",
    "gpu_copy_longest_running_seconds",
    # The event loop's CPU: the machine's too (test_metrics.py).
    "loop_cpu_seconds",
}  # registration ids start at random per boot

# --- the guide's scenario -------------------------------------------------------------------


@dataclass
class DescribedGeometry(Geometry):
    """A Geometry whose namespace carries a description (ListNamespaces shows it)."""

    description: str = ""

    def layout(self) -> pb.NamespaceLayout:
        lay = super().layout()
        lay.description = self.description
        return lay


# Ids of the connector's form ("kvd1-" + 40 hex digits of a digest of the inputs).
GEO_A = DescribedGeometry(
    description="synthetic engine A: 2 groups (2 and 3 layers), bpc=2, world=2",
).digested("operations guide: engine A")
GEO_B = DescribedGeometry(
    groups=[[2048, 2048, 2048, 2048]],
    blocks_per_chunk=4,
    world_size=1,
    num_blocks=64,
    description="synthetic engine B: 1 group (4 layers), bpc=4, world=1",
).digested("operations guide: engine B")


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
