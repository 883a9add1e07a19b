"""The type checker's ground rules (scripts/test.sh runs mypy itself, [tool.mypy] in
pyproject.toml): every `# type: ignore` in server/, client/ and common/ names its error
code (mypy checks that: ignore-without-code) and says why, in a comment after it or
on a line just above."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = re.compile(r"#\s*type:\s*ignore(\[[^\]]*\])?(.*)$")


def unexplained_ignores(text: str) -> list[int]:
    """Line numbers of ignores with no code, or no reason beside or above them (among
    the three nearest lines above without an ignore: a statement's first lines)."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        found = IGNORE.search(line)
        if found is None:
            continue
        code, after = found.groups()
        if code is None:
            bad.append(i + 1)
            continue
        if after.strip().startswith("#"):
            continue
        above = [ln.strip() for ln in reversed(lines[:i]) if not IGNORE.search(ln)][:3]
        if not any(ln.startswith("#") for ln in above):
            bad.append(i + 1)
    return bad


def test_every_type_ignore_has_a_code_and_a_reason() -> None:
    missing = {
        str(path.relative_to(ROOT)): lines
        for top in ("server", "client", "common")
        for path in sorted((ROOT / top).rglob("*.py"))
        if (lines := unexplained_ignores(path.read_text()))
    }
    assert not missing, f"# type: ignore without a code or a reason: {missing}"


def test_the_rule_itself() -> None:
    assert unexplained_ignores("x = f()  # type: ignore\n") == [1]
    assert unexplained_ignores("x = f()  # type: ignore[misc]\n") == [1]
    assert unexplained_ignores("x = f()  # type: ignore[misc]  # f's stubs are wrong\n") == []
    assert unexplained_ignores("# f's stubs are wrong\nx = f()  # type: ignore[misc]\n") == []
    assert unexplained_ignores("# far\na\nb\nc\nx = f()  # type: ignore[misc]\n") == [5]
