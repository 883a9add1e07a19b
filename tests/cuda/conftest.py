"""A real DepotState for the CUDA path's tests (closed afterwards)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdepot.server.config import ServeConfig
from kvdepot.server.state import DepotState


@pytest.fixture
def state() -> Iterator[DepotState]:
    st = DepotState.create(
        ServeConfig(socket="/nonexistent/kvdepot.sock", pool_size=64 << 20, copy_threads=2)
    )
    yield st
    st.close()
