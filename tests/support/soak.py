"""Soak and crash drivers: engine processes that hammer a live daemon.

    python tests/support/soak.py soak   --target T --seconds 30 --seed 1   (JSON report)
    python tests/support/soak.py victim --target T --salt S ...            (until killed)

`soak`: random stores, loads (pinned and unpinned), lookups, pins, inline Gets and
admin evictions against a namespace that every soak process shares. Every block's
bytes derive from (namespace, key, rank, layer, sub-block) (tests.support.engine),
so any process can check any block it loads, whoever stored it: a successful load
or Get with one wrong byte is a mismatch. A pinned key must load; an unpinned one
may have been evicted (NOT_FOUND is fine, wrong bytes never are). Prints one JSON
report line at the end.

`victim`: sets up everything a session can hold (registrations of two ranks, fully
stored rows, half-written rows, pins on its own and on `--pin-salt` keys, an fd sent
but never claimed), prints one `READY {json}` line, then keeps store and load jobs
in flight until it is killed. The crash-cleanup test SIGKILLs it.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import struct
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc

from kvdepot.client import DepotClient
from kvdepot.client.fdpass import encode
from kvdepot.client.shm import SharedKVBuffer
from kvdepot.v1 import admin_pb2 as apb
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, make_key, page_bytes

STORE_BASE = 0  # block ids [0, 64) hold what a store sends
LOAD_BASE = 64  # block ids [64, 128) receive what a load brings back
MAX_CHUNKS_PER_JOB = 4


def geometry(namespace: str) -> Geometry:
    # Two groups of different row sizes (32 KiB and 12 KiB slots), two ranks.
    return Geometry(namespace=namespace, num_blocks=128)


def group_job(
    geo: Geometry, group: int, keys: list[bytes], base: int
) -> tuple[list[list[int]], list[int]]:
    """Block ids and block_indices for a job of `keys` (all of `group`): chunk c sits
    in blocks base + c*bpc ..; the keys need not be consecutive chunks."""
    bpc = geo.blocks_per_chunk
    blocks = [[] for _ in geo.groups]
    blocks[group] = list(range(base, base + len(keys) * bpc))
    return blocks, [0] * len(geo.groups)


def section_bytes(geo: Geometry, key: bytes, rank: int) -> bytes:
    """What Get returns for `key`'s `rank` section: layer-major, sub-blocks inside."""
    group = int.from_bytes(key[-4:], "big")
    first = sum(len(g) for g in geo.groups[:group])
    return b"".join(
        page_bytes(geo.namespace, key, rank, first + i, sub, p)
        for i, p in enumerate(geo.groups[group])
        for sub in range(geo.blocks_per_chunk)
    )


class Worker:
    """One soak process: two ranks' KV memory on one session."""

    def __init__(self, target: str, geo: Geometry, seed: int, key_space: int, name: str) -> None:
        self.geo = geo
        self.rng = random.Random(seed)
        self.key_space = key_space
        self.client = DepotClient(target, client_name=name).start()
        if not self.client.wait_connected(10):
            raise SystemExit("no daemon")
        self.engines = [Engine(self.client, geo, r) for r in range(geo.world_size)]
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.mismatches = 0
        self.verified_pages = 0

    def keys(self, n: int) -> tuple[int, list[bytes]]:
        group = self.rng.randrange(len(self.geo.groups))
        chunks = self.rng.sample(range(self.key_space), n)
        return group, [make_key(c, group) for c in chunks]

    def error(self, what: str) -> None:
        self.ops["error"] += 1
        if len(self.errors) < 20:
            self.errors.append(what)

    # -- operations --------------------------------------------------------------------

    def store(self) -> None:
        group, keys = self.keys(self.rng.randint(1, MAX_CHUNKS_PER_JOB))
        blocks, indices = group_job(self.geo, group, keys, STORE_BASE)
        ranks = list(range(self.geo.world_size))
        if self.rng.random() < 0.2:
            ranks = ranks[:1]  # leave the row half-written: another process may finish it
        for rank in ranks:
            eng = self.engines[rank]
            eng.fill(group, keys, blocks[group], 0)
            res = eng.job(pb.STORE, keys, blocks, indices)
            self.ops["store_keys"] += res.stored_keys
            self.ops["store_dropped"] += res.dropped_keys
            if not res.success:
                self.error(f"store failed: {res.error_code} {res.error}")

    def load(self, pinned: bool) -> None:
        group, keys = self.keys(self.rng.randint(1, MAX_CHUNKS_PER_JOB))
        if pinned:
            ok = self.client.pin(self.geo.namespace, keys)
            keys = [k for k, p in zip(keys, ok, strict=True) if p]
            if not keys:
                self.ops["load_nothing_pinned"] += 1
                return
        try:
            rank = self.rng.randrange(self.geo.world_size)
            eng = self.engines[rank]
            blocks, indices = group_job(self.geo, group, keys, LOAD_BASE)
            res = eng.job(pb.LOAD, keys, blocks, indices)
            if res.success:
                bad = eng.mismatches(group, keys, blocks[group], 0)
                self.mismatches += bad
                self.verified_pages += len(blocks[group]) * len(self.geo.groups[group])
                self.ops["load_ok"] += 1
                if bad:
                    self.error(f"load of {len(keys)} key(s) rank {rank}: {bad} page(s) wrong")
            elif not pinned and res.error_code == "NOT_FOUND":
                self.ops["load_miss"] += 1  # evicted or never stored: a miss, fine
            else:
                self.error(f"load failed (pinned={pinned}): {res.error_code} {res.error}")
        finally:
            if pinned:
                self.client.unpin(self.geo.namespace, keys, wait=True)

    def lookup(self) -> None:
        _, keys = self.keys(self.rng.randint(1, 16))
        self.ops["lookup_hits"] += sum(self.client.lookup(self.geo.namespace, keys))

    def get(self) -> None:
        _, (key,) = self.keys(1)
        if not self.client.pin(self.geo.namespace, [key])[0]:
            self.ops["get_nothing_pinned"] += 1
            return
        try:
            rank = self.rng.randrange(self.geo.world_size)
            data = self.client.get(self.geo.namespace, key, rank)
            self.ops["get_ok"] += 1
            if data != section_bytes(self.geo, key, rank):
                self.mismatches += 1
                self.error(f"Get of {key.hex()[:16]} rank {rank}: wrong bytes")
        finally:
            self.client.unpin(self.geo.namespace, [key], wait=True)

    def evict(self) -> None:
        if self.rng.random() < 0.05:
            self.client.admin.Clear(apb.ClearRequest(), timeout=5)
            self.ops["clear"] += 1
            return
        _, keys = self.keys(self.rng.randint(1, 8))
        resp = self.client.admin.Evict(
            apb.EvictRequest(namespace_id=self.geo.namespace, keys=keys), timeout=5
        )
        self.ops["evicted"] += resp.evicted_blocks

    def run(self, seconds: float) -> dict[str, object]:
        actions = [
            (0.40, self.store),
            (0.20, lambda: self.load(True)),
            (0.10, lambda: self.load(False)),
            (0.15, self.lookup),
            (0.07, self.get),
            (0.08, self.evict),
        ]
        weights = [w for w, _ in actions]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            (action,) = self.rng.choices([a for _, a in actions], weights)
            try:
                action()
            except grpc.RpcError as exc:
                self.error(f"{getattr(action, '__name__', 'load')}: {exc.code()} {exc.details()}")
            self.ops["ops"] += 1
        self.client.close()
        return {
            "ops": dict(self.ops),
            "mismatches": self.mismatches,
            "verified_pages": self.verified_pages,
            "errors": self.errors,
        }


