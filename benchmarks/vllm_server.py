"""A vLLM OpenAI server process, started here or attached to by URL, and the connector
config the README shows (`kvdepot bench serve` and the engine tests share these).

Standard library only: the bench can drive servers of another environment.
"""

from __future__ import annotations

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

#: What every engine here runs with: a small CPU KV cache, no hub, and room for the
#: other processes of a 2-core, shared machine (vLLM's CPU backend otherwise insists on
#: 92% of the RAM being free).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # vLLM's default level (the suite's conftest lowers it for in-process vLLM).
    "VLLM_LOGGING_LEVEL": "INFO",
    # vllm-cpu 0.32.0 (torch 2.13) compiles ahead of time by default, but cannot load
    # what it saved ("'function' object has no attribute 'finalize_loading'"), so every
    # start compiled again: 42-56 s of engine set-up on 2 cores, against 23 s this way.
    # Start-up only; the model computes the same (the tests compare outputs with it).
    "VLLM_USE_AOT_COMPILE": "0",
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


def native_offload_config(cpu_bytes: int) -> dict[str, Any]:
    """vLLM's own CPU offloading (`OffloadingConnector`, `CPUOffloadingSpec`)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class ProcessOutput:
    """Copies a process's output to a log file and keeps its last lines (for errors)."""

    def __init__(self, stream, log_path: Path) -> None:  # type: ignore[no-untyped-def]
        self.tail: deque[str] = deque(maxlen=60)
        self.log_path = log_path
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:  # type: ignore[no-untyped-def]
        with open(self.log_path, "a", errors="replace") as log:
            for line in stream:
                log.write(line)
                log.flush()  # whole() reads the file
                self.on_line(line)
        self.on_end()

    def on_line(self, line: str) -> None:
        """Each line as it arrives (pump thread); subclasses read protocol lines."""
        self.tail.append(line.rstrip())

    def on_end(self) -> None:
        """The process closed its output (pump thread)."""

    def text(self) -> str:
        return "\n".join(self.tail)

    def whole(self) -> str:
        return self.log_path.read_text(errors="replace")


class HTTPServer:
    """A running OpenAI-compatible server at `base` (http://host:port)."""

    proc: subprocess.Popen[str] | None = None

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self._model: str | None = None

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
        if self._model is None:
            with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
                self._model = json.loads(r.read())["data"][0]["id"]
        return self._model

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return r.read().decode()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return ""

    def close(self) -> None:
        """Leaves a server it did not start alone."""


class OpenAIServer(HTTPServer):
    """vLLM's OpenAI-compatible server (`vllm serve`; vllm-cpu's console script is
    broken, so `python -m vllm.entrypoints.openai.api_server`), started here.

    `kv_transfer_config` None: no connector (vLLM alone, its prefix cache on). `args`:
    more server flags; `env`: more environment. `wait=False` returns once the process
    is started (`wait_ready` then), so that several servers start side by side."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        kv_transfer_config: dict | None,
        start_timeout: float = 300.0,
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
        name: str = "server",
        wait: bool = True,
    ) -> None:
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        self.model = model
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(args or [])
        self.env = {**os.environ, **ENGINE_ENV, **(env or {})}
        self.python = python or sys.executable
        self.log_path = workdir / f"{name}.log"
        self.start_timeout = start_timeout
        self.launch()
        if wait:
            self.wait_ready()

    def launch(self) -> None:
        """Starts the process (again, on the same port, after `close`)."""
        flags = {
            "--max-model-len": LLM_ARGS["max_model_len"],
            "--gpu-memory-utilization": LLM_ARGS["gpu_memory_utilization"],
            "--dtype": LLM_ARGS["dtype"],
        }
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--skip-tokenizer-init",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        for flag, value in flags.items():
            if flag not in self.extra_args:  # the caller's value wins
                cmd += [flag, str(value)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        self.proc = subprocess.Popen(
            [*cmd, *self.extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # The dev routes give /reset_prefix_cache (vLLM's own cache, not kvdepot's).
            env={**self.env, "VLLM_SERVER_DEV_MODE": "1"},
        )
        self.out = ProcessOutput(self.proc.stdout, self.log_path)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        assert self.proc is not None
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited:\n{self.out.text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's server did not come up:\n{self.out.text()}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.out.whole()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
