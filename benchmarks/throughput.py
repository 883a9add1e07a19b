"""Data-path figures: GB/s and per-job latency through the daemon, against in-process.

Every figure is a pair measured in the same run, on the same buffers, with the
same block-id patterns: the daemon path (engine process -> gRPC Transfer stream
-> daemon plans and copies on its copy threads -> result) and the in-process
limit (the same planner and copy engine inside the engine process).

Noise on a shared 2-core machine comes in bursts of tens of milliseconds, so the
two modes are measured as close together as possible: with one engine process
the worker pairs them job by job (same job, same block ids, in-process then
daemon, the order flipping every job); with several processes (TP ranks, the
aggregate series) whole runs alternate, the engines of one run all on the same
path. The figure is the median over repetitions, the ratio the median of the
per-repetition ratios.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvdepot.bench.fleet import Fleet, WorkerProc
from kvdepot.bench.geometry import BenchGeometry
from kvdepot.bench.progress import Progress
from kvdepot.bench.stats import GB, busy_rate, median, overlap_rate, percentile, ratio

MODES = ("inproc", "daemon")
DIRECTIONS = ("store", "load")


@dataclass
class ThroughputPlan:
    """What to measure and how hard (see `kvdepot bench --help`)."""

    geo: BenchGeometry
    sizes: list[int] = field(default_factory=lambda: [1, 16, 64])
    engines: list[int] = field(default_factory=lambda: [1, 2, 4])
    agg_chunks: int = 16
    reps: int = 5
    warmup: int = 2
    rep_bytes: int = 256 << 20  # per rank per repetition: ~50-100 ms of copying here
    min_jobs: int = 4
    max_jobs: int = 256
    depth: int = 1
    num_blocks: int = 0  # per rank; 0: four times the largest job
    arena_bytes: int = 256 << 20  # each worker's in-process arena
    load_set_bytes: int = 256 << 20  # distinct bytes a load run cycles over (all engines)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            biggest = max([*self.sizes, self.agg_chunks]) * self.geo.blocks_per_chunk
            self.num_blocks = max(4 * biggest, 64)
        # The in-process arena must hold two of the biggest jobs, so stores wrap.
        biggest_job = self.geo.job_bytes(max([*self.sizes, self.agg_chunks]))
        self.arena_bytes = max(self.arena_bytes, 2 * biggest_job)

    def steps(self) -> int:
        """Progress steps: one per timed run, one per load set, the check, the floor."""
        per_series = len(DIRECTIONS) * self.reps * len(MODES) + 1
        return 2 + per_series * (len(self.sizes) + len(self.engines))

    def jobs_for(self, chunks: int) -> int:
        per_rank = self.geo.job_bytes(chunks) // self.geo.tp
        return max(self.min_jobs, min(self.max_jobs, math.ceil(self.rep_bytes / per_rank)))


class ThroughputBench:
    """Runs the data-path series on a fleet of worker processes."""

    def __init__(
        self,
        plan: ThroughputPlan,
        fleet: Fleet,
        capacity: int,
        progress: Progress,
        copy_times: Callable[[], tuple[int, float]] | None = None,
    ) -> None:
        """`copy_times` reads the daemon's copies started and seconds they waited for a
        copy thread so far (GetStats), for each series' mean wait; None: not reported."""
        self.plan = plan
        self.copy_times = copy_times
        self.fleet = fleet
        self.capacity = capacity
        self.progress = progress
        self.next_seq = 0  # key sequence numbers: every store names fresh keys
        self.next_pattern = 0  # block-id patterns: shared by the two modes of a repetition
        self.notes: list[str] = []

    # -- building blocks -----------------------------------------------------------

    def _seq(self, count: int) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + count
        return seq

    def _run(
        self,
        workers: list[WorkerProc],
        mode: str,
        direction: str,
        chunks: int,
        jobs: int,
        key_seq: int,
        key_sets: int,
        pattern: int,
        warmup: int | None = None,
    ) -> list[dict[str, Any]]:
        warm = self.plan.warmup if warmup is None else warmup
        replies = self.fleet.call(
            workers,
            lambda w: {
                "cmd": "run",
                "mode": mode,
                "direction": direction,
                "chunks": chunks,
                "jobs": jobs,
                "warmup": warm,
                "key_seq": key_seq,
                "key_sets": key_sets,
                "pattern": pattern,
                "depth": self.plan.depth,
            },
            synchronized=len(workers) > 1,
        )
        for w, r in zip(workers, replies, strict=True):
            if r["failed"]:
                raise RuntimeError(
                    f"{r['failed']} {direction} job(s) of engine {w.engine} rank {w.rank} "
                    f"failed through the daemon: {r['error']}"
                )
        return replies

    def verify(self) -> dict[str, Any]:
        """Stores random pages and loads them elsewhere: the timed path really copies."""
        self.progress.label("content check")
        workers = self.fleet.engine_workers(1)
        chunks = min(self.plan.sizes)
        seq = self._seq(chunks)
        self.fleet.call(
            workers, lambda w: {"cmd": "verify_store", "key_seq": seq, "chunks": chunks}
        )
        replies = self.fleet.call(
            workers, lambda w: {"cmd": "verify_load", "key_seq": seq, "chunks": chunks}
        )
        pages = sum(r["pages"] for r in replies)
        bad = sum(r["mismatched_pages"] for r in replies)
        if bad:
            raise RuntimeError(
                f"{bad} of {pages} pages came back from the daemon with other bytes than "
                f"were stored: the data path is broken, its figures would mean nothing"
            )
        self.progress.step("content check passed")
        return {"pages": pages, "mismatched_pages": bad}

    def floor(self, jobs: int) -> dict[str, Any]:
        """Round trip of a job with no pages: gRPC both ways, the client's threads and
        the daemon's job handling, no planning, no index, no copy thread."""
        self.progress.label("empty jobs")
        (reply,) = self.fleet.call(
            self.fleet.workers[:1],
            lambda w: {"cmd": "empty", "jobs": jobs, "warmup": max(self.plan.warmup, 5)},
        )
        row = latency_row(0, "empty", [(j[1] - j[0], j[3], j[4]) for j in reply["jobs"]])
        self.progress.step("empty jobs measured")
        return row

    def _load_sets(self, workers: list[WorkerProc], engines: int, chunks: int) -> tuple[int, int]:
        """Stores the keys a load series cycles over; returns (first key seq, sets).

        The sets of all engines together take at most half the pool (and
        `load_set_bytes`), so nothing the series loads gets evicted, and as many
        of them as the in-process arena can mirror.
        """
        plan = self.plan
        job_bytes = plan.geo.job_bytes(chunks)
        budget = min(plan.load_set_bytes, self.capacity // 2) // engines
        frames = max(1, plan.arena_bytes // job_bytes)
        sets = max(1, min(budget // job_bytes, frames, plan.jobs_for(chunks)))
        seq = self._seq(sets * chunks)
        self.progress.label(f"storing the load set ({sets} x {chunks} chunks)")
        replies = self._run(
            workers, "daemon", "store", chunks, sets, seq, 0, self._patterns(sets), warmup=0
        )
        dropped = sum(r["dropped"] for r in replies)
        if dropped:
            raise RuntimeError(
                f"the daemon dropped {dropped} key(s) of the load set: its pool "
                f"({self.capacity} bytes) is too small or full of pinned blocks; give it a "
                f"bigger --pool-size or use smaller --sizes"
            )
        return seq, sets

    @contextlib.contextmanager
    def _queue_wait(self, into: list[Any] | None) -> Iterator[None]:
        """Adds the daemon's copies started and their seconds queued during the block
        to `into` ([copies, seconds]); nothing when `into` or `copy_times` is None."""
        before = self.copy_times() if into is not None and self.copy_times else None
        yield
        if before is not None and into is not None and self.copy_times:
            copies, seconds = self.copy_times()
            into[0] += copies - before[0]
            into[1] += seconds - before[1]

    def _patterns(self, jobs: int) -> int:
        first, self.next_pattern = self.next_pattern, self.next_pattern + jobs + self.plan.warmup
        return first

    def _series(
        self, workers: list[WorkerProc], engines: int, chunks: int, label: str
    ) -> tuple[dict[str, Any], dict[str, list[tuple[float, float, float]]]]:
        """Store then load, `reps` times each, both modes; returns figures and samples."""
        plan = self.plan
        jobs = plan.jobs_for(chunks)
        out: dict[str, Any] = {}
        samples: dict[str, list[tuple[float, float, float]]] = {}
        for direction in DIRECTIONS:
            key_seq, key_sets = 0, 0
            if direction == "load":
                key_seq, key_sets = self._load_sets(workers, engines, chunks)
                self.progress.step(f"{label}: load set stored")
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            copy_rates: list[float] = []
            ratios: list[float] = []
            lat: list[tuple[float, float, float]] = []
            dropped = 0
            waited = [0, 0.0]  # the daemon's copies and their seconds queued, over its runs
            # One engine process at a time: pair the modes job by job (the worker
            # alternates them). Several processes: whole runs alternate, so the
            # engines of one run all use the same path at the same time.
            paired = len(workers) == 1 and plan.depth == 1
            for rep in range(plan.reps):
                pattern = self._patterns(jobs)
                rep_rate: dict[str, float] = {}
                runs: dict[str, list[list[list[float]]]] = {}
                seq = key_seq
                if paired:
                    self.progress.label(f"{label}: {direction} {rep + 1}/{plan.reps}")
                    if direction == "store":
                        seq = self._seq((jobs + plan.warmup) * chunks)
                    with self._queue_wait(waited):
                        (reply,) = self._run(
                            workers, "paired", direction, chunks, jobs, seq, key_sets, pattern
                        )
                    runs = {"daemon": [reply["jobs"]], "inproc": [reply["inproc_jobs"]]}
                    dropped += reply["dropped"]
                    for mode in MODES:
                        rep_rate[mode] = busy_rate(_jobs(runs[mode][0]))
                    self.progress.step(f"{label}: {direction} {rep + 1}/{plan.reps}", 2)
                else:
                    for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):
                        self.progress.label(f"{label}: {direction} {mode} {rep + 1}/{plan.reps}")
                        if direction == "store":
                            seq = self._seq((jobs + plan.warmup) * chunks)
                        with self._queue_wait(waited if mode == "daemon" else None):
                            replies = self._run(
                                workers, mode, direction, chunks, jobs, seq, key_sets, pattern
                            )
                        runs[mode] = [r["jobs"] for r in replies]
                        if mode == "daemon":
                            dropped += sum(r["dropped"] for r in replies)
                        rep_rate[mode], _ = overlap_rate([_jobs(j) for j in runs[mode]])
                        self.progress.step(f"{label}: {direction} {mode} {rep + 1}/{plan.reps}")
                for mode in MODES:
                    rates[mode].append(rep_rate[mode] / GB)
                lat += [(j[1] - j[0], j[3], j[4]) for w in runs["daemon"] for j in w]
                copied = sum(j[2] for w in runs["inproc"] for j in w)
                copy_s = sum(j[3] for w in runs["inproc"] for j in w) / len(runs["inproc"])
                copy_rates.append(ratio(copied, copy_s) / GB)
                ratios.append(ratio(rep_rate["daemon"], rep_rate["inproc"]))
            if dropped:
                self.notes.append(
                    f"{label} {direction}: the daemon dropped {dropped} key(s) (pool full); "
                    f"GB/s counts only bytes copied"
                )
            out[direction] = {
                "daemon_gbps": median(rates["daemon"]),
                "inproc_gbps": median(rates["inproc"]),
                "inproc_copy_only_gbps": median(copy_rates),
                "ratio": median(ratios),
                "daemon_reps_gbps": rates["daemon"],
                "inproc_reps_gbps": rates["inproc"],
                "ratio_reps": ratios,
                "jobs_per_rep": jobs,
                "load_sets": key_sets if direction == "load" else None,
                # Mean ms a daemon copy waited for a copy thread (warm-up jobs included):
                # the part of in_daemon that is queueing behind other copies.
                "copy_wait_ms_mean": 1e3 * waited[1] / waited[0] if waited[0] else None,
            }
            samples[direction] = lat
        return out, samples

    # -- the two series ------------------------------------------------------------

    def per_size(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One engine, jobs of each size: throughput rows and latency rows."""
        geo = self.plan.geo
        workers = self.fleet.engine_workers(1)
        rows, lat_rows = [], []
        for chunks in self.plan.sizes:
            figures, samples = self._series(workers, 1, chunks, f"{chunks}-chunk jobs")
            rows.append(
                {
                    "chunks": chunks,
                    "job_bytes": geo.job_bytes(chunks),
                    "runs_per_rank": geo.runs_per_job(chunks),
                    **figures,
                }
            )
            for direction in DIRECTIONS:
                row = latency_row(chunks, direction, samples[direction])
                row["copy_wait_ms_mean"] = figures[direction]["copy_wait_ms_mean"]
                lat_rows.append(row)
        return rows, lat_rows

    def aggregate(self) -> list[dict[str, Any]]:
        """1, 2, 4 ... engines side by side against one daemon, and in-process."""
        rows = []
        chunks = self.plan.agg_chunks
        for n in self.plan.engines:
            workers = self.fleet.engine_workers(n)
            figures, samples = self._series(workers, n, chunks, f"{n} engine(s)")
            rows.append(
                {
                    "engines": n,
                    "processes": len(workers),
                    "chunks": chunks,
                    "job_bytes": self.plan.geo.job_bytes(chunks),
                    **figures,
                    "latency": {d: latency_row(chunks, d, samples[d]) for d in DIRECTIONS},
                }
            )
        return rows


def _jobs(records: list[list[float]]) -> list[tuple[float, float, int]]:
    """(start, end, bytes) of a worker's job records."""
    return [(j[0], j[1], int(j[2])) for j in records]


def latency_row(
    chunks: int, direction: str, samples: list[tuple[float, float, float]]
) -> dict[str, Any]:
    """Per-job figures in ms from (client round trip, copy seconds, daemon seconds).

    overhead = round trip - copy: everything that is not moving bytes (gRPC both
    ways, the client's threads, validation, index, planning, the hand-off to a
    copy thread). `in_daemon` is the daemon's share of it (total - copy), `wire`
    the rest (round trip - total).
    """
    ms = 1e3
    rtt = [s[0] * ms for s in samples]
    copy = [s[1] * ms for s in samples]
    overhead = [(s[0] - s[1]) * ms for s in samples]
    in_daemon = [(s[2] - s[1]) * ms for s in samples]
    wire = [(s[0] - s[2]) * ms for s in samples]
    return {
        "chunks": chunks,
        "direction": direction,
        "samples": len(samples),
        "rtt_ms": {"p50": percentile(rtt, 50), "p99": percentile(rtt, 99)},
        "copy_ms": {"p50": percentile(copy, 50), "p99": percentile(copy, 99)},
        "overhead_ms": {"p50": percentile(overhead, 50), "p99": percentile(overhead, 99)},
        "in_daemon_ms": {"p50": percentile(in_daemon, 50), "p99": percentile(in_daemon, 99)},
        "wire_ms": {"p50": percentile(wire, 50), "p99": percentile(wire, 99)},
        "noncopy_share": 1.0 - ratio(sum(copy), sum(rtt)) if rtt else 0.0,
    }
