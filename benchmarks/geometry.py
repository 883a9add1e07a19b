"""What the bench moves: a model's KV geometry, and the jobs made from it.

One place decides page sizes, the memfd layout of a rank's KV tensors, keys and
block-id patterns, so that the daemon run and the in-process run of the same
job touch exactly the same bytes in the same order.

Default: Llama-3-8B-like, 32 layers x 8 KV heads x head 128, bf16, 16 tokens per
block. One layer's page holds K and V of one block: 2 x 8 x 128 x 2 x 16 = 64 KiB,
so one block of all layers is 2 MiB, and with one block per chunk a chunk is
2 MiB of 32 runs (one per layer; layers are separate tensors, so runs of one
chunk never merge).

MLA (`latent`): a layer's page holds one latent vector of `head_dim` values a token
(DeepSeek-V3: 512 + 64 = 576), not a K and a V per head, and every rank holds all of
it. With `replicated` the ranks register as the connector registers them when vLLM
says their bytes are replicated: a namespace of world 1, every rank as its rank 0, so
a row is one section, copied by the first rank to store it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from kvdepot.v1 import depot_pb2 as pb


class LayerPages(Protocol):
    """What registering a rank's KV tensors needs of a geometry (the bench's, a test's)."""

    @property
    def groups(self) -> Sequence[Sequence[int]]: ...

    @property
    def layer_pages(self) -> list[int]: ...


