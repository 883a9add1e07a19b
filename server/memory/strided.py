"""Runs grouped into strided copies: many pages per call, the GIL released once.

A vLLM job's plan is hundreds of 64 KiB runs. Copied with one ctypes memmove each,
a copy thread takes the GIL back after every run, and while the event loop and the
other copy threads want it too, the hand-offs cost about as much as the copying.
The runs often come in arithmetic progressions: runs of one size whose addresses
step by a constant on both sides. One key's pages, layer after layer, fill its slot
page after page, and come from layer tensors a constant apart when the engine laid
them out side by side (as a memfd KV buffer does); one layer's pages of consecutive
blocks go into slots side by side. `copy_ops` tries the plan's order (layer-major)
and the pool's order (key-major), keeps the one with fewer progressions, and turns
each progression into a pair of numpy views that one `np.copyto` copies with the GIL
released for the whole progression. A plan without long progressions stays one
memmove per run. Runs never overlap on the destination, so any order copies the
same bytes.
"""

from __future__ import annotations

import ctypes

import numpy as np

# (dst, src, count, dst_step, src_step, nbytes): `count` runs of `nbytes`, the k-th
# from src + k * src_step to dst + k * dst_step.
Progression = tuple[int, int, int, int, int, int]
# What a copy thread executes: (dst address, src address, nbytes) for a lone run,
# (dst view, src view) for a progression.
CopyOp = tuple[int, int, int] | tuple[np.ndarray, np.ndarray]


# Below this many runs per progression on average, grouping is not worth its views.
MIN_AVERAGE_RUNS = 4


def copy_ops(dst: np.ndarray, src: np.ndarray, n: np.ndarray, pool: np.ndarray) -> list[CopyOp]:
    """What a copy thread runs for runs of `n` bytes from `src` to `dst` (absolute
    addresses, int64 columns); `pool` is each run's pool address (the other order
    tried). Destination runs must not overlap one another."""
    best = None
    fewest = len(n) // MIN_AVERAGE_RUNS + 1
    if len(n) >= 2:
        for order in (None, np.argsort(pool, kind="stable")):
            cols = (dst, src, n) if order is None else (dst[order], src[order], n[order])
            links = _links(*cols)
            # A step change between two progressions breaks two pairs (the one across
            # and the first one after): about half the breaks start a progression.
            count = (int(np.count_nonzero(~links[1])) + 1) // 2
            if count < fewest:
                best, fewest = (cols, links), count
    if best is None:
        return list(zip(dst.tolist(), src.tolist(), n.tolist(), strict=True))
    cols, links = best
    return strided_ops(_greedy(*cols, *links))


def _links(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(link, cont) per adjacent pair i, i + 1: whether run i + 1 may follow run i in
    a progression, and whether that pair keeps the steps of the pair before it."""
    dd, ds = np.diff(dst), np.diff(src)
    link = (n[1:] == n[:-1]) & (np.abs(dd) >= n[:-1]) & (ds != 0)
    cont = np.zeros(len(link), dtype=bool)
    cont[1:] = link[1:] & link[:-1] & (dd[1:] == dd[:-1]) & (ds[1:] == ds[:-1])
    return link, cont


def find_progressions(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> list[Progression]:
    """The runs (absolute addresses and sizes, in copy order) cut greedily into
    maximal progressions, in order; a run in none is a progression of 1.

    Within a progression the destination rows never overlap (|dst_step| >= nbytes)
    and the source step is not 0, so copying it row by row in any order writes what
    copying the runs one by one does.
    """
    if len(n) < 2:
        return [(int(d), int(s), 1, 0, 0, int(k)) for d, s, k in zip(dst, src, n, strict=True)]
    return _greedy(dst, src, n, *_links(dst, src, n))


def _greedy(
    dst: np.ndarray, src: np.ndarray, n: np.ndarray, link: np.ndarray, cont: np.ndarray
) -> list[Progression]:
    """find_progressions' cut, one Python step per block of equal-step links (not
    per run): block b is links j..k, runs j..k+1; a run the block before took is
    left to it, so the block then starts one run later."""
    runs = len(n)
    starts = np.flatnonzero(link & ~cont)  # first link of each block
    stops = np.flatnonzero(~cont)
    # Each block's last link: the one before the next link that does not continue.
    nxt = np.searchsorted(stops, starts, side="right")
    ends = np.where(nxt < len(stops), stops[np.minimum(nxt, len(stops) - 1)], runs - 1) - 1
    d, s, k = dst.tolist(), src.tolist(), n.tolist()
    out: list[Progression] = []
    free = 0  # the first run no progression has taken yet
    for j, last in zip(starts.tolist(), ends.tolist(), strict=True):
        first = max(j, free)
        if first > last:  # the block's runs but its last were taken: leave that one
            continue
        out.extend((d[r], s[r], 1, 0, 0, k[r]) for r in range(free, first))
        count = last - first + 2
        out.append(
            (d[first], s[first], count, d[first + 1] - d[first], s[first + 1] - s[first], k[first])
        )
        free = first + count
    out.extend((d[r], s[r], 1, 0, 0, k[r]) for r in range(free, runs))
    return out


def strided_ops(progressions: list[Progression]) -> list[CopyOp]:
    """What a copy thread runs for `progressions` (see CopyOp): a lone run as it is,
    a progression as two views into one byte array per side, spanning every run."""
    rows = [p for p in progressions if p[2] > 1]
    if rows:
        dst_side = _span([(p[0], p[2], p[3], p[5]) for p in rows])
        src_side = _span([(p[1], p[2], p[4], p[5]) for p in rows])
    ops: list[CopyOp] = []
    for d, s, count, d_step, s_step, nbytes in progressions:
        if count == 1:
            ops.append((d, s, nbytes))
        else:
            ops.append(
                (
                    _view(dst_side, d, count, d_step, nbytes),
                    _view(src_side, s, count, s_step, nbytes),
                )
            )
    return ops


def _span(rows: list[tuple[int, int, int, int]]) -> tuple[int, np.ndarray]:
    """(low address, uint8 array from it) covering every (start, count, step, nbytes) row set."""
    low = min(start + min(0, (count - 1) * step) for start, count, step, _ in rows)
    high = max(start + max(0, (count - 1) * step) + nbytes for start, count, step, nbytes in rows)
    window = (ctypes.c_char * (high - low)).from_address(low)
    # A ctypes array is a buffer; numpy's stubs do not say so.
    return low, np.frombuffer(window, dtype=np.uint8)  # type: ignore[call-overload]


def _view(
    side: tuple[int, np.ndarray], start: int, count: int, step: int, nbytes: int
) -> np.ndarray:
    """`count` rows of `nbytes` at `start + k * step` (step may be negative)."""
    low, array = side
    return np.ndarray(
        shape=(count, nbytes), dtype=np.uint8, buffer=array, offset=start - low, strides=(step, 1)
    )


def run_ops(ops: list[CopyOp]) -> None:
    """Executes `ops` in order (on a copy thread): memmove or one copyto each, both
    without the GIL while bytes move."""
    memmove, copyto = ctypes.memmove, np.copyto
    for op in ops:
        if len(op) == 3:
            memmove(*op)
        else:
            copyto(op[0], op[1])
