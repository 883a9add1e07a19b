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


def run(level: str, *, root_handler: bool = False) -> str:
    prefix = "import logging; logging.basicConfig(format='ROOT %(message)s')\n"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": level}
    done = subprocess.run(
        [sys.executable, "-c", (prefix if root_handler else "") + SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_kvdepot_logs_through_vllms_handler_at_vllms_level() -> None:
    out = run("INFO")
    line = next(x for x in out.splitlines() if "kvdepot-line-at-info" in x)
    assert "INFO" in line and "[test" not in line and "]" in line  # vLLM's format
    assert "kvdepot-line-at-debug" not in out
    assert "kvdepot-line-at-info" not in run("WARNING")


def test_an_application_that_configured_logging_keeps_its_own() -> None:
    out = run("INFO", root_handler=True)
    assert "kvdepot-line-at-info" not in out  # the root logger's level (WARNING) rules
