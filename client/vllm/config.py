"""Connector settings read from vLLM's `kv_connector_extra_config`.

Every key is optional; unknown keys are left for vLLM (for example
`blocks_per_chunk`, `offload_prompt_only`, `sync_load_budget_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_SOCKET = "unix:///run/kvdepot/kvdepot.sock"

#: `kv_connector_extra_config` keys this connector reads, with their defaults.
SETTINGS_KEYS: dict[str, Any] = {
    "kvdepot_socket": DEFAULT_SOCKET,
    "kvdepot_namespace_salt": "",
    "kvdepot_pin_timeout_ms": 50,
    "kvdepot_startup_wait_s": 1.0,
    "kvdepot_job_timeout_s": 15.0,
    "kvdepot_memory_path": "auto",
    "kvdepot_load_failure_backoff_s": 10.0,
    "kvdepot_client_name": "",
}

MEMORY_PATHS = ("auto", "shm", "pvm", "inline")


@dataclass(frozen=True)
class DepotSettings:
    """Validated connector settings.

    socket: gRPC target of the daemon ("unix:///path" or a bare absolute path).
    namespace_salt: mixed into the namespace digest; engines share blocks only
        with engines of the same salt (use it to separate weight versions).
    pin_timeout_s: deadline of the one Pin RPC a scheduler step may make.
    startup_wait_s: how long the scheduler and each worker wait for the daemon
        when they start (never fails start-up; 0 = do not wait).
    job_timeout_s: the longest `wait()` blocks for a transfer before the worker
        abandons the Transfer stream and reports the jobs as failed.
    memory_path: "auto" (shm when the KV tensors live in a memfd, cuda_ipc for CUDA
        tensors, pvm for plain CPU memory the daemon may read, else inline), "shm"
        (same, but warn loudly when it cannot be used), "pvm" (plain CPU memory
        copied with process_vm_readv/writev, even when it is a memfd) or "inline".
    load_failure_backoff_s: after a failed load, the scheduler treats its keys as
        misses for this long, so a request is not sent to the same failure again.
    client_name: shown by `Admin/ListEngines` (default: role and engine id).
    """

    socket: str = DEFAULT_SOCKET
    namespace_salt: str = ""
    pin_timeout_s: float = 0.05
    startup_wait_s: float = 1.0
    job_timeout_s: float = 15.0
    memory_path: str = "auto"
    load_failure_backoff_s: float = 10.0
    client_name: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> DepotSettings:
        """Parses and validates; raises ValueError naming the key and the fix."""

        def number(key: str, minimum: float) -> float:
            raw = extra.get(key, SETTINGS_KEYS[key])
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be a number, got {raw!r}"
                ) from None
            if not math.isfinite(value) or value < minimum:
                raise ValueError(
                    f"kv_connector_extra_config[{key!r}] must be >= {minimum}, got {raw!r}"
                )
            return value

        socket = str(extra.get("kvdepot_socket", DEFAULT_SOCKET)).strip()
        if not socket:
            raise ValueError("kv_connector_extra_config['kvdepot_socket'] must not be empty")
        memory_path = str(extra.get("kvdepot_memory_path", "auto")).lower()
        if memory_path not in MEMORY_PATHS:
            raise ValueError(
                f"kv_connector_extra_config['kvdepot_memory_path'] must be one of "
                f"{', '.join(MEMORY_PATHS)}; got {memory_path!r}"
            )
        pin_timeout_ms = number("kvdepot_pin_timeout_ms", 1.0)
        return cls(
            socket=socket,
            namespace_salt=str(extra.get("kvdepot_namespace_salt", "") or ""),
            pin_timeout_s=pin_timeout_ms / 1000.0,
            startup_wait_s=number("kvdepot_startup_wait_s", 0.0),
            job_timeout_s=number("kvdepot_job_timeout_s", 0.1),
            memory_path=memory_path,
            load_failure_backoff_s=number("kvdepot_load_failure_backoff_s", 0.0),
            client_name=str(extra.get("kvdepot_client_name", "") or ""),
        )
