"""A synthetic engine for tests: memfd-backed KV tensors, deterministic page bytes,
store and load jobs through the real client library.

Usable in-process, or as a separate process:

    python tests/support/engine.py store  --target T --rank R ... (prints JSON, then
                                          waits for a line on stdin before exiting)
    python tests/support/engine.py verify --target T --ranks 0,1 ...

Page bytes derive from (namespace, key, rank, layer, sub-block), so a loader can
check every byte without talking to the writer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdepot.client import DepotClient, SharedKVBuffer
from kvdepot.common.chunks import block_positions
from kvdepot.v1 import depot_pb2 as pb


@dataclass
class Geometry:
    """Per group: page bytes of each layer. Every layer is its own tensor."""

    groups: list[list[int]] = field(default_factory=lambda: [[4096, 4096], [1024, 1024, 1024]])
    blocks_per_chunk: int = 2
    world_size: int = 2
    num_blocks: int = 512
    namespace: str = "test-ns"

    def layout(self) -> pb.NamespaceLayout:
        return pb.NamespaceLayout(
            id=self.namespace,
            world_size=self.world_size,
            blocks_per_chunk=self.blocks_per_chunk,
            groups=[pb.GroupLayout(layer_page_bytes=g) for g in self.groups],
        )

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


class Engine:
    """One rank's KV memory in a memfd, registered with the daemon."""

    def __init__(self, client: DepotClient, geo: Geometry, rank: int) -> None:
        self.client = client
        self.geo = geo
        self.rank = rank
        pages = geo.layer_pages
        self.buffer = SharedKVBuffer.allocate(geo.num_blocks * sum(pages))
        self.mem = np.frombuffer(self.buffer.memoryview(), dtype=np.uint8)
        self.tensor_offsets: list[int] = []
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
        self.registration = client.register_kv(geo.layout(), rank, self.buffer, tensors, refs)
        self.stream = client.transfer_stream()
        self._next_job = 1

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

    def job(
        self,
        direction: int,
        keys: list[bytes],
        group_blocks: list[list[int]],
        block_indices: list[int],
        expedited: bool = False,
    ) -> pb.TransferResult:
        """Submits one job and waits for its result."""
        job_id = self._next_job
        self._next_job += 1
        self.stream.submit(
            pb.TransferJob(
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
        assert self.stream.wait({job_id}, timeout=60), f"job {job_id} timed out"
        (result,) = [r for r in self.stream.poll() if r.job_id == job_id]
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
    parser.add_argument("action", choices=["store", "verify"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--ranks", default="0")
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--per-job", type=int, default=10)
    parser.add_argument("--base-block", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--namespace", default="test-ns")
    args = parser.parse_args()
    geo = Geometry(world_size=args.world_size, namespace=args.namespace)
    client = DepotClient(args.target, client_name=f"test-engine {args.action}").start()
    if not client.wait_connected(10):
        raise SystemExit("no daemon")
    report: dict[str, object] = {"jobs": 0, "failed": 0, "mismatched_pages": 0, "stored": 0}
    for rank in (int(r) for r in args.ranks.split(",")):
        eng = Engine(client, geo, rank)
        for start in range(0, args.chunks, args.per_job):
            chunks = range(start, min(start + args.per_job, args.chunks))
            keys, group_blocks, indices = chunk_plan(geo, chunks, base_block=args.base_block)
            if args.action == "store":
                for g, blocks in enumerate(group_blocks):
                    n = len(chunks)
                    eng.fill(g, keys[g * n : (g + 1) * n], blocks, indices[g])
                res = eng.job(pb.STORE, keys, group_blocks, indices)
                report["stored"] = int(report["stored"]) + res.stored_keys  # type: ignore[arg-type]
            else:
                res = eng.job(pb.LOAD, keys, group_blocks, indices)
                for g, blocks in enumerate(group_blocks):
                    n = len(chunks)
                    report["mismatched_pages"] = (
                        int(report["mismatched_pages"])
                        + eng.mismatches(  # type: ignore[arg-type]
                            g, keys[g * n : (g + 1) * n], blocks, indices[g]
                        )
                    )
            report["jobs"] = int(report["jobs"]) + 1  # type: ignore[arg-type]
            report["failed"] = int(report["failed"]) + (not res.success)  # type: ignore[arg-type]
            if not res.success:
                report["error"] = res.error
    print(json.dumps(report), flush=True)
    if args.action == "store":
        sys.stdin.readline()  # stay alive (and keep the session) until told to go
    client.close()


if __name__ == "__main__":
    _main()
