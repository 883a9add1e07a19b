"""Make `import kvdepot` work from this tree without pip, for a machine that cannot
install it (the GPU machine reaches no package index and may lack setuptools' version).

    python tests/gpu/mirror_package.py /tmp/kvdepot-pkg    # then PYTHONPATH=/tmp/kvdepot-pkg

It reads pyproject.toml, so the mirror follows the packaging as it changes:
- every `[tool.setuptools.package-dir]` entry becomes a symlink under the target
  (kvdepot -> proto/kvdepot's files, kvdepot.server -> server, ...);
- every `[[tool.setuptools.ext-modules]]` is compiled with the C compiler that is
  there, next to its sources' package in this tree. A failed build is reported and
  skipped, as pip does with these optional extensions: the daemon then uses its numpy
  fallbacks and says so in its log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_dirs(project: dict) -> dict[str, Path]:
    setuptools = project["tool"]["setuptools"]
    return {name: REPO / path for name, path in setuptools["package-dir"].items()}


def package_path(name: str, dirs: dict[str, Path]) -> Path:
    """Where package `name` lives in this tree: its own package-dir entry, or its
    nearest listed parent's folder joined with the rest of the name."""
    rest: list[str] = []
    while name not in dirs:
        name, _, last = name.rpartition(".")
        rest.insert(0, last)
    return dirs[name].joinpath(*rest)


def link_packages(dirs: dict[str, Path], target: Path) -> None:
    """kvdepot's own files are linked one by one (its folder is a real one, so the
    subpackages that live elsewhere can be linked into it)."""
    root = target / "kvdepot"
    if target.exists():
        shutil.rmtree(target)
    root.mkdir(parents=True)
    for entry in dirs["kvdepot"].iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name, path in sorted(dirs.items()):
        parts = name.split(".")[1:]
        if not parts:
            continue
        link = root.joinpath(*parts)
        if link.exists():  # already inside a linked folder (kvdepot.v1 in proto/kvdepot)
            if link.resolve() != path.resolve():
                raise SystemExit(f"{name}: {link} is {link.resolve()}, pyproject says {path}")
            continue
        link.symlink_to(path)
    print(f"mirrored {len(dirs)} packages under {target}")


def build_extensions(project: dict, dirs: dict[str, Path]) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for ext in project["tool"]["setuptools"].get("ext-modules", []):
        package, _, module = ext["name"].rpartition(".")
        out = package_path(package, dirs) / f"{module}{suffix}"
        if compiler is None:
            print(f"{ext['name']}: no C compiler here; the numpy fallback will be used")
            continue
        sources = [str(REPO / s) for s in ext["sources"]]
        cmd = [compiler, "-O3", "-fPIC", "-shared", "-DNDEBUG", f"-I{include}", *sources]
        done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True)
        if done.returncode == 0:
            print(f"{ext['name']}: built {out.relative_to(REPO)}")
        else:
            print(f"{ext['name']}: build failed, the numpy fallback will be used\n{done.stderr}")


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvdepot-pkg")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs = package_dirs(project)
    link_packages(dirs, target)
    build_extensions(project, dirs)


if __name__ == "__main__":
    main()
