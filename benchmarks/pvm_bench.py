"""Loads on the pvm path (plain process memory) against the shm path (memfd), same run.

    python -m kvdepot.bench.pvm_bench                 # own daemon, ~20 s
    python -m kvdepot.bench.pvm_bench --json --blocks 8 --reps 3

One engine (this process) keeps two copies of the same KV geometry: one in a
memfd (`SharedKVBuffer`, the shm path) and one in ordinary anonymous memory (what
`torch.zeros` gives a real CPU engine, the pvm path), both registered in one
namespace. The blocks are stored once, then loaded alternately into each copy
(`--reps` times each); the figure is the median load time per path and the
ratio pvm/shm of their speeds (target >= 0.8). The in-process limit is one
memmove of the same bytes in this process. Default geometry: what vLLM's CPU
backend picked for OPT-125m (block size 128, 12 layers, 9 MiB per block), and
16 blocks per load (151 MB).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvdepot.bench.daemon import OwnDaemon
from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.client.pvm import register_process_kv
from kvdepot.common.jobs import Job
from kvdepot.v1 import depot_pb2 as pb

TARGET_RATIO = 0.8


def _anonymous(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous memory, pre-faulted (like a touched torch.zeros tensor)."""
    m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 0x5A
    return m, arr


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


class Bench:
    def __init__(self, target: str, layers: int, page: int, num_blocks: int) -> None:
        self.layers, self.page, self.num_blocks = layers, page, num_blocks
        self.size = layers * num_blocks * page
        self.client = DepotClient(target, client_name="pvm-bench").start()
        if not self.client.wait_connected(20):
            raise RuntimeError("no daemon")
        self.layout = pb.NamespaceLayout(
            id="pvm-bench",
            world_size=1,
            blocks_per_chunk=1,
            groups=[pb.GroupLayout(layer_page_bytes=[page] * layers)],
        )
        tensors = [
            pb.KVTensor(
                region_index=0,
                region_offset=i * num_blocks * page,
                num_blocks=num_blocks,
                block_stride_bytes=page,
                page_bytes=page,
            )
            for i in range(layers)
        ]
        groups = [
            pb.GroupRefs(
                layers=[pb.LayerRef(tensor_index=i, page_bytes=page) for i in range(layers)]
            )
        ]
        self.shm = SharedKVBuffer.allocate(self.size, name="kvdepot-bench-kv")
        self.shm_arr = np.frombuffer(self.shm.memoryview(), dtype=np.uint8)
        self.shm_arr[:] = 0x5A  # pre-fault: first touches are not what we measure
        self._plain_map, self.plain = _anonymous(self.size)
        self.reg_shm = self.client.register_kv(self.layout, 0, self.shm, tensors, groups)
        self.reg_pvm, self.access = register_process_kv(
            self.client, self.layout, 0, [(_address(self.plain), self.size)], tensors, groups
        )
        assert self.reg_pvm.memory_path == "pvm", self.reg_pvm.memory_path
        self.stream = self.client.transfer_stream()
        self._next = 1

    def job(self, registration: int, direction: int, keys: list[bytes]) -> tuple[float, float]:
        """(wall seconds, daemon copy seconds) of one job over blocks 0..len(keys)-1."""
        job_id, self._next = self._next, self._next + 1
        t = time.perf_counter()
        self.stream.submit(
            Job(
                job_id=job_id,
                direction=direction,
                registration_id=registration,
                keys=keys,
                block_ids=list(range(len(keys))),
                group_sizes=[len(keys)],
                block_indices=[0],
            )
        )
        if not self.stream.wait({job_id}, timeout=120):
            raise TimeoutError(f"job {job_id} got no answer")
        wall = time.perf_counter() - t
        (res,) = [r for r in self.stream.poll() if r.job_id == job_id]
        if not res.success:
            raise RuntimeError(f"job {job_id} failed: {res.error}")
        return wall, res.copy_seconds

    def pages(self, arr: np.ndarray, blocks: int) -> bytes:
        n, p = self.num_blocks, self.page
        return b"".join(
            arr[layer * n * p : layer * n * p + blocks * p].tobytes()
            for layer in range(self.layers)
        )

    def close(self) -> None:
        self.stream.close()
        self.client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    daemon = OwnDaemon(args.pool_size, extra=["--pvm"])  # pvm is off unless asked for
    try:
        daemon.wait_warm()
        b = Bench(daemon.target, args.layers, args.page_kib << 10, args.blocks + 2)
        try:
            keys = [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(args.blocks)]
            rng = np.random.default_rng(1)
            b.shm_arr[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
            b.job(b.reg_shm.registration_id, pb.STORE, keys)
            stored = b.pages(b.shm_arr, args.blocks)
            nbytes = len(stored)
            times: dict[str, list[tuple[float, float]]] = {"shm": [], "pvm": []}
            for rep in range(args.reps + 1):  # the first round warms up, not counted
                for path, reg in (("shm", b.reg_shm), ("pvm", b.reg_pvm)):
                    target = b.shm_arr if path == "shm" else b.plain
                    target[:] = 0xA5  # so a load that did nothing cannot pass
                    t = b.job(reg.registration_id, pb.LOAD, keys)
                    if b.pages(target, args.blocks) != stored:
                        raise RuntimeError(f"the {path} load brought back different bytes")
                    if rep:
                        times[path].append(t)
            src = np.frombuffer(bytes(nbytes), dtype=np.uint8).copy()
            dst = np.empty_like(src)
            dst[:] = 1
            limit = []
            for _ in range(args.reps):
                t = time.perf_counter()
                ctypes.memmove(_address(dst), _address(src), nbytes)
                limit.append(time.perf_counter() - t)
            fresh = [(i + 10**6).to_bytes(32, "big") + b"\0\0\0\0" for i in range(args.blocks)]
            store_pvm = b.job(b.reg_pvm.registration_id, pb.STORE, fresh)
        finally:
            b.close()
    finally:
        daemon.stop()
    med = {p: statistics.median(w for w, _ in ts) for p, ts in times.items()}
    copy = {p: statistics.median(c for _, c in ts) for p, ts in times.items()}
    gbps = {p: nbytes / s / 1e9 for p, s in med.items()}
    return {
        "bytes_per_load": nbytes,
        "blocks": args.blocks,
        "layers": args.layers,
        "page_bytes": args.page_kib << 10,
        "reps": args.reps,
        "load_seconds": med,
        "copy_seconds": copy,
        "load_gb_per_s": gbps,
        "ratio_pvm_to_shm": gbps["pvm"] / gbps["shm"],
        "ratio_pvm_to_shm_copy_only": copy["shm"] / copy["pvm"],
        "memmove_gb_per_s": nbytes / statistics.median(limit) / 1e9,
        "pvm_store_gb_per_s": nbytes / store_pvm[0] / 1e9,
        "target_ratio": TARGET_RATIO,
        "access": b.access or "no Yama restriction",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--page-kib", type=int, default=768, help="one layer's page per block")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per load job")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--pool-size", default="512MiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        g = out["load_gb_per_s"]
        print(
            f"load of {out['bytes_per_load'] / 1e6:.0f} MB ({out['blocks']} blocks), median of "
            f"{out['reps']}: shm {g['shm']:.2f} GB/s, pvm {g['pvm']:.2f} GB/s, "
            f"pvm/shm {out['ratio_pvm_to_shm']:.2f} (target >= {TARGET_RATIO}); "
            f"copy only {out['ratio_pvm_to_shm_copy_only']:.2f}; in-process memmove "
            f"{out['memmove_gb_per_s']:.2f} GB/s; pvm store {out['pvm_store_gb_per_s']:.2f} GB/s"
        )
    return 0 if out["ratio_pvm_to_shm"] >= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
