"""A real DepotState for the CUDA path's tests (closed afterwards), and a fake GPU host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.server.config import ServeConfig
from kvdepot.server.state import DepotState
from tests.support.fake_cuda import PCI0, UUID0, UUID1, FakeGpuHost


@pytest.fixture
def state() -> Iterator[DepotState]:
    st = DepotState.create(
        ServeConfig(socket="/nonexistent/kvdepot.sock", pool_size=64 << 20, copy_threads=2)
    )
    yield st
    st.close()


@pytest.fixture
def gpu_host(tmp_path: Path) -> Iterator[FakeGpuHost]:
    """A fake GPU host with the fake driver's two devices (minors 0 and 1), both held
    open by this process; pass `senders=gpu_host.senders` to enable_cuda and register
    in a session this process owns (tests.support.fake_cuda.attested_session)."""
    host = FakeGpuHost(tmp_path / "gpu-host")
    host.add(0, UUID0, PCI0)
    host.add(1, UUID1, "0000:9A:00.0")
    host.hold(0, 1)
    yield host
    host.close()