@dataclass(frozen=True)
class BenchGeometry:
    """A model's KV-cache shape, per engine (all ranks together)."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    block_size: int = 16  # tokens per block
    blocks_per_chunk: int = 1
    tp: int = 1
    # Two KV-cache groups: the first half of the layers full attention, the second
    # half a group with half the page size (as a sliding-window layer with half
    # the KV heads would have), i.e. two slot sizes side by side in the pool.
    hybrid: bool = False
    # MLA: one latent of `head_dim` values a token per layer, the same on every rank
    # (kv_heads 1); `replicated`: the ranks share one section a row (world 1, rank 0).
    latent: bool = False
    replicated: bool = False

    def __post_init__(self) -> None:
        for name in (
            "layers",
            "kv_heads",
            "head_dim",
            "dtype_bytes",
            "block_size",
            "blocks_per_chunk",
            "tp",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.latent and self.kv_heads != 1:
            raise ValueError("an MLA (latent) geometry has one latent a token: --kv-heads 1")
        if self.replicated and not self.latent:
            raise ValueError("only an MLA (latent) geometry's ranks hold the same bytes")
        if not self.latent and self.kv_heads % self.tp:
            raise ValueError(
                f"{self.kv_heads} KV heads do not split over TP={self.tp}: pick a TP that "
                f"divides --kv-heads"
            )
        if self.hybrid and (self.layers < 2 or self.page_bytes < 2):
            raise ValueError("--hybrid needs at least 2 layers and a page of 2 bytes")

    @property
    def page_bytes(self) -> int:
        """One layer's K and V (MLA: its latent) of one block on one rank."""
        if self.latent:
            return self.head_dim * self.dtype_bytes * self.block_size
        return 2 * (self.kv_heads // self.tp) * self.head_dim * self.dtype_bytes * self.block_size

    @property
    def registered_world(self) -> int:
        """The world the ranks register, as the connector does: TP, or 1 for replicated
        ranks. A row in the pool holds one section per rank of it."""
        return 1 if self.replicated else self.tp

    @property
    def groups(self) -> list[list[int]]:
        """Per KV-cache group: the page bytes of each of its layers (one rank)."""
        if not self.hybrid:
            return [[self.page_bytes] * self.layers]
        full = self.layers - self.layers // 2
        return [[self.page_bytes] * full, [self.page_bytes // 2] * (self.layers // 2)]

    @property
    def layer_pages(self) -> list[int]:
        return [p for g in self.groups for p in g]

    def chunk_bytes_per_rank(self) -> int:
        """Bytes one rank moves for one chunk of every group (one key per group)."""
        return self.blocks_per_chunk * sum(self.layer_pages)

    def job_bytes(self, chunks: int) -> int:
        """Bytes the ranks' jobs of `chunks` chunks name, all ranks together (a replicated
        row is copied in once: row_bytes)."""
        return chunks * self.chunk_bytes_per_rank() * self.tp

    def row_bytes(self, chunks: int) -> int:
        """Bytes `chunks` chunks hold in the pool: a section per rank, or one."""
        return chunks * self.chunk_bytes_per_rank() * self.registered_world

    def runs_per_job(self, chunks: int) -> int:
        """Page copies of a job on one rank (none merge: blocks are scattered)."""
        return chunks * self.blocks_per_chunk * self.layers

    def describe(self) -> str:
        kib = self.page_bytes / 1024
        groups = "1 group" if not self.hybrid else "2 groups (hybrid)"
        shape = (
            f"one latent of {self.head_dim} a token (MLA)"
            if self.latent
            else f"{self.kv_heads} KV heads x {self.head_dim}"
        )
        tp = f"TP={self.tp}"
        if self.latent:
            tp += ", one section a row" if self.replicated else ", a section per rank"
        return (
            f"{self.layers} layers x {shape}, "
            f"{self.dtype_bytes * 8}-bit, block {self.block_size}: {kib:g} KiB pages, "
            f"{self.row_bytes(1) / (1 << 20):g} MiB/chunk, {self.blocks_per_chunk} block(s)/chunk, "
            f"{tp}, {groups}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "page_bytes": self.page_bytes,
            "chunk_bytes": self.row_bytes(1),
            "groups": self.groups,
        }


def layout_pb(geo: BenchGeometry, namespace: str) -> pb.NamespaceLayout:
    return pb.NamespaceLayout(
        id=namespace,
        world_size=geo.registered_world,
        blocks_per_chunk=geo.blocks_per_chunk,
        groups=[pb.GroupLayout(layer_page_bytes=g) for g in geo.groups],
        description="kvdepot bench (synthetic)",
    )


def tensor_offsets(geo: LayerPages, num_blocks: int) -> list[int]:
    """Each layer is its own (num_blocks, page) tensor, back to back in one memfd."""
    offsets, off = [], 0
    for p in geo.layer_pages:
        offsets.append(off)
        off += num_blocks * p
    return offsets


def kv_bytes(geo: BenchGeometry, num_blocks: int) -> int:
    return num_blocks * sum(geo.layer_pages)


def registration_pb(
    geo: LayerPages, num_blocks: int
) -> tuple[list[pb.KVTensor], list[pb.GroupRefs]]:
    """The tensors and per-group layer refs a rank registers (as vLLM's views give them)."""
    tensors = [
        pb.KVTensor(
            region_index=0,
            region_offset=o,
            num_blocks=num_blocks,
            block_stride_bytes=p,
            page_bytes=p,
        )
        for o, p in zip(tensor_offsets(geo, num_blocks), geo.layer_pages, strict=True)
    ]
    refs, t = [], 0
    for g in geo.groups:
        refs.append(
            pb.GroupRefs(
                layers=[pb.LayerRef(tensor_index=t + i, page_bytes=p) for i, p in enumerate(g)]
            )
        )
        t += len(g)
    return tensors, refs


def make_keys(salt: bytes, engine: int, first_seq: int, count: int, group: int) -> list[bytes]:
    """vLLM-style OffloadKeys: a 32-byte hash + the 4-byte big-endian group index.

    Keys depend on (run salt, engine, sequence number) only, so the ranks of one
    engine name the same keys and every run of the bench gets fresh ones.
    """
    suffix = group.to_bytes(4, "big")
    prefix = engine.to_bytes(4, "big")
    return [
        hashlib.blake2b(prefix + seq.to_bytes(8, "big"), digest_size=32, key=salt).digest() + suffix
        for seq in range(first_seq, first_seq + count)
    ]


@dataclass(frozen=True)
class JobShape:
    """One job's keys and vLLM-style block ids (group-major)."""

    keys: list[bytes]
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]


def job_shape(
    geo: BenchGeometry,
    num_blocks: int,
    salt: bytes,
    engine: int,
    key_seq: int,
    chunks: int,
    pattern: int,
) -> JobShape:
    """Keys `key_seq .. key_seq+chunks` of every group, into scattered block ids.

    Block ids are a seeded random sample (different per `pattern`, the same for
    the daemon and the in-process run), as a running vLLM's free-block queue
    hands them out: consecutive ids are rare, so every page is its own run.
    """
    n = chunks * geo.blocks_per_chunk
    if n > num_blocks:
        raise ValueError(f"a job of {chunks} chunks needs {n} blocks; the engine has {num_blocks}")
    rng = random.Random(f"{engine}/{pattern}/{chunks}")
    keys: list[bytes] = []
    block_ids: list[int] = []
    for g in range(len(geo.groups)):
        keys += make_keys(salt, engine, key_seq, chunks, g)
        block_ids += rng.sample(range(num_blocks), n)
    return JobShape(keys, block_ids, [n] * len(geo.groups), [0] * len(geo.groups))
