"""The pvm engine's planning (server/pvm.py plan_batches): every byte of a plan in
exactly one system-call batch, shares of about equal bytes, kernel limits kept;
and the batches moving real bytes with process_vm_readv/writev on this process."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvdepot.server import pvm
from kvdepot.server.memory.copy_engine import LOAD, STORE


def _flatten(shares: list[list[pvm.Batch]]) -> list[tuple[int, int, int]]:
    out = []
    for share in shares:
        for local, remote, count, want in share:
            assert count == len(local) == len(remote) <= pvm.IOV_MAX
            assert want == int(local[:, 1].sum()) == int(remote[:, 1].sum()) <= pvm.MAX_CALL_BYTES
            out += [
                (int(a), int(b), int(n))
                for (a, n), (b, _) in zip(local.tolist(), remote.tolist(), strict=True)
            ]
    return out


def _bytes_of(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(local, remote) address of every byte, in order (small plans only)."""
    return [(a + k, b + k) for a, b, n in pieces for k in range(n)]


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_shares_cover_every_byte_once_in_order(parts: int) -> None:
    rng = np.random.default_rng(parts)
    n = rng.integers(0, 300, 50).astype(np.int64)
    local = np.cumsum(n + 7) + 10_000
    remote = (1 << 20) + rng.permutation(50).astype(np.int64) * 1000
    shares = pvm.plan_batches(local, remote, n, parts)
    assert 1 <= len(shares) <= parts
    want = [(a, b, k) for a, b, k in zip(local.tolist(), remote.tolist(), n.tolist(), strict=True)]
    assert _bytes_of(_flatten(shares)) == _bytes_of(want)
    sizes = [sum(w for *_, w in share) for share in shares]
    assert max(sizes) - min(sizes) <= 2 * 300  # within a run of each other


def test_one_large_run_spreads_over_every_share() -> None:
    n = np.array([10 << 20], dtype=np.int64)
    shares = pvm.plan_batches(np.array([0]), np.array([1 << 40]), n, 4)
    assert [sum(w for *_, w in s) for s in shares] == [(10 << 20) // 4] * 4
    assert _flatten(shares)[1] == ((10 << 20) // 4, (1 << 40) + (10 << 20) // 4, (10 << 20) // 4)


def test_batches_keep_the_kernel_limits() -> None:
    n = np.full(2500, 4096, dtype=np.int64)
    (share,) = pvm.plan_batches(np.arange(2500) * 4096, np.arange(2500) * 8192, n)
    assert [b[2] for b in share] == [1024, 1024, 452]
    big = np.array([3 << 30], dtype=np.int64)  # over MAX_CALL_BYTES: cut, one piece a call
    (share,) = pvm.plan_batches(np.array([0]), np.array([0]), big)
    assert [b[3] for b in share] == [1 << 30] * 3


def test_zero_byte_runs_and_empty_plans_make_no_calls() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert pvm.plan_batches(empty, empty, empty, 2) == []
    assert pvm.plan_batches(np.array([5]), np.array([9]), np.zeros(1, np.int64)) == []


@pytest.mark.parametrize("parts", [1, 3])
def test_batches_move_real_bytes_both_ways(parts: int) -> None:
    rng = np.random.default_rng(7)
    remote = rng.integers(0, 256, 1 << 16, dtype=np.uint8)  # "the engine's" memory
    pool = np.zeros(1 << 16, dtype=np.uint8)
    order = rng.permutation(16)
    n = np.full(16, 4096, dtype=np.int64)
    local_at = pool.ctypes.data + np.arange(16, dtype=np.int64) * 4096
    remote_at = remote.ctypes.data + order.astype(np.int64) * 4096
    for share in pvm.plan_batches(local_at, remote_at, n, parts):
        pvm.copy_batches(os.getpid(), STORE, share)
    assert np.array_equal(pool.reshape(16, 4096), remote.reshape(16, 4096)[order])
    back = np.zeros_like(remote)
    remote_at = back.ctypes.data + order.astype(np.int64) * 4096
    for share in pvm.plan_batches(local_at, remote_at, n, parts):
        pvm.copy_batches(os.getpid(), LOAD, share)
    assert np.array_equal(back, remote)


def test_a_short_copy_raises_process_gone() -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    (share,) = pvm.plan_batches(np.array([buf.ctypes.data]), np.array([4096]), np.array([4096]))
    with pytest.raises(pvm.ProcessGone, match="EFAULT"):
        pvm.copy_batches(os.getpid(), STORE, share)  # address 4096 is never mapped
