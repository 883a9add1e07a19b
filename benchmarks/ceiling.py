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

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvdepot.bench.daemon import OwnDaemon, process_cpu_seconds
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
PREFILL_TRIES = 3  # stores of a load set, when its ranks drift apart on a busy host


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


def null_copy_daemon(pool_size: str) -> OwnDaemon:
    """A `kvdepot serve` with copies off (this module's `serve`) for the bench's ranks.

    A row is charged to the rank that reserves it until every rank wrote it, and the
    bench's ranks are not held in step as a model's are: a rank can run dozens of jobs
    ahead (more with results batched per loop turn) and pass the per-session writing
    quota (half the pool), which dropped keys in about half the TP=8 ceiling runs. So
    one session may hold the whole pool in rows; what still finds it full is counted."""
    return OwnDaemon(
        pool_size,
        extra=["--max-writing-per-session", "100%"],
        command=[sys.executable, "-m", "kvdepot.bench.ceiling"],
    )


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
    daemon = null_copy_daemon(pool_size)
    fleet: Fleet | None = None
    rows: list[dict[str, Any]] = []
    skipped: list[int] = []
    try:
        daemon.wait_warm()
        fleet = Fleet(ENGINES, geo.tp)
        fleet.setup(daemon.target, vars(geo), num_blocks, salt, namespace, arena_bytes=1 << 20)
        daemon.wait_mapped()
        keys = KeyCursor()
        for chunks in sizes:
            job_bytes = geo.job_bytes(chunks)
            # Slots in flight (2 x 4 jobs) and a load set must fit the pool twice over.
            sets = min(16, pool_bytes // 4 // (ENGINES * job_bytes))
            if sets < DEPTH:
                skipped.append(chunks)
                continue
            for direction in ("store", "load"):
                # Stores with no room left (ranks far out of step) are counted in
                # `dropped_keys`, not fatal, as in the node series.
                run = timed_run(fleet, [daemon], keys, direction, chunks, jobs, warmup, sets, True)
                rate, window = run.rate()
                in_daemon = [j[4] for r in run.replies for j in r["jobs"]]
                rows.append(
                    {
                        "chunks": chunks,
                        "engines": ENGINES,
                        "depth": DEPTH,
                        "direction": direction,
                        "job_bytes": job_bytes,
                        "jobs": sum(len(r["jobs"]) for r in run.replies),
                        "jobs_per_s": rate / job_bytes,
                        "equivalent_gbps": rate / GB,
                        "in_daemon_ms_mean": 1e3 * sum(in_daemon) / max(1, len(in_daemon)),
                        "window_s": window,
                        # CPU time per job (warm-up included), to tell who limits the rate
                        # on a machine with few cores: the daemon or the engine processes.
                        "daemon_cpu_ms_per_job": 1e3 * run.daemon_cpu_s / run.submitted,
                        "engine_cpu_ms_per_job": 1e3 * run.engine_cpu_s / run.submitted,
                        "dropped_keys": run.dropped,
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


class KeyCursor:
    """Where the next series' key numbers and block patterns start: every store names
    fresh keys, every load set is stored first (the key numbers sit apart from the
    data-path series' keys)."""

    def __init__(self) -> None:
        self.seq = 1 << 40
        self.pattern = 1 << 20


@dataclass(frozen=True)
class TimedRun:
    """One synchronized series of jobs on every worker, copies off, and the CPU it cost."""

    replies: list[dict[str, Any]]  # each worker's `run` reply (timed jobs only)
    daemon_cpu_s: float  # every daemon process, warm-up jobs included
    engine_cpu_s: float  # every worker process, warm-up jobs included
    loop_cpu_s: float  # the daemons' event-loop threads alone (GetStats loop_cpu_seconds)
    submitted: int  # jobs the CPU time paid for: (jobs + warm-up) x workers
    dropped: int  # store keys dropped, a load's set included (only where allowed)
    copies: int  # copies the daemons' copy threads started (GetStats copies_started)
    copy_wait_s: float  # their seconds from queued to started (GetStats copy_wait_seconds)
    # Bytes the daemons copied (planned, with copies off) into or out of the pool,
    # warm-up included (GetStats stored_bytes + loaded_bytes): a store of a row another
    # rank copies (MLA's replicated ranks) adds none.
    copied_bytes: int = 0

    def rate(self) -> tuple[float, float]:
        """Bytes/s while every worker ran, and that window (stats.overlap_rate)."""
        return overlap_rate([[(j[0], j[1], int(j[2])) for j in r["jobs"]] for r in self.replies])

    def job_rate(self) -> tuple[float, float]:
        """Jobs/s while every worker ran (each job counts, whatever it copied), and that
        window: the window of `rate`."""
        return overlap_rate([[(j[0], j[1], 1) for j in r["jobs"]] for r in self.replies])

    def overhead_ms(self) -> list[float]:
        """Round trip - copy of every timed job (the copy is nil here: copies are off)."""
        return [1e3 * (j[1] - j[0] - j[3]) for r in self.replies for j in r["jobs"]]


def timed_run(
    fleet: Fleet,
    daemons: Sequence[OwnDaemon],
    keys: KeyCursor,
    direction: str,
    chunks: int,
    jobs: int,
    warmup: int,
    sets: int,
    allow_dropped: bool = False,
) -> TimedRun:
    """`jobs` (+ `warmup`) jobs of `chunks` chunks on every worker of `fleet`, DEPTH in
    flight each, all starting together; a load first stores the `sets` jobs it cycles
    over (untimed). CPU time is read from /proc of the daemons and the workers, and the
    daemons' event loops' from GetStats.
    A dropped key fails the run unless `allow_dropped` (then it is counted, and a
    load set whose store dropped keys is stored again, up to PREFILL_TRIES times:
    a load of a key still missing fails the run)."""
    dropped = 0
    if direction == "load":  # the keys the loads cycle over
        key_seq, key_sets = keys.seq, sets
        for _ in range(PREFILL_TRIES):
            # The same keys again: rows already whole are skipped, a rank whose section
            # found no room (its mates ran ahead) writes it now.
            stored = run_fleet(
                fleet, "store", chunks, sets, 0, key_seq, 0, keys.pattern, allow_dropped
            )
            missing = sum(r["dropped"] for r in stored)
            dropped += missing
            if not missing:
                break
            time.sleep(0.2)  # the slow ranks catch up and the rows they held settle
        keys.seq += sets * chunks
    else:
        key_seq, key_sets = keys.seq, 0
        keys.seq += (jobs + warmup) * chunks
    daemon_pids = [d.proc.pid for d in daemons]
    engine_pids = [w.proc.pid for w in fleet.workers]
    d0, e0, c0 = cpu_total(daemon_pids), cpu_total(engine_pids), daemon_counters(daemons)
    replies = run_fleet(
        fleet, direction, chunks, jobs, warmup, key_seq, key_sets, keys.pattern, allow_dropped
    )
    d1, e1, c1 = cpu_total(daemon_pids), cpu_total(engine_pids), daemon_counters(daemons)
    keys.pattern += jobs + warmup
    dropped += sum(r["dropped"] for r in replies)
    submitted = (jobs + warmup) * len(fleet.workers)
    loop, copies, wait, copied = (after - before for after, before in zip(c1, c0, strict=True))
    return TimedRun(
        replies, d1 - d0, e1 - e0, loop, submitted, dropped, int(copies), wait, int(copied)
    )


def cpu_total(pids: Sequence[int]) -> float:
    return sum(process_cpu_seconds(pid) for pid in pids)


def daemon_counters(daemons: Sequence[OwnDaemon]) -> tuple[float, float, float, float]:
    """The daemons' counters so far, summed: their event loops' CPU seconds (the serial
    part of each), the copies their threads started, those copies' seconds queued, and
    the bytes they copied (both directions)."""
    readings = [d.stats() for d in daemons]
    return (
        sum(s.loop_cpu_seconds for s in readings),
        sum(s.copies_started for s in readings),
        sum(s.copy_wait_seconds for s in readings),
        sum(s.stored_bytes + s.loaded_bytes for s in readings),
    )


def run_fleet(
    fleet: Fleet,
    direction: str,
    chunks: int,
    jobs: int,
    warmup: int,
    key_seq: int,
    key_sets: int,
    pattern: int,
    allow_dropped: bool = False,
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
        if r["failed"] or (r["dropped"] and not allow_dropped):
            raise RuntimeError(
                f"control-plane ceiling: {r['failed']} job(s) failed, {r['dropped']} key(s) "
                f"dropped: {r['error']}"
            )
    return replies


if __name__ == "__main__":
    sys.exit(serve_with_null_engine(sys.argv[1:]))
