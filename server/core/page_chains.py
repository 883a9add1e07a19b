"""`PageChains`: a job over vLLM's layout as chains of pages, planned per block.

Built by the planner (kvdepot.server.core.planner) for a one-group job whose layers lie
one pitch apart on both sides; read by the copy engines (the CUDA engine's 2-D copies,
the CPU engine's `copy_chains`) and by their bounds check. Plain data with the few
operations on it that need no plan: bounds, pieces for copy threads, and the runs;
and `equal_cuts`, how plans and chains are cut into pieces of about equal bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)  # not frozen: built for every job, and frozen's __init__ costs
class PageChains:
    """A job's pages as chains of equal rows, one row per layer: chain i is `rows`
    runs of `widths[i]` bytes, row r at region offset `region_starts[i] + r *
    region_pitch` of region `region` and at pool offset `pool_starts[i] + r *
    pool_pitch`. vLLM's layout is this (its layers one pitch apart in one allocation,
    a block's pages one after another in its pool row): a chain is a block, or blocks
    that follow one another on both sides (a chunk's sub-blocks in consecutive GPU
    blocks), and what one 2-D DMA copy moves. Planned per block, not per page.

    The columns are int64; `*_low` and `*_end` bound every chain's bytes (the lowest
    start, one past the highest byte), `widest` is the widest run, and `nbytes` all the
    bytes, computed with them. Read only once built.
    """

    region: int
    region_starts: np.ndarray
    pool_starts: np.ndarray
    widths: np.ndarray
    rows: int
    region_pitch: int
    pool_pitch: int
    region_low: int
    region_end: int
    pool_low: int
    pool_end: int
    widest: int
    nbytes: int

    def __len__(self) -> int:
        return len(self.region_starts)

    def split(self, parts: int) -> list[PageChains]:
        """Consecutive chains in at most `parts` pieces of about equal bytes, none empty
        (copy threads share a large job's chains: CopyPlan.split)."""
        bounds = [0, *equal_cuts(self.widths, parts), len(self)]
        return [self._piece(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]

    def _piece(self, lo: int, hi: int) -> PageChains:
        """Chains lo..hi-1, their bounds computed anew."""
        region_starts, pool_starts = self.region_starts[lo:hi], self.pool_starts[lo:hi]
        widths = self.widths[lo:hi]
        last = self.rows - 1
        return PageChains(
            self.region,
            region_starts,
            pool_starts,
            widths,
            self.rows,
            self.region_pitch,
            self.pool_pitch,
            int(region_starts.min()),
            int((region_starts + widths).max()) + last * self.region_pitch,
            int(pool_starts.min()),
            int((pool_starts + widths).max()) + last * self.pool_pitch,
            int(widths.max()),
            int(widths.sum()) * self.rows,
        )

    def run_columns(self) -> np.ndarray:
        """The chains' runs as (4, n) int64 columns (region, region offset, pool offset,
        bytes), one per chain and row, layer-major: what an engine that copies runs
        needs of a piece of chains (a whole plan's runs are its pages)."""
        row = np.arange(self.rows, dtype=np.int64)[:, None]
        region_offs = (self.region_starts + row * self.region_pitch).ravel()
        pool_offs = (self.pool_starts + row * self.pool_pitch).ravel()
        sizes = np.broadcast_to(self.widths, (self.rows, len(self))).ravel()
        regions = np.full_like(region_offs, self.region)
        return np.stack((regions, region_offs, pool_offs, sizes))

    def inside(self, region_sizes: Sequence[int], pool_size: int | None) -> bool:
        """Every run inside its region (of `region_sizes`) and, with `pool_size`, the
        pool: the copy engines' defence in depth (copy_engine.check_runs), per chain."""
        return (
            0 <= self.region < len(region_sizes)
            and min(self.region_low, self.pool_low) >= 0
            and self.region_end <= region_sizes[self.region]
            and (pool_size is None or self.pool_end <= pool_size)
        )


def equal_cuts(sizes: np.ndarray, parts: int) -> list[int]:
    """Where to cut items of `sizes` bytes, in order and never inside one, into at most
    `parts` consecutive pieces of about equal bytes: the distinct cut indices, ascending
    (a piece between two equal cuts, or past the last item, would be empty)."""
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    cuts = np.searchsorted(ends, [total * i // parts for i in range(1, parts)], "right")
    return np.unique(cuts).tolist()
