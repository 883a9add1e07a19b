"""GPU tests: skipped as a whole, cleanly, where CUDA is absent.

The check is the daemon's own (`kvdepot.server.cuda.cuda_available()`: ctypes and
libcuda.so.1, no torch import), plus torch with CUDA for the engine side. Every
test here is marked `gpu`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SERVE_CUDA = HERE / "serve_cuda.py"
GPU_ENGINE = HERE / "gpu_engine.py"


@cache
def cuda_skip_reason() -> str | None:
    from kvdepot.server.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return f"no CUDA: {reason}"
    try:
        import torch
    except ImportError:
        return "no torch: the engine side of the GPU tests needs it"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [i for i in items if HERE in Path(str(i.path)).resolve().parents]
    if not mine:
        return
    reason = cuda_skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cuda_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """cuda_daemon(*serve_args) -> a started daemon with the CUDA path on.

    Runs `tests/gpu/serve_cuda.py`: `kvdepot serve` itself, which wires CUDA in
    by itself once daemon.py calls enable_cuda (until then the script does it).
    """
    from tests.support.daemon import DaemonProcess

    started: list[DaemonProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> DaemonProcess:
        d = DaemonProcess(
            Path(tmp_path_factory.mktemp("kvd")),
            *args,
            env=env,
            command=[sys.executable, str(SERVE_CUDA)],
        )
        started.append(d)
        d.start(timeout=60.0)
        d.wait_log(r"CUDA is (on|off)")
        if "CUDA is on" not in d.log():
            raise AssertionError(f"the daemon did not turn CUDA on:\n{d.log()}")
        return d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
        keep = os.environ.get("KVDEPOT_GPU_LOG_DIR")
        if keep:  # run_h200.sh collects the daemon logs
            Path(keep).mkdir(parents=True, exist_ok=True)
            with open(Path(keep) / "daemons.log", "a") as f:
                f.write(f"===== {d.workdir}\n{d.log()}\n")
