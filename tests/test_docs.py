"""The repository stands alone: its references point inside it.

Code, tests and documents cite the architecture as "docs/architecture.md §N"; each
cited section must exist. Nothing may point at files beside the repository, or at
documents and issue numbers a reader of the repository does not have.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _tracked_texts() -> dict[str, str]:
    names = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    texts = {}
    for name in names:
        path = REPO / name
        if not path.is_file() or path.suffix in {".png", ".whl"}:
            continue
        try:
            texts[name] = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
    return texts


def _sections() -> set[str]:
    numbers = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", ARCHITECTURE.read_text(), re.M)
    assert numbers, "docs/architecture.md has no numbered sections"
    return set(numbers)


def test_every_cited_architecture_section_exists() -> None:
    sections = _sections()
    cited = 0
    for name, text in _tracked_texts().items():
        for m in re.finditer(r"architecture\.md\s+((?:§\d+(?:\.\d+)?(?:,\s*)?)+)", text):
            for number in re.findall(r"§(\d+(?:\.\d+)?)", m.group(1)):
                cited += 1
                assert number in sections, f"{name} cites docs/architecture.md §{number}"
    assert cited > 5  # the check looked at real citations


def test_nothing_refers_outside_the_repository() -> None:
    design = "DESIGN" + " §"  # spelled apart so that this file does not match itself
    outside = re.compile(r"\.\./shared|shared/[t]estdata|\bissue #?\d")
    found = []
    for name, text in _tracked_texts().items():
        for number, line in enumerate(text.splitlines(), 1):
            if design in line or outside.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "references a reader of the repository does not have:\n" + "\n".join(found)
