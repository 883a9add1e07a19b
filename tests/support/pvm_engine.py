"""An engine-like process whose KV memory is ordinary memory (the pvm path).

    python tests/support/pvm_engine.py store  --target T [--loop]   # prints JSON lines
    python tests/support/pvm_engine.py verify --target T
    python tests/support/pvm_engine.py unmap  --target T

The KV memory is one anonymous private mapping (what `torch.zeros` gets for a
large tensor), registered with `kvdepot.client.pvm.register_process_kv`; page
bytes come from tests.support.engine, so a loader checks every byte on its own.
`store` stores chunks and then waits for a line on stdin; with `--loop` it keeps
storing new chunks until killed. `unmap` unmaps half of its memory after
registering and reports what the daemon answered for stores and loads there.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient
from kvdepot.client.pvm import register_process_kv
from kvdepot.v1 import depot_pb2 as pb
from tests.support.engine import Engine, Geometry, chunk_plan

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class PvmEngine(Engine):
    """tests.support.engine.Engine with its KV in a private anonymous mapping."""

    def __init__(self, client: DepotClient, geo: Geometry, rank: int) -> None:
        self.client, self.geo, self.rank = client, geo, rank
        pages = geo.layer_pages
        self.size = geo.num_blocks * sum(pages)
        addr = _libc.mmap(
            None,
            self.size,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            -1,
            0,
        )
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.address = addr
        self.mem = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(addr))
        self.tensor_offsets = []
        off = 0
        for p in pages:
            self.tensor_offsets.append(off)
            off += geo.num_blocks * p
        tensors = [
            pb.KVTensor(
                region_index=0,
                region_offset=o,
                num_blocks=geo.num_blocks,
                block_stride_bytes=p,
                page_bytes=p,
            )
            for o, p in zip(self.tensor_offsets, pages, strict=True)
        ]
        refs, t = [], 0
        for g in geo.groups:
            refs.append(
                pb.GroupRefs(
                    layers=[pb.LayerRef(tensor_index=t + i, page_bytes=p) for i, p in enumerate(g)]
                )
            )
            t += len(g)
        self.registration, self.access = register_process_kv(
            client, geo.layout(), rank, [(addr, self.size)], tensors, refs
        )
        self.stream = client.transfer_stream()
        self._next_job = 1

    def unmap_tail(self) -> int:
        """Unmaps the second half of the memory; returns the first unmapped offset."""
        half = (self.size // 2) & ~(mmap.PAGESIZE - 1)
        assert _libc.munmap(self.address + half, self.size - half) == 0
        return half


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["store", "verify", "unmap"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--per-job", type=int, default=10)
    parser.add_argument("--loop", action="store_true")
    args = parser.parse_args()
    geo = Geometry(world_size=1, namespace="pvm-ns", num_blocks=256)
    client = DepotClient(args.target, client_name=f"pvm-engine {args.action}").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    eng = PvmEngine(client, geo, 0)
    report: dict[str, object] = {
        "memory_path": eng.registration.memory_path,
        "jobs": 0,
        "failed": 0,
        "mismatched_pages": 0,
        "stored": 0,
        "errors": [],
    }

    def run(direction: int, chunks: range, salt: bytes = b"") -> pb.TransferResult:
        keys, group_blocks, indices = chunk_plan(geo, chunks, salt=salt)
        n = len(chunks)
        if direction == pb.STORE:
            for g, blocks in enumerate(group_blocks):
                eng.fill(g, keys[g * n : (g + 1) * n], blocks, indices[g])
        res = eng.job(direction, keys, group_blocks, indices)
        report["jobs"] += 1  # type: ignore[operator]
        report["stored"] += res.stored_keys  # type: ignore[operator]
        if not res.success:
            report["failed"] += 1  # type: ignore[operator]
            report["errors"].append(res.error)  # type: ignore[union-attr]
        elif direction == pb.LOAD:
            for g, blocks in enumerate(group_blocks):
                report["mismatched_pages"] += eng.mismatches(  # type: ignore[operator]
                    g, keys[g * n : (g + 1) * n], blocks, indices[g]
                )
        return res

    if args.action == "unmap":
        # Store two chunks, then unmap the second half of the memory: every job
        # touches group 1's layers, which now lie (partly) in the hole.
        report["store_before"] = run(pb.STORE, range(0, 2), b"a").success
        eng.unmap_tail()
        keys, group_blocks, indices = chunk_plan(geo, range(2, 4), salt=b"u")
        res = eng.job(pb.STORE, keys, group_blocks, indices)  # no fill: it would fault here
        report["store_after"], report["store_error"] = res.success, res.error
        report["keys_ready_after_failed_store"] = sum(client.lookup(geo.namespace, keys))
        keys, group_blocks, indices = chunk_plan(geo, range(0, 2), salt=b"a")
        res = eng.job(pb.LOAD, keys, group_blocks, indices)
        report["load_after"], report["load_error"] = res.success, res.error
        print(json.dumps(report), flush=True)
        client.close()
        return
    for start in range(0, args.chunks, args.per_job):
        run(
            pb.STORE if args.action == "store" else pb.LOAD,
            range(start, min(start + args.per_job, args.chunks)),
        )
    print(json.dumps(report), flush=True)
    if args.action == "store" and args.loop:
        salt = 0
        while True:  # until killed: store fresh chunks over and over
            salt += 1
            run(pb.STORE, range(0, args.per_job), salt.to_bytes(4, "big"))
    if args.action == "store":
        sys.stdin.readline()  # keep the session (and the blocks' writer) until told
    client.close()


if __name__ == "__main__":
    _main()
