"""The disk tier under a working set larger than RAM (`disk_bench --working-set`).

Two real daemons (`kvdepot serve`), each with the same RAM pool of `pool` bytes: one
with a disk tier of `disk_size` (at least 8x the pool; its `--disk-write` mode and
`--disk-write-priority` as given), one without. One bench worker
process (benchmarks/worker.py, an engine rank with its KV cache in a memfd) per daemon.

1. **Replay.** A trace of `requests` requests over `prompts` prompts of `chunks`
   chunks each (the working set: `ratio` x the pool). Key order: Zipf-like, prompt
   k (of rank 1..n) drawn with weight 1/k^s (`zipf_s`, seeded), so a hot few are
   reused often and the tail now and then. Each request does what vLLM's connector
   does: Lookup its keys; those not in RAM go in one Prefetch (the disk promotes what
   it holds into the pool; the driver waits for them to be ready); then one LOAD job
   when every chunk is there, else one STORE job (the request is "computed": present
   keys copy nothing). Chunks are counted by tier: RAM hit, disk hit, miss. The same
   trace runs on the daemon without a disk tier (its hits: RAM only).
   Promoted GB/s: the bytes of the LOAD jobs of requests with a disk hit over the
   time from their Prefetch to the end of their LOAD (what reaches the engine); and
   the bytes the replay wrote to disk (what each `--disk-write` mode costs the disk).
2. **Stores while the disk writes.** Series of STORE jobs of fresh keys (each series
   `store_mib` MiB, more than the pool, so RAM evicts and the disk writes behind the
   whole time), on both daemons alternately, `rounds` times each: GB/s of each, and
   the ratio of the medians (disk / no disk; the target is >= 0.95). The disk's
   dropped writes (bounded write-behind: a slow disk drops, never slows a store) are
   reported with it.

Runs in the bench process (main thread); the daemons and workers are its children,
stopped at the end.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvdepot.bench.daemon import OwnDaemon
from kvdepot.bench.fleet import Fleet
from kvdepot.bench.geometry import BenchGeometry, job_shape
from kvdepot.client import DepotClient
from kvdepot.v1 import depot_pb2 as pb

NAMESPACE = "disk-working-set"
SALT = b"disk-ws"
STORE_SERIES_BASE = 1 << 40  # key numbers of the store series, apart from the trace's
PROMOTE_TIMEOUT_S = 30.0


class _Side:
    """One daemon, its worker and a client of the driver's (Lookup, Prefetch)."""

    def __init__(self, pool: int, extra: list[str], geo: BenchGeometry, chunks: int) -> None:
        self.daemon = OwnDaemon(str(pool), extra=extra)
        self.fleet = Fleet(1, 1)
        self.chunks = chunks
        self.geo = geo
        self.num_blocks = 4 * chunks * geo.blocks_per_chunk
        try:
            self.daemon.wait_serving()
            self.fleet.setup(
                self.daemon.target, vars(geo), self.num_blocks, SALT, NAMESPACE, 1 << 20
            )
            self.daemon.wait_warm()
            self.client = DepotClient(self.daemon.target, client_name="disk-working-set driver")
            if not self.client.start().wait_connected(15):
                raise RuntimeError("the driver's session did not open")
        except BaseException:
            self.close()
            raise
        self.pattern = 0

    def keys(self, seq: int) -> list[bytes]:
        return job_shape(self.geo, self.num_blocks, SALT, 0, seq, self.chunks, 0).keys

    def job(self, direction: str, seq: int, jobs: int = 1) -> dict[str, Any]:
        """`jobs` jobs of `chunks` chunks, one at a time, keys from `seq` on."""
        self.pattern += jobs
        (reply,) = self.fleet.call(
            self.fleet.workers,
            lambda w: {
                "cmd": "run",
                "mode": "daemon",
                "direction": direction,
                "chunks": self.chunks,
                "jobs": jobs,
                "warmup": 0,
                "key_seq": seq,
                "key_sets": 0,
                "pattern": self.pattern,
                "depth": 1,
            },
        )
        return reply

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        self.fleet.close()
        self.daemon.stop()


