"""vLLM tests: the real vLLM 0.33.0 Scheduler and worker connectors, on CPU.

The CPU environment for vLLM is set in tests/conftest.py, before anything imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvdepot.testing.vllm_engine import EngineConfig, SyntheticEngine, find_model_dir

MODEL_DIR = find_model_dir(Path(__file__).resolve().parents[1])


@pytest.fixture
def make_engine() -> Iterator[Callable[..., SyntheticEngine]]:
    """make_engine(**EngineConfig fields) -> a SyntheticEngine, shut down after the test."""
    engines: list[SyntheticEngine] = []

    def make(**kwargs) -> SyntheticEngine:
        kwargs.setdefault("model_dir", str(MODEL_DIR))
        engine = SyntheticEngine(EngineConfig(**kwargs))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
