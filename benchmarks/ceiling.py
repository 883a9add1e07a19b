"""The control-plane ceiling: jobs per second through the whole job path, copies off.

What a GPU node's daemon does per job besides the DMA itself: the Transfer
stream both ways, validation, the index (reserve, settle), planning, the copy
thread hand-off, and the CUDA engine's DMA planning (`plan_dma`: strided copies or
descriptors, with the pool's page-locking split). Here all of it runs for real on a
real `kvdepot serve`, except that the copy engine of shared-memory registrations is
`NullCopyEngine`: it plans the CUDA engine's DMA and moves no bytes.
`equivalent_gbps` is then the copy speed the control plane could feed: bytes
the jobs name, per second.

The null engine is reachable only through this module's launcher
(`python -m kvdepot.bench.ceiling serve ...`, which the bench starts): no flag
of `kvdepot serve` selects it, so a production daemon always copies.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from kvdepot.bench.daemon import OwnDaemon
from kvdepot.bench.fleet import Fleet
from kvdepot.bench.geometry import BenchGeometry
from kvdepot.bench.stats import GB, overlap_rate
from kvdepot.server.core.planner import CopyPlan
from kvdepot.server.cuda.dma_plan import plan_dma
from kvdepot.server.memory.copy_engine import (
    CopyEngine,
    MappedRegion,
    PreparedCopy,
    check_runs,
    no_copy,
)

HOST_SPLIT = 8 << 20  # the CUDA engine's page-locking chunk of the pool (its default)
ENGINES = 2
DEPTH = 4


class NullCopyEngine(CopyEngine):
    """Plans a CUDA job's DMA and copies nothing (benchmark only).

    Its `prepare` does what the CUDA engine's does on the event loop; the copy
    it returns, run on a copy thread like the CUDA engine's DMA, moves nothing.
    """

    def prepare(
        self,
        direction: int,
        regions: Sequence[MappedRegion],
        pool_address: int,
        plan: CopyPlan,
        pool_size: int | None = None,
    ) -> PreparedCopy:
        check_runs(regions, plan, pool_size)  # as every engine does (its cost counts)
        plan_dma(direction, plan, [r.address for r in regions], pool_address, host_split=HOST_SPLIT)
        return no_copy


def serve_with_null_engine(argv: list[str]) -> int:
    """`kvdepot <argv>` with shared-memory copies switched off (the bench's daemon)."""
    from kvdepot.server import cli
    from kvdepot.server.state import sessions

    if not hasattr(sessions, "CpuCopyEngine"):  # the hook moved: fail, never copy silently
        raise RuntimeError("kvdepot.server.state.sessions no longer builds CpuCopyEngine")
    sessions.CpuCopyEngine = NullCopyEngine  # type: ignore[misc,assignment]
    return cli.main(argv)


def measure_ceiling(
    geo: BenchGeometry,
    sizes: Sequence[int],
    num_blocks: int,
    pool_size: str,
    pool_bytes: int,
    jobs: int,
    warmup: int,
    namespace: str,
    salt: bytes,
) -> dict[str, Any]:
    """Store and load series of each size, 2 engine processes x 4 jobs in flight."""
    daemon = OwnDaemon(pool_size, command=[sys.executable, "-m", "kvdepot.bench.ceiling"])
    fleet: Fleet | None = None
    rows: list[dict[str, Any]] = []
    skipped: list[int] = []
    try:
        daemon.wait_warm()
        fleet = Fleet(ENGINES, geo.tp)
        fleet.setup(daemon.target, vars(geo), num_blocks, salt, namespace, arena_bytes=1 << 20)
        daemon.wait_mapped()
        seq = 1 << 40  # key numbers apart from the data-path series' keys
        pattern = 1 << 20
        for chunks in sizes:
            job_bytes = geo.job_bytes(chunks)
            # Slots in flight (2 x 4 jobs) and a load set must fit the pool twice over.
            sets = min(16, pool_bytes // 4 // (ENGINES * job_bytes))
            if sets < DEPTH:
                skipped.append(chunks)
                continue
            for direction in ("store", "load"):
                if direction == "load":  # the keys the loads cycle over
                    key_seq, key_sets = seq, sets
                    run_fleet(fleet, "store", chunks, sets, 0, key_seq, 0, pattern)
                    seq += sets * chunks
                else:
                    key_seq, key_sets = seq, 0
                    seq += (jobs + warmup) * chunks
                cpu0 = [
                    cpu_seconds(daemon.proc.pid),
                    *(cpu_seconds(w.proc.pid) for w in fleet.workers),
                ]
                replies = run_fleet(
                    fleet, direction, chunks, jobs, warmup, key_seq, key_sets, pattern
                )
                cpu1 = [
                    cpu_seconds(daemon.proc.pid),
                    *(cpu_seconds(w.proc.pid) for w in fleet.workers),
                ]
                n_jobs = (jobs + warmup) * len(fleet.workers)
                pattern += jobs + warmup
                per_worker = [[(j[0], j[1], int(j[2])) for j in r["jobs"]] for r in replies]
                rate, window = overlap_rate(per_worker)
                in_daemon = [j[4] for r in replies for j in r["jobs"]]
                rows.append(
                    {
                        "chunks": chunks,
                        "engines": ENGINES,
                        "depth": DEPTH,
                        "direction": direction,
                        "job_bytes": job_bytes,
                        "jobs": sum(len(r["jobs"]) for r in replies),
                        "jobs_per_s": rate / job_bytes,
                        "equivalent_gbps": rate / GB,
                        "in_daemon_ms_mean": 1e3 * sum(in_daemon) / max(1, len(in_daemon)),
                        "window_s": window,
                        # CPU time per job (warm-up included), to tell who limits the rate
                        # on a machine with few cores: the daemon or the engine processes.
                        "daemon_cpu_ms_per_job": 1e3 * (cpu1[0] - cpu0[0]) / n_jobs,
                        "engine_cpu_ms_per_job": 1e3
                        * sum(b - a for a, b in zip(cpu0[1:], cpu1[1:], strict=True))
                        / n_jobs,
                    }
                )
    finally:
        if fleet is not None:
            fleet.close()
        daemon.stop()
    return {
        "rows": rows,
        "skipped_chunks": skipped,
        "engines": ENGINES,
        "depth": DEPTH,
        "copy_engine": "NullCopyEngine (CUDA descriptors planned, no bytes moved)",
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_fleet(
    fleet: Fleet,
    direction: str,
    chunks: int,
    jobs: int,
    warmup: int,
    key_seq: int,
    key_sets: int,
    pattern: int,
) -> list[dict[str, Any]]:
    replies = fleet.call(
        fleet.workers,
        lambda w: {
            "cmd": "run",
            "mode": "daemon",
            "direction": direction,
            "chunks": chunks,
            "jobs": jobs,
            "warmup": warmup,
            "key_seq": key_seq,
            "key_sets": key_sets,
            "pattern": pattern,
            "depth": DEPTH,
        },
        synchronized=True,
    )
    for r in replies:
        if r["failed"] or r["dropped"]:
            raise RuntimeError(
                f"control-plane ceiling: {r['failed']} job(s) failed, {r['dropped']} key(s) "
                f"dropped: {r['error']}"
            )
    return replies


if __name__ == "__main__":
    sys.exit(serve_with_null_engine(sys.argv[1:]))
