"""docs/architecture.md §2's layers, checked: `lint-imports` runs the import contract in
pyproject.toml ([tool.importlinter]) over kvdepot as installed and over kvdepot as its
wheel lays it out; each import the contract exists to stop, added to a copy of the code,
breaks it; and §2's tables list the contract's layers, so the document and the code
cannot drift apart.

import-linter (grimp) finds a package's modules by walking the one folder the package
lives in. scripts/test.sh installs kvdepot as a strict editable install, whose tree of
links has that layout, so bare `lint-imports` in the checkout works; the copies made
here from [tool.setuptools]'s package list and package-dir (the wheel's own map) let a
test add an import without touching the checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lay_out(dest: Path) -> Path:
    """Copies every package's .py files to dest/kvdepot/... (the wheel's layout)."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    roots: dict[str, str] = setuptools["package-dir"]
    for package in setuptools["packages"]:
        parts = package.split(".")
        # The nearest mapped ancestor names the folder: kvdepot.server.core -> server/core.
        depth = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in roots)
        source = REPO / roots[".".join(parts[:depth])] / Path(*parts[depth:])
        target = dest.joinpath(*parts)
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copyfile(module, target / module.name)
    return dest


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} is missing: pip install -e '.[test]' (import-linter)")
    # cwd=root: lint-imports puts the working directory first on sys.path, so
    # `kvdepot` is the laid-out copy there (in the repository, which has no `kvdepot`
    # folder, it is the installed package).
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(PYPROJECT)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_code_keeps_the_import_contract(tmp_path: Path) -> None:
    proc = lint_imports(lay_out(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_bare_lint_imports_in_the_checkout_keeps_the_contract() -> None:
    """What a developer types: `lint-imports` in the repository, over the installed
    package, finds every layer and keeps every contract."""
    proc = lint_imports(REPO)
    hint = "(a default editable install? scripts/test.sh installs it strict: §2 says why)"
    assert proc.returncode == 0, f"{hint}\n{proc.stdout}{proc.stderr}"
    assert "0 broken" in proc.stdout, proc.stdout


# Each row puts back an import that a move took out (or one a rule forbids) and names
# the edge lint-imports must then report: the contract is not vacuous.
FORBIDDEN_EDGES = [
    # the daemon imported the client's fd-passing protocol (now kvdepot.common.fd_protocol)
    ("server/fd_receiver.py", "kvdepot.client.fdpass"),
    # the daemon read Yama's ptrace scope through the client (now kvdepot.common.ptrace)
    ("server/pvm.py", "kvdepot.client.pvm"),
    # the client checked CUDA handles with the daemon's code (now kvdepot.common.cuda_handles)
    ("client/cuda_ipc.py", "kvdepot.server.cuda.dma"),
    # state read the daemon's settings and sizes (now a StateConfig protocol, server/sizes.py)
    ("server/state/namespaces.py", "kvdepot.server.config"),
    # state named the concrete fd socket (now the FdSource protocol)
    ("server/state/depot.py", "kvdepot.server.fd_receiver"),
    # the daemon's CLI imported the benchmarks (now dispatched by module name)
    ("server/cli.py", "kvdepot.bench.cli"),
    # the sans-I/O core: no gRPC, no sockets, nothing above it
    ("server/core/index.py", "grpc"),
    ("server/core/planner.py", "socket"),
    ("server/core/index.py", "kvdepot.server.state"),
    # common is standard library only, below client and server
    ("common/chunks.py", "numpy"),
    ("common/kinds.py", "kvdepot.server.core"),
    # the connector never imports the test engine
    ("client/vllm/connector.py", "kvdepot.testing"),
]


@pytest.mark.parametrize(("module", "imported"), FORBIDDEN_EDGES)
def test_each_forbidden_import_breaks_the_contract(
    tmp_path: Path, module: str, imported: str
) -> None:
    root = lay_out(tmp_path)
    path = root / "kvdepot" / module  # server/, client/, common/ keep their names there
    assert path.exists(), f"{module} moved: update FORBIDDEN_EDGES"
    with path.open("a") as f:
        f.write(f"\nimport {imported}  # put back by tests/test_layering.py\n")
    proc = lint_imports(root)
    assert proc.returncode != 0, f"import {imported} in {module} kept the contract"
    source = "kvdepot." + module.removesuffix(".py").replace("/", ".")
    assert f"{source} -> {imported}" in proc.stdout, proc.stdout


def test_common_imports_the_standard_library_only(tmp_path: Path) -> None:
    """kvdepot.common is imported by the client in a plain vLLM environment and by the
    daemon: every module outside kvdepot it imports is in Python's standard library."""
    root = lay_out(tmp_path)
    script = (
        "import grimp, json\n"
        "g = grimp.build_graph('kvdepot', include_external_packages=True, cache_dir=None)\n"
        "common = [m for m in g.modules if m.split('.')[:2] == ['kvdepot', 'common']]\n"
        "out = {m: sorted(t for t in g.find_modules_directly_imported_by(m)\n"
        "                 if not t.startswith('kvdepot')) for m in common}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    imports = json.loads(proc.stdout)
    assert "kvdepot.common.fd_protocol" in imports  # the copy is the one examined
    outside = {m: [t for t in ts if t not in sys.stdlib_module_names] for m, ts in imports.items()}
    assert not any(outside.values()), {m: ts for m, ts in outside.items() if ts}


def _doc_layers(table_heading: str, column: int) -> list[list[str]]:
    """The layers a table of docs/architecture.md §2 lists, top to bottom: each row's
    `column` (backticked names; `\\|` between neighbours) as bare module names."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## 2. Layers") : text.index("## 3.")]
    table = section[section.index(table_heading) :].split("\n\n", 2)[1]
    layers = []
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        if not cells[0].isdigit():
            continue  # deploy/, tests/: not packages
        names = [n.strip().strip("`") for n in cells[column].split("\\|")]
        layers.append(
            sorted(n.removeprefix("kvdepot.").removesuffix(".py").rstrip("/") for n in names)
        )
    return layers


def _contract_layers(contract_id: str) -> list[list[str]]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == contract_id]
    return [sorted(n.strip() for n in layer.split("|")) for layer in contract["layers"]]


def test_the_architecture_document_states_the_contract() -> None:
    """§2's two tables list the contract's layers, in its order: the prose and the
    checked contract cannot drift apart."""
    assert _doc_layers("**Packages**", 2) == _contract_layers("packages")
    assert _doc_layers("**The daemon**", 1) == _contract_layers("daemon")
