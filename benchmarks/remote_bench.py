"""`kvdepot bench --remote URL`: the remote tier against bare redis-py, in one run.

    kvdepot bench --remote redis://127.0.0.1:6379 [--quick] [--json]
    python -m kvdepot.bench.remote_bench --remote redis://HOST:PORT[,HOST:PORT]

1. Tier GB/s. The same chunk-sized values (default 2 MiB: one Llama-3-8B block row)
   are written and read through the tier (kvdepot.server.remote: framing with the
   fleet key's keyed-BLAKE3 MAC, set-if-absent with a TTL; on reads a GETRANGE
   bounded by the row's size and the verification of the MAC) and through bare
   redis-py (plain SET/GET of the raw bytes), with the same client kind (cluster
   or standalone), the same batches and the same calls in flight. The ratio
   tier/bare is the tier's overhead (target >= 0.8).
2. Miss to loaded block. Two daemons the bench starts (`kvdepot serve --remote URL
   --remote-key-file` with a key of its own) play two nodes: rows are Put on A; on
   B the time from a Prefetch of one row to its STORED event on Watch (ready in
   B's pool), and to its bytes read back (Get).

It writes keys under `kvd1:bench-*` and `kvd2:bench-*` and deletes them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.fleet_key import Keyring
from kvdepot.server.remote.redis_tier import RedisTier

TARGET_RATIO = 0.8


async def _batches(
    fn: Callable[[list[int]], Awaitable[None]], items: list[int], batch: int, in_flight: int
) -> float:
    """Seconds to run fn over `items` in batches, `in_flight` calls at once."""
    sem = asyncio.Semaphore(in_flight)

    async def one(chunk: list[int]) -> None:
        async with sem:
            await fn(chunk)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(items[i : i + batch]) for i in range(0, len(items), batch)))
    return time.perf_counter() - t0


async def tier_throughput(
    url: str, value_bytes: int, count: int, reps: int, batch: int = 8, in_flight: int = 4
) -> dict[str, Any]:
    tier = RedisTier(url)
    await tier.exists_many([b"kvd1:bench-probe"], time.monotonic() + 5)  # connect, probe
    client = await tier._get_client()  # the same redis-py client the tier uses: bare calls
    ns = f"bench-{secrets.token_hex(4)}"
    codec = Codec(Keyring.from_secrets(secrets.token_hex(32).encode()))  # as a daemon's
    payloads = [os.urandom(value_bytes) for _ in range(min(count, 16))]
    loop = asyncio.get_running_loop()
    total = value_bytes * count
    out: dict[str, list[float]] = {
        "bare_write": [],
        "bare_read": [],
        "tier_write": [],
        "tier_read": [],
    }
    all_keys: list[bytes] = []
    deadline = 60.0
    for rep in range(reps):
        bare_keys = [f"kvd1:bench-bare-{ns}-{rep}-{i}".encode() for i in range(count)]
        tier_pairs = [(os.urandom(32) + b"\0\0\0\0", i) for i in range(count)]
        tier_keys = [codec.remote_key(ns, k) for k, _ in tier_pairs]
        all_keys += bare_keys + tier_keys

        async def bare_set(chunk: list[int], keys: list[bytes] = bare_keys) -> None:
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                pipe.set(keys[i], payloads[i % len(payloads)])
            await pipe.execute()

        async def bare_get(chunk: list[int], keys: list[bytes] = bare_keys) -> None:
            pipe = client.pipeline(transaction=False)
            for i in chunk:
                pipe.get(keys[i])
            got = await pipe.execute()
            assert all(g is not None for g in got)

        async def tier_put(
            chunk: list[int],
            pairs: list[tuple[bytes, int]] = tier_pairs,
            keys: list[bytes] = tier_keys,
        ) -> None:
            # As the daemon's writer does: a batch framed in one go on a thread.
            values = await loop.run_in_executor(
                None,
                lambda: [codec.encode(ns, pairs[i][0], payloads[i % len(payloads)]) for i in chunk],
            )
            items = [(keys[i], v) for i, v in zip(chunk, values, strict=True)]
            await tier.put_many(items, 3600, time.monotonic() + deadline)

        async def tier_get(
            chunk: list[int],
            pairs: list[tuple[bytes, int]] = tier_pairs,
            keys: list[bytes] = tier_keys,
        ) -> None:
            # As the daemon's fetcher does: reads bounded by the row's framed size.
            limits = [codec.frame_bytes(ns, pairs[i][0], value_bytes) + 1 for i in chunk]
            values = await tier.get_many(
                [keys[i] for i in chunk], time.monotonic() + deadline, limits
            )
            assert all(v is not None for v in values)
            await loop.run_in_executor(
                None,
                lambda: [
                    codec.decode(v, ns, pairs[i][0], value_bytes)  # type: ignore[arg-type]
                    for i, v in zip(chunk, values, strict=True)
                ],
            )

        idx = list(range(count))
        # Alternate which goes first, so neither always meets a fresher server.
        first, second = ("bare", "tier") if rep % 2 == 0 else ("tier", "bare")
        steps = {
            "bare_write": bare_set,
            "tier_write": tier_put,
            "bare_read": bare_get,
            "tier_read": tier_get,
        }
        for d in ("write", "read"):
            for who in (first, second):
                out[f"{who}_{d}"].append(await _batches(steps[f"{who}_{d}"], idx, batch, in_flight))
    pipe = client.pipeline(transaction=False)
    for k in all_keys:  # one DEL per key: a cluster refuses keys of several slots in one
        pipe.delete(k)
    await pipe.execute()
    kind = "Redis cluster" if tier.cluster else "standalone Redis"
    await tier.close()
    gbps = {k: total / statistics.median(v) / 1e9 for k, v in out.items()}

    def ratio(d: str) -> float:
        """Median over the reps of the tier's speed over bare redis-py's in that rep:
        each pair ran back to back, so a busy machine skews both alike."""
        return statistics.median(
            b / t for t, b in zip(out[f"tier_{d}"], out[f"bare_{d}"], strict=True)
        )

    return {
        "store": kind,
        "value_bytes": value_bytes,
        "values": count,
        "reps": reps,
        "batch": batch,
        "calls_in_flight": in_flight,
        "gb_per_s": gbps,
        "write_ratio": ratio("write"),
        "read_ratio": ratio("read"),
    }


def miss_to_load(url: str, rows: int, row_bytes: int) -> dict[str, Any]:
    """Two own daemons: Put on A, then per row on B: Prefetch -> STORED -> Get."""
    from kvdepot.bench.daemon import OwnDaemon
    from kvdepot.client import DepotClient
    from kvdepot.v1 import admin_pb2
    from kvdepot.v1 import depot_pb2 as pb

    pool = str(max(256 << 20, 2 * rows * row_bytes))
    key_dir = tempfile.mkdtemp(prefix="kvdepot-bench-key-")
    key_file = os.path.join(key_dir, "fleet.key")  # the two nodes' fleet key, mode 0600
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode() + b"\n")
    os.close(fd)
    a = OwnDaemon(pool, extra=["--remote", url, "--remote-key-file", key_file])
    b = OwnDaemon(pool, extra=["--remote", url, "--remote-key-file", key_file])
    clients: list[DepotClient] = []
    try:
        a.wait_serving()
        b.wait_serving()
        ca = DepotClient(a.target, client_name="remote-bench A").start()
        cb = DepotClient(b.target, client_name="remote-bench B").start()
        clients += [ca, cb]
        assert ca.wait_connected(10) and cb.wait_connected(10)
        ns = f"remote-bench-{secrets.token_hex(6)}"
        layout = pb.NamespaceLayout(
            id=ns,
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[row_bytes])],
        )
        ca.register_kv(layout, 0, None, [], [])
        cb.register_kv(layout, 0, None, [], [])
        keys = [secrets.token_bytes(32) + b"\0\0\0\0" for _ in range(rows)]
        data = {k: os.urandom(row_bytes) for k in keys}
        for k in keys:
            ca.put(ns, k, 0, data[k], timeout=30)
        deadline = time.monotonic() + 60
        while ca.admin.GetStats(admin_pb2.GetStatsRequest()).remote_writes < rows:
            if time.monotonic() > deadline:
                raise TimeoutError("node A did not write the rows to the tier")
            time.sleep(0.01)
        arrived: dict[bytes, threading.Event] = {k: threading.Event() for k in keys}

        def on_event(ev: pb.WatchEvent) -> None:
            if ev.kind in (pb.WatchEvent.STORED, pb.WatchEvent.SNAPSHOT):
                for k in ev.keys:
                    if k in arrived:
                        arrived[k].set()

        watch = cb.watch(ns, on_event)
        time.sleep(0.2)  # the snapshot first
        ready_ms, loaded_ms = [], []
        for k in keys:
            t0 = time.perf_counter()
            resp = cb.prefetch(ns, [k], timeout=5)
            assert resp.states[0] == pb.PrefetchResponse.FETCHING, resp
            if not arrived[k].wait(10):
                raise TimeoutError("a fetched row never became ready on node B")
            t1 = time.perf_counter()
            got = cb.get(ns, k, 0, timeout=30)
            t2 = time.perf_counter()
            assert got == data[k], "node B read other bytes than node A stored"
            ready_ms.append((t1 - t0) * 1000)
            loaded_ms.append((t2 - t0) * 1000)
        watch.stop()
        stats = cb.admin.GetStats(admin_pb2.GetStatsRequest())

        def pct(v: list[float], q: float) -> float:
            return sorted(v)[min(len(v) - 1, int(q * len(v)))]

        return {
            "rows": rows,
            "row_bytes": row_bytes,
            "miss_to_ready_ms": {"p50": pct(ready_ms, 0.5), "p99": pct(ready_ms, 0.99)},
            "miss_to_loaded_ms": {"p50": pct(loaded_ms, 0.5), "p99": pct(loaded_ms, 0.99)},
            "node_b": {
                "remote_hits": stats.remote_hits,
                "remote_verify_failures": stats.remote_verify_failures,
            },
            "bytes_identical": True,
        }
    finally:
        for c in clients:
            c.close()
        a.stop()
        b.stop()
        shutil.rmtree(key_dir, ignore_errors=True)


def run_remote_bench(url: str, quick: bool = False, value_mib: float = 2.0) -> dict[str, Any]:
    value_bytes = int(value_mib * (1 << 20))
    count, reps, rows = (32, 3, 10) if quick else (64, 5, 40)
    result: dict[str, Any] = {"remote": url}
    result["throughput"] = asyncio.run(tier_throughput(url, value_bytes, count, reps))
    result["miss_to_load"] = miss_to_load(url, rows, value_bytes)
    t = result["throughput"]
    result["targets"] = [
        {
            "name": f"tier {d} GB/s >= {TARGET_RATIO} x bare redis-py",
            "value": t[f"{d}_ratio"],
            "met": t[f"{d}_ratio"] >= TARGET_RATIO,
        }
        for d in ("write", "read")
    ]
    return result


def format_table(r: dict[str, Any]) -> str:
    t, m = r["throughput"], r["miss_to_load"]
    g = t["gb_per_s"]
    lines = [
        f"remote tier: {r['remote']} ({t['store']}); {t['values']} values of "
        f"{t['value_bytes'] >> 10} KiB, batches of {t['batch']}, {t['calls_in_flight']} calls "
        f"in flight, median of {t['reps']}",
        f"  {'':8} {'tier GB/s':>10} {'bare redis-py GB/s':>19} {'ratio':>6}",
        f"  {'write':8} {g['tier_write']:10.2f} {g['bare_write']:19.2f} {t['write_ratio']:6.2f}",
        f"  {'read':8} {g['tier_read']:10.2f} {g['bare_read']:19.2f} {t['read_ratio']:6.2f}",
        f"miss to block ({m['rows']} rows of {m['row_bytes'] >> 10} KiB, two daemons):",
        f"  ready on node B (Prefetch -> Watch STORED)  p50 {m['miss_to_ready_ms']['p50']:.2f} ms"
        f"  p99 {m['miss_to_ready_ms']['p99']:.2f} ms",
        f"  loaded (+ Get of the row)                   p50 {m['miss_to_loaded_ms']['p50']:.2f} ms"
        f"  p99 {m['miss_to_loaded_ms']['p99']:.2f} ms",
    ]
    for tg in r["targets"]:
        lines.append(
            f"  target: {tg['name']}: {tg['value']:.2f} {'met' if tg['met'] else 'MISSED'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdepot.bench.remote_bench")
    ap.add_argument("--remote", required=True, metavar="URL")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--value-mib", type=float, default=2.0, help="value size (default 2 MiB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run_remote_bench(args.remote, args.quick, args.value_mib)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
