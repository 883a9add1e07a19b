"""The compiled run copier (server/memory/_runcopy.c) and the CPU copy engine's two
paths: the bytes land where the runs say, and bad columns raise, never crash."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.server.memory import copy_engine
from kvdepot.server.memory.copy_engine import CpuCopyEngine, copier

copy_runs = copy_engine.copy_runs


def test_the_test_install_built_the_compiled_copier() -> None:
    # scripts/test.sh installs with a C compiler: without this check a failed build
    # (optional in pyproject.toml) would leave every other test on the numpy path.
    assert copy_runs is not None, copier()
    assert CpuCopyEngine().compiled and not CpuCopyEngine(compiled=False).compiled


@pytest.mark.parametrize("seed", range(5))
def test_random_runs_land_byte_for_byte(seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    got = np.zeros(1 << 16, dtype=np.uint8)
    want = np.zeros(1 << 16, dtype=np.uint8)
    # Runs of mixed sizes (0 included) into disjoint destination windows.
    cuts = np.sort(rng.choice(np.arange(1, 1 << 16), 40, replace=False))
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [1 << 16]))
    sizes = rng.integers(0, ends - starts + 1)
    src_at = rng.integers(0, (1 << 16) - sizes + 1)
    for d, s, k in zip(starts.tolist(), src_at.tolist(), sizes.tolist(), strict=True):
        want[d : d + k] = src[s : s + k]
    copy_runs(
        (got.ctypes.data + starts).astype(np.int64),
        (src.ctypes.data + src_at).astype(np.int64),
        sizes.astype(np.int64),
    )
    assert np.array_equal(got, want)


def test_no_runs_is_a_no_op() -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert copy_runs(empty, empty, empty) is None


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ((np.zeros(2, np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64)), "differ"),
        ((np.zeros(2, np.int32), np.zeros(2, np.int64), np.zeros(2, np.int64)), "64-bit"),
        ((np.zeros((2, 2), np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)), "1-D"),
        ((np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, -5, np.int64)), "-5 bytes"),
    ],
)
def test_bad_columns_raise_value_error(columns: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        copy_runs(*columns)


def test_non_buffers_raise_type_error() -> None:
    with pytest.raises(TypeError):
        copy_runs([1], [2], [3])
    with pytest.raises(TypeError):
        copy_runs(np.zeros(1, np.int64))  # type: ignore[call-arg]
