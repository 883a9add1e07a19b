"""Test-side handle on a real vLLM engine process (`llm_runner.py`) or OpenAI server
(the server, the README's connector config and the /metrics reader live in
`kvdepot.bench.vllm_server`, which `kvdepot bench serve` uses too)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvdepot.bench.vllm_server import (  # noqa: F401 (re-exported for the tests)
    ENGINE_ENV,
    LLM_ARGS,
    OpenAIServer,
    ProcessOutput,
    free_port,
    prometheus_value,
    readme_kv_config,
)
from tests.engine.llm_runner import MARK

RUNNER = Path(__file__).with_name("llm_runner.py")


class _Output(ProcessOutput):
    """Keeps the last lines of a process's output (for failure messages) and hands
    protocol lines to the reader."""

    def __init__(self, stream, log_path: Path) -> None:  # type: ignore[no-untyped-def]
        self.answers: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        super().__init__(stream, log_path)

    def on_line(self, line: str) -> None:
        if line.startswith(MARK):
            with self.cond:
                self.answers.append(json.loads(line[len(MARK) :]))
                self.cond.notify_all()
        else:
            super().on_line(line)

    def on_end(self) -> None:
        with self.cond:
            self.answers.append({"eof": True})
            self.cond.notify_all()

    def next(self, timeout: float) -> dict[str, Any]:
        with self.cond:
            if not self.cond.wait_for(lambda: self.answers, timeout):
                raise TimeoutError("no answer from the engine in time:\n" + self.text())
            answer = self.answers.pop(0)
        if answer.get("eof"):
            raise RuntimeError("the engine process ended:\n" + self.text())
        return answer


class LLMEngine:
    """`vllm.LLM` in its own process (vLLM's front end and engine core in two)."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        kv_transfer_config: dict | None,
        start_timeout: float = 300.0,
        **llm: Any,
    ) -> None:
        settings = {
            "model": str(model),
            "kv_transfer_config": kv_transfer_config,
            "llm": {**LLM_ARGS, **llm},
        }
        self.log_path = workdir / f"engine-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **ENGINE_ENV},
        )
        self.out = _Output(self.proc.stdout, self.log_path)
        self.out.next(start_timeout)  # {"ready": true}

    def _ask(self, cmd: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.out.next(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
        return self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})[
            "outputs"
        ]

    def metrics(self) -> dict[str, float]:
        return self._ask({"op": "metrics"})["metrics"]

    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        """Empties vLLM's own (device) prefix cache, so the next hit must come from kvdepot;
        with `reset_connector`, the connector's too (kvdepot moves to a new namespace)."""
        self._ask({"op": "reset_prefix_cache", "reset_connector": reset_connector})

    def reload_weights(self, weights_dir: Path) -> None:
        """Loads the weights in `weights_dir` in place (a weight update)."""
        self._ask({"op": "reload_weights", "weights_path": str(weights_dir)})

    def log(self) -> str:
        return self.out.whole()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, TimeoutError, BrokenPipeError):
                self._ask({"op": "exit"}, timeout=60)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