def zipf_trace(prompts: int, requests: int, s: float, seed: int) -> list[int]:
    weights = [1.0 / (k + 1) ** s for k in range(prompts)]
    order = list(range(prompts))
    random.Random(seed).shuffle(order)  # which prompt is hot: not the lowest keys
    return random.Random(seed + 1).choices(order, weights=weights, k=requests)


def replay(side: _Side, trace: list[int], job_bytes: int) -> dict[str, Any]:
    """The trace on one daemon: chunks by tier, and the promoted blocks' GB/s."""
    c = side.client
    ram = disk = miss = load_failed = 0
    promoted_bytes, promoted_s, ready_s = 0, 0.0, 0.0
    for prompt in trace:
        seq = prompt * side.chunks
        keys = side.keys(seq)
        here = c.lookup(NAMESPACE, keys)
        missing = [k for k, h in zip(keys, here, strict=True) if not h]
        ram += len(keys) - len(missing)
        t0 = time.monotonic()
        fetching: list[bytes] = []
        if missing:
            states = c.prefetch(NAMESPACE, missing).states
            fetching = [
                k
                for k, st in zip(missing, states, strict=True)
                if st == pb.PrefetchResponse.FETCHING
            ]
            miss += len(missing) - len(fetching)
            deadline = t0 + PROMOTE_TIMEOUT_S
            while fetching and not all(c.lookup(NAMESPACE, fetching)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0005)
            t_ready = time.monotonic()
            arrived = all(c.lookup(NAMESPACE, fetching)) if fetching else True
            if not arrived:
                miss += len(fetching)
                fetching = []
            disk += len(fetching)
        if len(fetching) == len(missing):  # every chunk in RAM now: the engine loads
            r = side.job("load", seq)
            if r["failed"]:  # a row gone between the lookup and the load: recomputed
                load_failed += 1
                side.job("store", seq)
            elif fetching:
                promoted_bytes += job_bytes
                promoted_s += r["jobs"][0][1] - t0
                ready_s += t_ready - t0
        else:  # computed, and stored (keys present copy nothing)
            side.job("store", seq)
    total = ram + disk + miss
    return {
        "chunks": total,
        "ram_hit": ram / total,
        "disk_hit": disk / total,
        "miss": miss / total,
        "load_failed": load_failed,
        "promoted_GBps": promoted_bytes / promoted_s / 1e9 if promoted_s else None,
        "promoted_requests": promoted_bytes // job_bytes,
        "prefetch_to_ready_ms": 1e3 * ready_s / max(1, promoted_bytes // job_bytes),
    }


def store_series(side: _Side, seq: int, jobs: int, job_bytes: int) -> float:
    """GB/s of `jobs` STORE jobs of fresh keys, one at a time."""
    r = side.job("store", seq, jobs)
    if r["failed"]:
        raise RuntimeError(f"store series: {r['failed']} job(s) failed: {r['error']}")
    done = r["jobs"]
    return (
        (len(done) * job_bytes - r["dropped"] * job_bytes // side.chunks)
        / (done[-1][1] - done[0][0])
        / 1e9
    )


def run_working_set(
    directory: Path,
    pool: int,
    ratio: int = 8,
    disk_size: int | None = None,
    chunks: int = 8,
    requests: int = 0,
    zipf_s: float = 1.0,
    rounds: int = 3,
    seed: int = 7,
    disk_write: str = "ready",
    disk_write_priority: str = "low",
) -> dict[str, Any]:
    geo = BenchGeometry()
    job_bytes = geo.job_bytes(chunks)
    prompts = max(1, ratio * pool // job_bytes)
    disk_size = disk_size or (ratio + 2) * pool  # the working set, its record headers, slack
    requests = requests or 4 * prompts
    trace = zipf_trace(prompts, requests, zipf_s, seed)
    work = Path(tempfile.mkdtemp(prefix="kvdepot-ws-", dir=directory))
    with_disk = _Side(
        pool,
        [
            *("--disk", str(work / "disk"), "--disk-size", str(disk_size)),
            *("--disk-write", disk_write, "--disk-write-priority", disk_write_priority),
        ],
        geo,
        chunks,
    )
    try:
        without = _Side(pool, [], geo, chunks)
    except BaseException:
        with_disk.close()
        raise
    try:
        result: dict[str, Any] = {
            "pool": pool,
            "disk_size": disk_size,
            "job_bytes": job_bytes,
            "prompts": prompts,
            "working_set": prompts * job_bytes,
            "requests": requests,
            "trace": f"Zipf-like, s={zipf_s}, seed {seed}",
            "disk_write": disk_write,
            "disk_write_priority": disk_write_priority,
        }
        result["replay_disk"] = replay(with_disk, trace, job_bytes)
        replay_written = with_disk.daemon.stats().disk_write_bytes
        result["replay_ram_only"] = replay(without, trace, job_bytes)
        series_jobs = max(4, 2 * pool // job_bytes)  # twice the pool per series
        seq = STORE_SERIES_BASE
        gbps: dict[str, list[float]] = {"disk": [], "ram_only": []}
        for r in range(rounds):
            order = [("disk", with_disk), ("ram_only", without)]
            for name, side in order if r % 2 == 0 else order[::-1]:
                gbps[name].append(store_series(side, seq, series_jobs, job_bytes))
                seq += series_jobs * chunks
        s = with_disk.daemon.stats()
        result["replay_disk"]["write_bytes"] = replay_written
        result["stores"] = {
            "series_bytes": series_jobs * job_bytes,
            "disk_GBps": gbps["disk"],
            "ram_only_GBps": gbps["ram_only"],
            "ratio": statistics.median(gbps["disk"]) / statistics.median(gbps["ram_only"]),
        }
        result["disk_stats"] = {
            "writes": s.disk_writes,
            "write_drops": dict(s.disk_write_drops),
            "reads": s.disk_reads,
            "hits": s.disk_hits,
            "evicted": s.disk_evicted,
            "rejected": s.disk_rejected,
            "direct_io": s.disk_direct_io,
        }
        return result
    finally:
        with_disk.close()
        without.close()
        shutil.rmtree(work, ignore_errors=True)


def working_set_table(r: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"working set: pool {r['pool'] // mib} MiB, disk {r['disk_size'] // mib} MiB, "
        f"{r['prompts']} prompts of {r['job_bytes'] // mib} MiB = "
        f"{r['working_set'] / r['pool']:.1f}x the pool; {r['requests']} requests, {r['trace']}; "
        f"--disk-write {r['disk_write']}, --disk-write-priority {r['disk_write_priority']}"
    ]
    for name in ("replay_disk", "replay_ram_only"):
        x = r[name]
        row = (
            f"{name[7:]:9s} chunks {x['chunks']}: RAM hit {x['ram_hit']:.1%}, disk hit "
            f"{x['disk_hit']:.1%}, miss {x['miss']:.1%}"
        )
        if x["promoted_GBps"]:
            row += (
                f"; promoted {x['promoted_GBps']:.2f} GB/s to the engine over "
                f"{x['promoted_requests']} requests (Prefetch to ready "
                f"{x['prefetch_to_ready_ms']:.1f} ms each)"
            )
        if "write_bytes" in x:
            row += f"; {x['write_bytes'] / 1e9:.2f} GB written to disk"
        if x["load_failed"]:
            row += f"; {x['load_failed']} loads failed (recomputed)"
        lines.append(row)
    st = r["stores"]
    lines.append(
        f"stores   {st['series_bytes'] // mib} MiB series: with disk "
        + " ".join(f"{v:.2f}" for v in st["disk_GBps"])
        + " GB/s, RAM only "
        + " ".join(f"{v:.2f}" for v in st["ram_only_GBps"])
        + f" GB/s; ratio of medians {st['ratio']:.2f} (target >= 0.95)"
    )
    d = r["disk_stats"]
    lines.append(
        f"disk     {d['writes']} writes, dropped {d['write_drops'] or 'none'}, {d['reads']} reads, "
        f"{d['evicted']} evicted, {d['rejected']} rejected, direct I/O {d['direct_io']}"
    )
    return "\n".join(lines)
