"""Connector settings read from vLLM's `kv_connector_extra_config`.

Every key is optional; unknown keys are left for vLLM (for example
`blocks_per_chunk`, `offload_prompt_only`, `sync_load_budget_bytes`).
`DepotSettings` is the table: each field names its key, the key's default and how
its value is read, so a key's default is written exactly once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvdepot.common.shards import MAX_SHARDS

DEFAULT_SOCKET = "unix:///run/kvdepot/kvdepot.sock"

MEMORY_PATHS = ("auto", "shm", "pvm", "inline")


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _number(minimum: float, per: float = 1.0) -> Callable[[str, Any], float]:
    """A finite number >= minimum, divided by `per` (1000: a key in ms, a field in s)."""

    def parse(key: str, raw: Any) -> float:
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{_where(key)} must be a number, got {raw!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise ValueError(f"{_where(key)} must be >= {minimum}, got {raw!r}")
        return value / per

    return parse


def _text(key: str, raw: Any) -> str:
    return str(raw or "")


def _socket(key: str, raw: Any) -> str:
    value = str(raw).strip()
    if not value:
        raise ValueError(f"{_where(key)} must not be empty")
    return value


def _auto_or_whole(low: int, high: int, meaning: str) -> Callable[[str, Any], int | None]:
    """A parser of "auto" (None) or a whole number from `low` to `high`."""

    def parse(key: str, raw: Any) -> int | None:
        text = str(raw).strip().lower()
        if text == "auto":
            return None
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise ValueError(
                f'{_where(key)} must be "auto" or a whole number from {low} to {high} '
                f"({meaning}), got {raw!r}"
            )
        return value

    return parse


def _whole(minimum: int) -> Callable[[str, Any], int]:
    """A whole number >= minimum."""

    def parse(key: str, raw: Any) -> int:
        try:
            value = int(str(raw).strip())
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"{_where(key)} must be a whole number >= {minimum}, got {raw!r}")
        return value

    return parse


def _memory_path(key: str, raw: Any) -> str:
    value = str(raw).lower()
    if value not in MEMORY_PATHS:
        raise ValueError(f"{_where(key)} must be one of {', '.join(MEMORY_PATHS)}; got {value!r}")
    return value


EVICTION_POLICIES = ("lru", "arc")  # vLLM's CPU tier's names, and the daemon's


def _policy(key: str, raw: Any) -> str:
    value = str(raw).lower()
    if value and value not in EVICTION_POLICIES:
        raise ValueError(
            f"{_where(key)} must be one of {', '.join(EVICTION_POLICIES)}; got {value!r}"
        )
    return value


def _key(name: str, default: Any, parse: Callable[[str, Any], Any], env: str = "") -> Any:
    """A `DepotSettings` field read from key `name` (default: the environment variable
    `env` where it is set, else the key's default, parsed)."""
    return field(
        default=parse(name, default),
        metadata={"key": name, "raw": default, "parse": parse, "env": env},
    )


@dataclass(frozen=True)
class DepotSettings:
    """Validated connector settings.

    socket: gRPC target of the daemon ("unix:///path" or a bare absolute path).
    namespace_salt: mixed into the namespace digest; engines share blocks only
        with engines of the same salt (use it to separate weight versions). Default:
        KVDEPOT_NAMESPACE_SALT (the deployment's salt), else none.
    pin_timeout_s: deadline of the one pin call (pin lane or Pin RPC) a scheduler step may make.
    startup_wait_s: how long the scheduler and each worker wait for the daemon
        when they start (never fails start-up; 0 = do not wait).
    job_timeout_s: the longest `wait()` blocks for a transfer before the worker
        abandons the Transfer stream and reports the jobs as failed.
    memory_path: "auto" (shm when the KV tensors live in a memfd or plain CPU
        memory can be moved into one, cuda_ipc for CUDA tensors, pvm for CPU memory
        the daemon may read, else inline), "shm" (same, but warn loudly when it
        cannot be used), "pvm" (CPU memory copied in place with
        process_vm_readv/writev, even when it is a memfd) or "inline".
    load_failure_backoff_s: after a failed load, the scheduler treats its keys as
        misses for this long, so a request is not sent to the same failure again.
    client_name: shown by `Admin/ListEngines` (default: role and engine id).
    remote_wait_s: how long a lookup may answer RETRY for a block the daemon's remote
        tier is fetching before it counts as a miss (see KVDepotOffloadingManager).
    shards: the daemon's `--shards`: an engine of world size W uses gcd(shards, W) of
        them, W / E consecutive ranks on each (kvdepot.common.shards). None ("auto"):
        each process reads it from the hello of the daemon's socket when it starts
        (within startup_wait_s; 1 when the daemon does not answer by then).
    first_shard: the first of the E shards an engine that uses fewer than the node's
        starts at (a multiple of E); None ("auto"): the one its namespace picks.
    store_threshold: vLLM's own key, with its meaning: a chunk is stored only once
        it was offered this many times (by this engine; values below 2: at once).
    max_tracker_size: vLLM's own key: how many chunks' offers store_threshold
        counts, the least recently offered forgotten first.
    eviction_policy: vLLM's own key ("lru" or "arc"), the policy this engine expects
        of the pool. The pool is the node's, so its policy is the daemon's
        (`kvdepot serve --eviction-policy`): the connector says so when they differ.
        "" (the default): whatever the daemon runs.
    """

    socket: str = _key("kvdepot_socket", DEFAULT_SOCKET, _socket)
    namespace_salt: str = _key("kvdepot_namespace_salt", "", _text, env="KVDEPOT_NAMESPACE_SALT")
    pin_timeout_s: float = _key("kvdepot_pin_timeout_ms", 50, _number(1.0, per=1000))
    startup_wait_s: float = _key("kvdepot_startup_wait_s", 1.0, _number(0.0))
    job_timeout_s: float = _key("kvdepot_job_timeout_s", 15.0, _number(0.1))
    memory_path: str = _key("kvdepot_memory_path", "auto", _memory_path)
    load_failure_backoff_s: float = _key("kvdepot_load_failure_backoff_s", 10.0, _number(0.0))
    client_name: str = _key("kvdepot_client_name", "", _text)
    remote_wait_s: float = _key("kvdepot_remote_wait_ms", 200.0, _number(0.0, per=1000))
    shards: int | None = _key(
        "kvdepot_shards", "auto", _auto_or_whole(1, MAX_SHARDS, "the daemon's --shards")
    )
    first_shard: int | None = _key(
        "kvdepot_first_shard", "auto", _auto_or_whole(0, MAX_SHARDS - 1, "a shard's number")
    )

    store_threshold: int = _key("store_threshold", 0, _whole(0))
    max_tracker_size: int = _key("max_tracker_size", 64_000, _whole(1))
    eviction_policy: str = _key("eviction_policy", "", _policy)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> DepotSettings:
        """Parses and validates; raises ValueError naming the key and the fix."""
        values = {}
        for f in dataclasses.fields(cls):
            key, parse, env = f.metadata["key"], f.metadata["parse"], f.metadata["env"]
            default = os.environ.get(env, f.metadata["raw"]) if env else f.metadata["raw"]
            values[f.name] = parse(key, extra.get(key, default))
        return cls(**values)


#: `kv_connector_extra_config` keys this connector reads, with their defaults.
SETTINGS_KEYS: dict[str, Any] = {
    f.metadata["key"]: f.metadata["raw"] for f in dataclasses.fields(DepotSettings)
}