def send_unclaimed_fd(fd_socket: str, session_id: str) -> str:
    """Sends a memfd over the fd socket and never registers it (a pending fd)."""
    buf = SharedKVBuffer.allocate(4096, name="kvdepot-victim-pending")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(fd_socket)
        s.sendmsg(
            [encode({"session_id": session_id})],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", buf.fd))],
        )
        reply = s.recv(4096)
    return reply[4:].decode()


def victim(target: str, geo: Geometry, salt: bytes, pin_salt: bytes | None, rows: int) -> None:
    client = DepotClient(target, client_name="crash-victim").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    engines = [Engine(client, geo, r) for r in range(geo.world_size)]
    own = [make_key(c, 0, salt) for c in range(rows)]
    half = [make_key(c, 0, salt + b"-half") for c in range(rows)]
    blocks, indices = group_job(geo, 0, own, STORE_BASE)
    for eng in engines:  # whole rows: READY, owned by nobody once stored
        eng.fill(0, own, blocks[0], 0)
        assert eng.job(pb.STORE, own, blocks, indices).success
    hblocks, hindices = group_job(geo, 0, half, STORE_BASE)
    engines[0].fill(0, half, hblocks[0], 0)
    assert engines[0].job(pb.STORE, half, hblocks, hindices).success  # rank 0 only: WRITING
    pinned = sum(client.pin(geo.namespace, own[: rows // 2]))
    if pin_salt is not None:
        foreign = [make_key(c, 0, pin_salt) for c in range(rows)]
        pinned += sum(client.pin(geo.namespace, foreign))
        pinned += sum(client.pin(geo.namespace, foreign))  # twice: pins are counted
    token = send_unclaimed_fd(client.hello.fd_socket, client.session_id)  # type: ignore[union-attr]
    print(
        "READY "
        + json.dumps(
            {
                "session_id": client.session_id,
                "pins": pinned,
                "half_rows": len(half),
                "fd_reply": token,
            }
        ),
        flush=True,
    )
    # Keep copies in flight until SIGKILL: fresh full rows stored by both ranks (the
    # pool evicts old ones by LRU) and loads of the victim's own rows, without waiting.
    # (Refilling the store blocks may race with a store still reading them: nobody
    # verifies these rows; the soak workers, which do, wait for every job.)
    lblocks, lindices = group_job(geo, 0, own[:MAX_CHUNKS_PER_JOB], LOAD_BASE)
    n = 0
    while True:
        while max(e.stream.inflight for e in engines) > 32:
            time.sleep(0.0005)
        n += 1
        fresh = [
            make_key(rows + n * MAX_CHUNKS_PER_JOB + i, 0, salt) for i in range(MAX_CHUNKS_PER_JOB)
        ]
        fblocks, findices = group_job(geo, 0, fresh, STORE_BASE)
        for eng in engines:
            eng.fill(0, fresh, fblocks[0], 0)
            for direction, keys, blk, idx in (
                (pb.STORE, fresh, fblocks, findices),
                (pb.LOAD, own[:MAX_CHUNKS_PER_JOB], lblocks, lindices),
            ):
                eng.submit(direction, keys, blk, idx)
            eng.stream.poll()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["soak", "victim"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--namespace", default="soak-ns")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--key-space", type=int, default=400)
    parser.add_argument("--salt", default="victim")
    parser.add_argument("--pin-salt", default=None)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    geo = geometry(args.namespace)
    if args.mode == "victim":
        victim(
            args.target,
            geo,
            args.salt.encode(),
            args.pin_salt.encode() if args.pin_salt is not None else None,
            args.rows,
        )
        return
    worker = Worker(args.target, geo, args.seed, args.key_space, f"soak seed={args.seed}")
    print(json.dumps(worker.run(args.seconds)), flush=True)


if __name__ == "__main__":
    main()
