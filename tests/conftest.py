"""Shared fixtures: a real daemon process on a temporary Unix socket, and one in the
operations guide's state (tests/support/guide.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# vLLM picks its platform once, on first use, and some modules outside tests/vllm
# import it at collection time: the CPU settings must be in place before any of them.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdepot.client import DepotClient
from tests.support.daemon import DaemonProcess
from tests.support.faults import DaemonFactory
from tests.support.guide import run_guide_scenario

if TYPE_CHECKING:  # imported in the fixture: the engines' venv loads this file too
    from kvdepot.server.state import DepotState

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["compiled", "numpy"])
def planner_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with the compiled planner (server/core/_plan.c) and again with
    the numpy one that installs without a C compiler use."""
    from kvdepot.server.core import planner

    if request.param == "numpy":
        monkeypatch.setattr(planner, "compiled", None)
    else:
        assert planner.compiled is not None, "the test install did not build _plan.c"
    return request.param


@pytest.fixture
def daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """daemon_factory(*serve_args) -> a started DaemonProcess (stopped afterwards);
    `command` replaces `kvdepot` (e.g. under prlimit)."""
    started: list[DaemonProcess] = []

    def make(
        *args: str,
        env: dict[str, str] | None = None,
        start: bool = True,
        command: list[str] | None = None,
    ) -> DaemonProcess:
        # Short paths: a Unix socket path must fit in 108 bytes.
        workdir = Path(tmp_path_factory.mktemp("kvd"))
        d = DaemonProcess(workdir, *args, env=env, command=command)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.kill()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A daemon with a 64 MiB pool."""
    return daemon_factory("--pool-size", "64MiB")


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[DepotClient]:
    """A connected DepotClient of `daemon`, closed after the test."""
    c = DepotClient(daemon.target, client_name="pytest").start()
    assert c.wait_connected(10)
    yield c
    c.close()


@pytest.fixture
def guide_daemon(daemon_factory: DaemonFactory) -> Iterator[DaemonProcess]:
    """A daemon in the operations guide's state, its two engines connected."""
    d = daemon_factory("--pool-size", "64MiB")
    scenario = run_guide_scenario(d.target)
    try:
        yield d
    finally:
        scenario.close()


@pytest.fixture
def state() -> Iterator[DepotState]:
    """A real DepotState (arena, index, two CPU copy threads, an 8 MiB pool) without
    the gRPC layer, closed after the test. Tests that need another pool define their
    own `state`."""
    from kvdepot.server.config import ServeConfig
    from kvdepot.server.state import DepotState

    st = DepotState.create(
        ServeConfig(socket="/nonexistent/kvdepot.sock", pool_size=8 << 20, copy_threads=2)
    )
    yield st
    st.close()
