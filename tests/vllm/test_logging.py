"""kvdepot's log lines show in vLLM's processes, the way vLLM's own do: vLLM configures
only its "vllm" logger, and kvdepot's INFO lines (the memory path a rank took, its
registration) would otherwise be dropped by the unconfigured root logger."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = """
import logging
import kvdepot.client.vllm  # what vLLM imports for the connector
from kvdepot.client.vllm.logs import follow_vllm_logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what vLLM 0.33 does at engine start
follow_vllm_logging()  # what building KVDepotOffloadingSpec does
logging.getLogger("kvdepot.vllm.worker").info("kvdepot-line-at-info")
logging.getLogger("kvdepot.vllm.worker").debug("kvdepot-line-at-debug")
"""


# Each run is a process of its own (logging is configured once per process); each
# imports vLLM (about ten seconds), so the three run at once.
RUNS = {"info": ("INFO", False), "warning": ("WARNING", False), "root_handler": ("INFO", True)}


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """What each of RUNS printed: vLLM's logging level, and whether the application
    configured the root logger before vLLM."""
    prefix = "import logging; logging.basicConfig(format='ROOT %(message)s')\n"
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", (prefix if root_handler else "") + SCRIPT],
            env={**os.environ, "VLLM_LOGGING_LEVEL": level},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, (level, root_handler) in RUNS.items()
    }
    found = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        found[name] = out
    return found


def test_kvdepot_logs_through_vllms_handler_at_vllms_level(outputs: dict[str, str]) -> None:
    out = outputs["info"]
    line = next(x for x in out.splitlines() if "kvdepot-line-at-info" in x)
    assert "INFO" in line and "[test" not in line and "]" in line  # vLLM's format
    assert "kvdepot-line-at-debug" not in out
    assert "kvdepot-line-at-info" not in outputs["warning"]


def test_an_application_that_configured_logging_keeps_its_own(outputs: dict[str, str]) -> None:
    assert "kvdepot-line-at-info" not in outputs["root_handler"]  # the root logger's WARNING
