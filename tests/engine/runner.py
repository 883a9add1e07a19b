"""Test-side handle on a real vLLM engine process (`llm_runner.py`) or OpenAI server."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import Any

from tests.engine.llm_runner import MARK

RUNNER = Path(__file__).with_name("llm_runner.py")

#: What every engine here runs with: a small CPU KV cache, no hub, and room for the
#: other processes of a 2-core, shared machine (vLLM's CPU backend otherwise insists on
#: 92% of the RAM being free).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # vLLM's default level (the suite's conftest lowers it for in-process vLLM).
    "VLLM_LOGGING_LEVEL": "INFO",
}
#: float32 as the test models are stored: with "auto", vLLM's CPU backend computes in
#: bfloat16 where the CPU has it (AVX512-BF16/AMX), and bfloat16's noise over a few decode
#: steps exceeds the logprob tolerance the tests compare outputs with.
LLM_ARGS = {"max_model_len": 1024, "gpu_memory_utilization": 0.3, "dtype": "float32"}


def readme_kv_config(socket_target: str, **extra: Any) -> dict[str, Any]:
    """The README's `--kv-transfer-config`, only the socket (and `extra`) changed."""
    return {
        "kv_connector": "KVDepotConnector",
        "kv_connector_module_path": "kvdepot.client.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvdepot_socket": socket_target, **extra},
    }


class _Output:
    """Keeps the last lines of a process's output (for failure messages) and hands
    protocol lines to the reader."""

    def __init__(self, stream, log_path: Path) -> None:  # type: ignore[no-untyped-def]
        self.tail: deque[str] = deque(maxlen=60)
        self.answers: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.log_path = log_path
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:  # type: ignore[no-untyped-def]
        with open(self.log_path, "a", errors="replace") as log:
            for line in stream:
                log.write(line)
                log.flush()  # whole() reads the file
                if line.startswith(MARK):
                    with self.cond:
                        self.answers.append(json.loads(line[len(MARK) :]))
                        self.cond.notify_all()
                else:
                    self.tail.append(line.rstrip())
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

    def text(self) -> str:
        return "\n".join(self.tail)

    def whole(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")


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

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's own (device) prefix cache, so the next hit must come from kvdepot."""
        self._ask({"op": "reset_prefix_cache"})

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIServer:
    """vLLM's OpenAI-compatible server (`vllm serve`; vllm-cpu's console script is
    broken, so `python -m vllm.entrypoints.openai.api_server`)."""

    def __init__(
        self, model: Path, workdir: Path, kv_transfer_config: dict, start_timeout: float = 300.0
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--skip-tokenizer-init",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--max-model-len",
                str(LLM_ARGS["max_model_len"]),
                "--gpu-memory-utilization",
                str(LLM_ARGS["gpu_memory_utilization"]),
                "--dtype",
                str(LLM_ARGS["dtype"]),
                "--kv-transfer-config",
                json.dumps(kv_transfer_config),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # The dev routes give /reset_prefix_cache (vLLM's own cache, not kvdepot's).
            env={**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1"},
        )
        self.out = _Output(self.proc.stdout, self.log_path)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM's server exited:\n" + self.out.text())
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's server did not come up:\n" + self.out.text())
            time.sleep(0.5)

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            raw = r.read()
        return json.loads(raw) if raw.strip() else {}

    def complete(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        resp = self.post(
            "/v1/completions",
            {
                "model": self.model_name(),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            },
        )
        return list(resp["choices"][0]["token_ids"])

    def model_name(self) -> str:
        with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def log(self) -> str:
        return self.out.whole()

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return r.read().decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def prometheus_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` in a /metrics page."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
