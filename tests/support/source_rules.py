"""Helpers of the tests that check a rule over the product's source (who may call a
stub, build a job message, reach into the state): each check is shown to catch what
it exists to stop by planting the old code back into a copy of a real module."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def assert_check_catches(
    check: Callable[[Path, str], list[str]], module: str, anchor: str, planted: str
) -> None:
    """`module` (relative to the repository) passes `check`, and fails it once `anchor`
    is replaced by `planted`. A missing anchor fails too: the test must follow the code."""
    path = ROOT / module
    source = path.read_text()
    assert anchor in source, f"{module} changed: update this test's anchor"
    assert not check(path, source), f"{module} breaks the rule as it is"
    assert check(path, source.replace(anchor, planted, 1)), f"the planted code in {module} passed"
