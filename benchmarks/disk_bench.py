"""The disk tier's figures, each next to its reference in the same run (docs/disk-tier.md).

    python -m kvdepot.bench.disk_bench                      # /var/tmp, 1 GiB, 1 MiB, QD 4
    python -m kvdepot.bench.disk_bench --dir /mnt/nvme/kv --size 4G --scan-records 100000
    python -m kvdepot.bench.disk_bench --json
    python -m kvdepot.bench.disk_bench --working-set --pool 256MiB   # 8x the pool, replayed

1. Write and read GB/s of the tier (kvdepot.server.disk.tier: O_DIRECT from
   page-aligned memory, keyed BLAKE3 tag on write and check on read, `--qd` I/O
   threads kept busy) against `fio` with direct I/O, libaio at the same block size
   and queue depth on a file in the same directory, as ratios. Without `fio` on the
   PATH its row is skipped with a note (Debian: apt-get install fio).
2. The index at a restart: time to reopen a tier holding `--scan-records` small
   records (one page of payload each) until its index is back, after a clean stop
   (its checkpoint) and as after a crash (the checkpoint removed: the header scan);
   and the scan of the throughput run's file (one header per block).
3. The digests a record could carry, on one core, over `--block` bytes: keyed
   BLAKE3 (what the tier uses: the payload's tag), unkeyed BLAKE3, CRC-32 (zlib),
   BLAKE2b.
4. With `--working-set` (instead of 1-3): real daemons with a `--pool` RAM pool, one
   with a disk tier and one without, a Zipf-like trace over a working set `--ws-ratio`
   (8) times the pool: hit rate by tier, the GB/s at which promoted blocks reach the
   engine, and stores to RAM while the disk writes against the same without a disk
   tier (kvdepot.bench.disk_working_set).

GB/s counts payload bytes (a record adds one header page). Files are removed after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

from kvdepot.bench.disk_working_set import run_working_set
from kvdepot.bench.disk_working_set import working_set_table as ws_table
from kvdepot.server.disk.checkpoint import FILE_NAME as CHECKPOINT
from kvdepot.server.disk.record import PAGE, RecordKey
from kvdepot.server.disk.space import WriteVerdict
from kvdepot.server.disk.tier import DiskTier
from kvdepot.server.sizes import parse_size


def file_system_of(path: Path) -> str:
    """The type and mount point of the file system holding `path`."""
    best = ("?", "")
    target = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            _dev, where, fstype, *_ = line.split()
            if (target == where or target.startswith(where.rstrip("/") + "/")) and len(
                where
            ) >= len(best[1]):
                best = (fstype, where)
    return f"{best[0]} on {best[1]}"


class _Depth:
    """Keeps `qd` operations in flight; `wait_all` until the last is done."""

    def __init__(self, qd: int) -> None:
        self._slots = threading.Semaphore(qd)
        self._qd = qd
        self.failures = 0

    def submit(self, start: Callable[[Callable[[bool], None]], bool]) -> None:
        self._slots.acquire()
        if not start(self._done):
            self._slots.release()
            self.failures += 1

    def _done(self, ok: bool) -> None:
        if not ok:
            self.failures += 1
        self._slots.release()

    def wait_all(self) -> None:
        for _ in range(self._qd):
            self._slots.acquire()
        for _ in range(self._qd):
            self._slots.release()


def tier_throughput(directory: Path, size: int, block: int, qd: int) -> dict[str, float]:
    """Writes the tier full of `block`-byte blocks, then reads them all back."""
    count = size // (block + PAGE) - 1
    buffers = [memoryview(mmap.mmap(-1, block)) for _ in range(qd * 2)]
    for i, b in enumerate(buffers):
        b[:] = os.urandom(64) * (block // 64) + bytes(block % 64)
        b[0] = i
    tier = DiskTier(directory, size, io_threads=qd, max_inflight_bytes=qd * (block + PAGE))
    tier.open()
    tier.wait_recovered()
    depth = _Depth(qd)
    key = [i.to_bytes(8, "big") for i in range(count)]

    def write(i: int) -> Callable[[Callable[[bool], None]], bool]:
        return lambda done: (
            tier.write("bench", key[i], buffers[i % len(buffers)], done) is WriteVerdict.ACCEPTED
        )

    def read(i: int) -> Callable[[Callable[[bool], None]], bool]:
        return lambda done: tier.read("bench", key[i], buffers[i % len(buffers)], done)

    cpu0 = time.process_time()
    try:
        t0 = time.perf_counter()
        for i in range(count):
            depth.submit(write(i))
        depth.wait_all()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(count):
            depth.submit(read(i))
        depth.wait_all()
        read_s = time.perf_counter() - t0
        direct = bool(tier.snapshot()["direct_io"])
    finally:
        tier.close()
    cpu_s = time.process_time() - cpu0
    (directory / CHECKPOINT).unlink()  # as after a crash: the index from the headers
    t0 = time.perf_counter()
    tier = DiskTier(directory, size)
    tier.open()
    tier.wait_recovered()
    rescan_s = time.perf_counter() - t0
    tier.close()
    if depth.failures:
        raise RuntimeError(f"{depth.failures} tier operations failed")
    return {
        "write_GBps": count * block / write_s / 1e9,
        "read_GBps": count * block / read_s / 1e9,
        "blocks": count,
        "direct_io": direct,
        # Both ways, this process: the digests are most of it.
        "cpu_s_per_GB": cpu_s / (2 * count * block / 1e9),
        "rescan_s": rescan_s,
        "rescan_records_per_s": count / rescan_s,
    }


def fio_throughput(directory: Path, size: int, block: int, qd: int) -> dict[str, float] | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    out = {}
    path = directory / "fio.dat"
    try:
        for rw, field in (("write", "write"), ("read", "read")):
            proc = subprocess.run(
                [
                    fio,
                    "--name=kvdepot",
                    f"--filename={path}",
                    f"--rw={rw}",
                    f"--bs={block}",
                    f"--size={size - size % block}",
                    "--ioengine=libaio",
                    f"--iodepth={qd}",
                    "--direct=1",
                    "--output-format=json",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            out[f"{rw}_GBps"] = json.loads(proc.stdout)["jobs"][0][field]["bw_bytes"] / 1e9
    finally:
        path.unlink(missing_ok=True)
    return out


def scan_rate(directory: Path, records: int) -> dict[str, float]:
    """Writes `records` one-page records, then times a reopen until the index is back."""
    size = (records + 2) * 2 * PAGE
    buf = memoryview(mmap.mmap(-1, PAGE))
    tier = DiskTier(directory, size, max_inflight_bytes=64 << 20)
    tier.open()
    tier.wait_recovered()
    depth = _Depth(8)
    for i in range(records):
        k = i.to_bytes(8, "big")
        depth.submit(lambda done, k=k: tier.write("bench", k, buf, done) is WriteVerdict.ACCEPTED)
    depth.wait_all()
    tier.close()
    out: dict[str, float] = {}
    for how in ("checkpoint", "scan"):  # after a clean stop, then as after a crash
        if how == "scan":
            (directory / CHECKPOINT).unlink()
        t0 = time.perf_counter()
        tier = DiskTier(directory, size)
        tier.open()
        out[f"{how}_open_s"] = time.perf_counter() - t0
        tier.wait_recovered()
        out[f"{how}_s"] = time.perf_counter() - t0
        stats = tier.snapshot()
        assert stats["recovery_source"] == how, stats
        out["records"] = int(stats["recovered"])  # type: ignore[call-overload]
        tier.close()
    out["scan_records_per_s"] = out["records"] / out["scan_s"]
    return out


def digest_rates(block: int) -> dict[str, float]:
    buf = memoryview(mmap.mmap(-1, block))
    buf[:] = os.urandom(block)
    tag = RecordKey(os.urandom(32)).payload_tag  # keyed BLAKE3: what the tier computes
    fns: dict[str, Callable[[], object]] = {
        "blake3_keyed": lambda: tag("ns", b"key", 0, buf),
        "blake3": lambda: blake3.blake3(buf).digest(16),
        "crc32": lambda: zlib.crc32(buf),
        "blake2b": lambda: hashlib.blake2b(buf, digest_size=16).digest(),
    }
    out = {}
    for name, fn in fns.items():
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            fn()
            n += 1
        out[f"{name}_GBps"] = n * block / (time.perf_counter() - t0) / 1e9
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="kvdepot-disk-bench-", dir=args.dir))
    try:
        result: dict[str, Any] = {
            "file_system": file_system_of(base),
            "size": args.size,
            "block": args.block,
            "qd": args.qd,
            "load": os.getloadavg(),
            "digests": digest_rates(args.block),
        }
        result["tier"] = tier_throughput(base / "tier", args.size, args.block, args.qd)
        shutil.rmtree(base / "tier")
        fio = fio_throughput(base, args.size, args.block, args.qd)
        result["fio"] = fio
        if fio:
            result["ratio"] = {
                k: result["tier"][k] / fio[k] for k in ("write_GBps", "read_GBps") if fio[k]
            }
        if args.scan_records:
            result["scan"] = scan_rate(base / "scan", args.scan_records)
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)


def working_set(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.dir)
    result = {
        "file_system": file_system_of(base),
        "load": os.getloadavg(),
        **run_working_set(
            base,
            args.pool,
            ratio=args.ws_ratio,
            disk_size=args.disk_size,
            chunks=args.chunks,
            requests=args.requests,
            zipf_s=args.zipf,
            rounds=args.rounds,
            disk_write=args.disk_write,
            disk_write_priority=args.disk_write_priority,
        ),
    }
    result["load_after"] = os.getloadavg()
    return result


def working_set_table(r: dict[str, Any]) -> str:
    return (
        f"disk tier working-set bench: {r['file_system']}, load {r['load'][0]:.2f} "
        f"(after {r['load_after'][0]:.2f})\n" + ws_table(r)
    )


def table(r: dict[str, Any]) -> str:
    lines = [
        f"disk tier bench: {r['file_system']}, {r['size'] >> 20} MiB, block {r['block']} B, "
        f"QD {r['qd']}, load {r['load'][0]:.2f}",
        "digests, one core:  "
        + "  ".join(f"{k[:-5]} {v:.2f} GB/s" for k, v in r["digests"].items()),
    ]
    t, fio = r["tier"], r["fio"]
    for way in ("write", "read"):
        row = f"{way:5s}  tier {t[f'{way}_GBps']:.2f} GB/s"
        if fio:
            row += f"  fio {fio[f'{way}_GBps']:.2f} GB/s  ratio {r['ratio'][f'{way}_GBps']:.2f}"
        lines.append(row)
    lines.append(f"tier CPU: {t['cpu_s_per_GB']:.2f} s per GB moved (digest and I/O calls)")
    lines.append(
        f"scan   {t['blocks']} records of one block: index back in {t['rescan_s']:.2f} s "
        f"({t['rescan_records_per_s']:.0f} records/s)"
    )
    if not t["direct_io"]:
        lines.append("note: the file system refused O_DIRECT: the tier used buffered I/O")
    if not fio:
        lines.append("fio: not on the PATH, row skipped (Debian: apt-get install fio)")
    if "scan" in r:
        s = r["scan"]
        lines.append(
            f"index  {s['records']} records: after a clean stop (checkpoint) open "
            f"{s['checkpoint_open_s'] * 1e3:.0f} ms, index back in {s['checkpoint_s']:.2f} s; "
            f"as after a crash (scan) open {s['scan_open_s'] * 1e3:.0f} ms, index back in "
            f"{s['scan_s']:.2f} s ({s['scan_records_per_s']:.0f} records/s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvdepot.bench.disk_bench", description=__doc__)
    p.add_argument("--dir", default="/var/tmp", help="where the files go (default /var/tmp)")
    p.add_argument("--size", type=parse_size, default=1 << 30, help="tier size (default 1G)")
    p.add_argument("--block", type=parse_size, default=1 << 20, help="block (default 1M)")
    p.add_argument("--qd", type=int, default=4, help="queue depth = I/O threads (default 4)")
    p.add_argument("--scan-records", type=int, default=20000, help="0: no scan figure")
    p.add_argument("--json", action="store_true", help="JSON on stdout, the table on stderr")
    ws = p.add_argument_group("--working-set")
    ws.add_argument("--working-set", action="store_true", help="the working-set replay")
    ws.add_argument("--pool", type=parse_size, default=256 << 20, help="RAM pool (256MiB)")
    ws.add_argument("--ws-ratio", type=int, default=8, help="working set / pool (8)")
    ws.add_argument("--disk-size", type=parse_size, help="disk tier ((ratio+2) x pool)")
    ws.add_argument("--chunks", type=int, default=8, help="2 MiB chunks per prompt (8)")
    ws.add_argument("--requests", type=int, default=0, help="trace length (4 x prompts)")
    ws.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the trace (1.0)")
    ws.add_argument("--rounds", type=int, default=3, help="store series per daemon (3)")
    ws.add_argument(
        "--disk-write",
        choices=("ready", "evict"),
        default="ready",
        help="the disk daemon's --disk-write (ready)",
    )
    ws.add_argument(
        "--disk-write-priority",
        choices=("low", "normal"),
        default="low",
        help="the disk daemon's --disk-write-priority (low)",
    )
    args = p.parse_args(argv)
    if args.working_set:
        result = working_set(args)
        render: Callable[[dict[str, Any]], str] = working_set_table
    else:
        result, render = run(args), table
    if args.json:
        print(render(result), file=sys.stderr)
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
