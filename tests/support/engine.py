"""A synthetic engine for tests: KV tensors in one memory region, deterministic page
bytes, store and load jobs through the real client library.

The memory source is a parameter (`Engine(..., memory=...)`, `--memory`):
- "shm": a memfd (`SharedKVBuffer`), registered by passing its fd: the shm path.
- "pvm": one anonymous private mapping (what `torch.zeros` gets for a large tensor),
  registered with `kvdepot.client.pvm.register_process_kv`: the daemon copies with
  process_vm_readv/writev.

Usable in-process, or as a separate process that prints one JSON report:

    python tests/support/engine.py store  --target T --ranks R ... [--loop]
    python tests/support/engine.py verify --target T --ranks 0,1 ...
    python tests/support/engine.py unmap  --target T --memory pvm ...

`store` stores the chunks, prints its report and waits for a line on stdin (keeping
its session, and the blocks' writer); with `--loop` it keeps storing fresh chunks
until killed. `verify` loads them into its own memory and counts pages that differ.
`unmap` (pvm only) unmaps half of its memory after registering and reports what the
daemon answered for stores and loads there.

Page bytes derive from (namespace, key, rank, layer, sub-block), so a loader can
check every byte without talking to the writer.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.bench.geometry import registration_pb, tensor_offsets
from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.client.pvm import register_process_kv
from kvdepot.common.chunks import block_positions
from kvdepot.common.jobs import Job, JobResult
from kvdepot.common.libc import libc
from kvdepot.common.namespace_digest import canonical, digest_id
from kvdepot.v1 import depot_pb2 as pb


@dataclass
class Geometry:
    """Per group: page bytes of each layer. Every layer is its own tensor."""

    groups: list[list[int]] = field(default_factory=lambda: [[4096, 4096], [1024, 1024, 1024]])
    blocks_per_chunk: int = 2
    world_size: int = 2
    num_blocks: int = 512
    namespace: str = "test-ns"
    # The digest's inputs, for a namespace id of the connector's form (`digested`).
    digest_inputs: str = ""

    def layout(self) -> pb.NamespaceLayout:
        return pb.NamespaceLayout(
            id=self.namespace,
            world_size=self.world_size,
            blocks_per_chunk=self.blocks_per_chunk,
            groups=[pb.GroupLayout(layer_page_bytes=g) for g in self.groups],
            digest_inputs=self.digest_inputs,
        )

    def digested(self, model: str) -> Self:
        """This geometry in a namespace whose id is, as the connector's are, the digest
        of inputs that describe the layout (`model` stands for the rest of them)."""
        fields = {
            "model": model,
            "blocks_per_chunk": self.blocks_per_chunk,
            "world_size": self.world_size,
            "groups": [
                {"group_id": i, "num_layers": len(pages), "layer_page_bytes": pages}
                for i, pages in enumerate(self.groups)
            ],
            "worker_bytes_per_block": self.groups[0][0],  # a tensor per layer
        }
        return replace(self, namespace=digest_id(fields), digest_inputs=canonical(fields))

    @property
    def layer_pages(self) -> list[int]:
        return [p for g in self.groups for p in g]


def make_key(chunk: int, group: int, salt: bytes = b"") -> bytes:
    """A vLLM-style OffloadKey: 32 hash bytes + 4-byte big-endian group index."""
    return hashlib.sha256(salt + chunk.to_bytes(8, "big")).digest() + group.to_bytes(4, "big")


def page_bytes(namespace: str, key: bytes, rank: int, layer: int, sub: int, size: int) -> bytes:
    seed = hashlib.blake2b(
        namespace.encode() + key + bytes([rank, layer & 0xFF, layer >> 8, sub & 0xFF]),
        digest_size=8,
    ).digest()
    return np.random.default_rng(int.from_bytes(seed, "big")).bytes(size)


MEMORY_SOURCES = ("shm", "pvm")
# mmap(2) values Python's mmap module does not export (Linux).
PROT_NONE = 0
MAP_FIXED = 0x10


def _private_mapping(size: int) -> int:
    """The address of a fresh anonymous private mapping (no fd: only pvm can reach it)."""
    addr = libc.mmap(
        None,
        size,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        -1,
        0,
    )
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return addr


class Engine:
    """One rank's KV memory (from `memory`: "shm" or "pvm"), registered with the daemon."""

    def __init__(self, client: DepotClient, geo: Geometry, rank: int, memory: str = "shm") -> None:
        if memory not in MEMORY_SOURCES:
            raise ValueError(f"memory {memory!r}: one of {MEMORY_SOURCES}")
        self.client = client
        self.geo = geo
        self.rank = rank
        self.memory = memory
        pages = geo.layer_pages
        self.size = geo.num_blocks * sum(pages)
        if memory == "shm":
            self.buffer = SharedKVBuffer.allocate(self.size)
            self.mem = np.frombuffer(self.buffer.memoryview(), dtype=np.uint8)
        else:
            self.address = _private_mapping(self.size)
            self.mem = np.ctypeslib.as_array(
                (ctypes.c_uint8 * self.size).from_address(self.address)
            )
        self.tensor_offsets = tensor_offsets(geo, geo.num_blocks)
        tensors, refs = registration_pb(geo, geo.num_blocks)
        if memory == "shm":
            self.registration = client.register_kv(geo.layout(), rank, self.buffer, tensors, refs)
        else:
            self.registration, self.access = register_process_kv(
                client, geo.layout(), rank, [(self.address, self.size)], tensors, refs
            )
        self.stream = client.transfer_stream()
        self._next_job = 1

    def unmap_tail(self) -> int:
        """pvm only: takes the second half of the memory away (no access); returns its
        first offset. The pages there must not be touched from Python afterwards.

        Replaced in place by an inaccessible mapping rather than unmapped: a hole left
        in the address space is soon filled by this process's own allocations (a 1 MiB
        malloc arena was seen there), and the daemon's copies would then land in them."""
        assert self.memory == "pvm", "only a private mapping can be unmapped under the daemon"
        half = (self.size // 2) & ~(mmap.PAGESIZE - 1)
        address = self.address + half
        placed = libc.mmap(
            address,
            self.size - half,
            PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED,
            -1,
            0,
        )
        assert placed == address, f"mmap(MAP_FIXED) failed: errno {ctypes.get_errno()}"
        return half

    def _layers(self, group: int) -> list[tuple[int, int]]:
        """(global layer index, page bytes) of a group's layers."""
        first = sum(len(g) for g in self.geo.groups[:group])
        return [(first + i, p) for i, p in enumerate(self.geo.groups[group])]

    def page(self, layer: int, block_id: int) -> np.ndarray:
        p = self.geo.layer_pages[layer]
        o = self.tensor_offsets[layer] + block_id * p
        return self.mem[o : o + p]

    def fill(self, group: int, keys: list[bytes], block_ids: list[int], first_index: int) -> None:
        """Writes the expected bytes of `keys` into `block_ids` (a store's source)."""
        positions = block_positions(len(block_ids), first_index, self.geo.blocks_per_chunk)
        for (c, j), block_id in zip(positions, block_ids, strict=True):
            for layer, p in self._layers(group):
                self.page(layer, block_id)[:] = np.frombuffer(
                    page_bytes(self.geo.namespace, keys[c], self.rank, layer, j, p), np.uint8
                )

    def mismatches(
        self,
        group: int,
        keys: list[bytes],
        block_ids: list[int],
        first_index: int,
        rank: int | None = None,
    ) -> int:
        """Pages whose bytes differ from what `rank` stored for `keys`."""
        positions = block_positions(len(block_ids), first_index, self.geo.blocks_per_chunk)
        bad = 0
        for (c, j), block_id in zip(positions, block_ids, strict=True):
            for layer, p in self._layers(group):
                want = page_bytes(
                    self.geo.namespace, keys[c], self.rank if rank is None else rank, layer, j, p
                )
                bad += self.page(layer, block_id).tobytes() != want
        return bad

    def submit(
        self,
        direction: int,
        keys: list[bytes],
        group_blocks: list[list[int]],
        block_indices: list[int],
        expedited: bool = False,
    ) -> int:
        """Submits one job on the stream without waiting; returns its job id."""
        job_id = self._next_job
        self._next_job += 1
        self.stream.submit(
            Job(
                job_id=job_id,
                direction=direction,
                registration_id=self.registration.registration_id,
                keys=keys,
                block_ids=[b for blocks in group_blocks for b in blocks],
                group_sizes=[len(b) for b in group_blocks],
                block_indices=block_indices,
                expedited=expedited,
            )
        )
        return job_id

    def result(self, job_id: int, timeout: float) -> JobResult | None:
        """Waits for `job_id`'s result (results of other jobs are dropped); None on timeout."""
        if not self.stream.wait({job_id}, timeout=timeout):
            return None
        (result,) = [r for r in self.stream.poll() if r.job_id == job_id]
        return result

    def job(
        self,
        direction: int,
        keys: list[bytes],
        group_blocks: list[list[int]],
        block_indices: list[int],
        expedited: bool = False,
    ) -> JobResult:
        """Submits one job and waits for its result."""
        job_id = self.submit(direction, keys, group_blocks, block_indices, expedited)
        result = self.result(job_id, timeout=60)
        assert result is not None, f"job {job_id} timed out"
        return result


def chunk_plan(geo: Geometry, chunks: range, salt: bytes = b"", base_block: int = 0):
    """Keys and block ids for `chunks` of every group (whole chunks, aligned)."""
    bpc = geo.blocks_per_chunk
    keys, group_blocks, indices = [], [], []
    for g in range(len(geo.groups)):
        keys += [make_key(c, g, salt) for c in chunks]
        start = base_block + g * len(chunks) * bpc
        group_blocks.append(list(range(start, start + len(chunks) * bpc)))
        indices.append(chunks.start * bpc)
    return keys, group_blocks, indices


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["store", "verify", "unmap"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--memory", choices=MEMORY_SOURCES, default="shm")
    parser.add_argument("--ranks", default="0")
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--per-job", type=int, default=10)
    parser.add_argument("--base-block", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--namespace", default="test-ns")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument(
        "--loop", action="store_true", help="store: store fresh chunks until killed"
    )
    args = parser.parse_args()
    if args.action == "unmap" and args.memory != "pvm":
        parser.error("unmap needs --memory pvm")
    geo = Geometry(world_size=args.world_size, namespace=args.namespace, num_blocks=args.num_blocks)
    client = DepotClient(args.target, client_name=f"{args.memory}-engine {args.action}").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    engines = [Engine(client, geo, int(r), args.memory) for r in args.ranks.split(",")]
    report: dict[str, Any] = {
        "memory_path": engines[0].registration.memory_path,
        "jobs": 0,
        "failed": 0,
        "mismatched_pages": 0,
        "stored": 0,
        "errors": [],
    }

    def run(eng: Engine, direction: int, chunks: range, salt: bytes = b"") -> JobResult:
        keys, group_blocks, indices = chunk_plan(geo, chunks, salt, args.base_block)
        n = len(chunks)
        if direction == pb.STORE:
            for g, blocks in enumerate(group_blocks):
                eng.fill(g, keys[g * n : (g + 1) * n], blocks, indices[g])
        res = eng.job(direction, keys, group_blocks, indices)
        report["jobs"] += 1
        report["stored"] += res.stored_keys
        if not res.success:
            report["failed"] += 1
            report["errors"].append(res.error)
        if direction == pb.LOAD:  # a failed load counts its pages too: nothing came back
            for g, blocks in enumerate(group_blocks):
                report["mismatched_pages"] += eng.mismatches(
                    g, keys[g * n : (g + 1) * n], blocks, indices[g]
                )
        return res

    if args.action == "unmap":
        _unmap(engines[0], run, report)
        print(json.dumps(report), flush=True)
        client.close()
        return
    direction = pb.STORE if args.action == "store" else pb.LOAD
    for eng in engines:
        for start in range(0, args.chunks, args.per_job):
            run(eng, direction, range(start, min(start + args.per_job, args.chunks)))
    print(json.dumps(report), flush=True)
    if args.action == "store" and args.loop:
        salt = 0
        while True:  # until killed: store fresh chunks over and over
            salt += 1
            for eng in engines:
                run(eng, pb.STORE, range(0, args.per_job), salt.to_bytes(4, "big"))
    if args.action == "store":
        sys.stdin.readline()  # stay alive (and keep the session) until told to go
    client.close()


def _unmap(eng: Engine, run: Callable[..., JobResult], report: dict[str, Any]) -> None:
    """Store two chunks, then unmap the second half of the memory: every job touches
    group 1's layers, which now lie (partly) in the hole."""
    geo, client = eng.geo, eng.client
    report["store_before"] = run(eng, pb.STORE, range(0, 2), b"a").success
    eng.unmap_tail()
    keys, group_blocks, indices = chunk_plan(geo, range(2, 4), salt=b"u")
    res = eng.job(pb.STORE, keys, group_blocks, indices)  # no fill: it would fault here
    report["store_after"], report["store_error"] = res.success, res.error
    report["keys_ready_after_failed_store"] = sum(client.lookup(geo.namespace, keys))
    keys, group_blocks, indices = chunk_plan(geo, range(0, 2), salt=b"a")
    res = eng.job(pb.LOAD, keys, group_blocks, indices)
    report["load_after"], report["load_error"] = res.success, res.error


if __name__ == "__main__":
    _main()
