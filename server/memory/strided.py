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
    orders: list[np.ndarray | None] = [None, np.argsort(pool, kind="stable")]
    best, fewest = None, len(n) // MIN_AVERAGE_RUNS + 1
    for order in orders:
        d, s_, k = (dst, src, n) if order is None else (dst[order], src[order], n[order])
        count = _progression_count(d, s_, k)
        if count < fewest:
            best, fewest = (d, s_, k), count
    if best is None:
        return list(zip(dst.tolist(), src.tolist(), n.tolist(), strict=True))
    return strided_ops(find_progressions(*best))


def _links(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(link, cont) per adjacent pair i, i + 1: whether run i + 1 may follow run i in
    a progression, and whether that pair keeps the steps of the pair before it."""
    dd, ds = np.diff(dst), np.diff(src)
    link = (n[1:] == n[:-1]) & (np.abs(dd) >= n[:-1]) & (ds != 0)
    cont = np.zeros(len(link), dtype=bool)
    cont[1:] = link[1:] & link[:-1] & (dd[1:] == dd[:-1]) & (ds[1:] == ds[:-1])
    return link, cont


def _progression_count(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> int:
    """About how many progressions `find_progressions` makes of these runs: a step
    change between two progressions breaks two pairs (the one across and the first
    one after), so half the breaks, rounded up."""
    if len(n) < 2:
        return len(n)
    _, cont = _links(dst, src, n)
    return (int(np.count_nonzero(~cont)) + 1) // 2  # cont[0] is False: the first pair


def find_progressions(dst: np.ndarray, src: np.ndarray, n: np.ndarray) -> list[Progression]:
    """The runs (absolute addresses and sizes, in copy order) cut greedily into
    maximal progressions, in order; a run that starts none is a progression of 1.

    Within a progression the destination rows never overlap (|dst_step| >= nbytes)
    and the source step is not 0, so copying it row by row in any order writes what
    copying the runs one by one does.
    """
    runs = len(n)
    if runs == 0:
        return []
    if runs == 1:
        return [(int(dst[0]), int(src[0]), 1, 0, 0, int(n[0]))]
    # Link i joins run i to run i + 1; it continues the progression of the link
    # before it when both are links with the same steps.
    link, cont = _links(dst, src, n)
    stops = np.flatnonzero(~cont)  # links that do not continue: where a progression may start
    d, s, nn = dst.tolist(), src.tolist(), n.tolist()
    out: list[Progression] = []
    p = 0
    while p < runs:
        if p == runs - 1 or not link[p]:
            out.append((d[p], s[p], 1, 0, 0, nn[p]))
            p += 1
            continue
        # The links p+1, p+2, ... continue it up to the next stop after p.
        k = int(np.searchsorted(stops, p, side="right"))
        last_link = (int(stops[k]) if k < len(stops) else runs - 1) - 1
        count = last_link - p + 2
        out.append((d[p], s[p], count, d[p + 1] - d[p], s[p + 1] - s[p], nn[p]))
        p += count
    return out


def _view(start: int, count: int, step: int, nbytes: int) -> np.ndarray:
    """`count` rows of `nbytes` at `start + k * step` (step may be negative)."""
    span = (count - 1) * abs(step) + nbytes
    low = start if step > 0 else start + (count - 1) * step
    buf = (ctypes.c_char * span).from_address(low)
    return np.ndarray(
        shape=(count, nbytes),
        dtype=np.uint8,
        buffer=buf,
        offset=start - low,
        strides=(step, 1),
    )


def strided_ops(progressions: list[Progression]) -> list[CopyOp]:
    """What a copy thread runs for `progressions` (see CopyOp)."""
    ops: list[CopyOp] = []
    for d, s, count, d_step, s_step, nbytes in progressions:
        if count == 1:
            ops.append((d, s, nbytes))
        else:
            ops.append((_view(d, count, d_step, nbytes), _view(s, count, s_step, nbytes)))
    return ops


def run_ops(ops: list[CopyOp]) -> None:
    """Executes `ops` in order (on a copy thread): memmove or one copyto each, both
    without the GIL while bytes move."""
    memmove, copyto = ctypes.memmove, np.copyto
    for op in ops:
        if len(op) == 3:
            memmove(*op)
        else:
            copyto(op[0], op[1])
