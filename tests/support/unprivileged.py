"""Processes run as uid 65534 (nobody): with no groups and no capabilities, from an
environment that uid may read.

The checkout and its `.venv` may sit in a directory only their owner may enter (a
`git clone` into root's home is 0700), so a process run as another uid cannot start the
checkout's interpreter, read its site-packages or its `kvdepot` script. `nobody_python()`
builds, once per test process, a copy it can read: a venv in a world-readable directory
under /tmp, made from an interpreter of this Python version that every user may run,
holding kvdepot (this checkout's code and C extensions) and the daemon's dependencies,
and beside it the tests package's sources (`nobody_script`: a test's helper script),
copied (hard-linked where the filesystem allows and the file is readable to all
already) from this interpreter's environment.
It goes when the process exits. Nothing of the checkout is on its path: an unprivileged
process reads only what every user may read there, as it would in a real deployment.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.daemon import DaemonProcess

NOBODY = 65534
# The command prefix that runs a process as uid/gid 65534, no groups, no capabilities.
AS_NOBODY = (
    "setpriv",
    f"--reuid={NOBODY}",
    f"--regid={NOBODY}",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
)
# What the processes run as nobody import: the daemon (`kvdepot serve`, `kvdepot status`)
# and the probes of the security tests (grpc, grpc_health, kvdepot.v1).
EXTRAS = ("server", "disk")
ROOT = Path(__file__).resolve().parents[2]


def nobody_kvdepot() -> list[str]:
    """`kvdepot` as uid 65534 runs it: the readable copy's interpreter and module."""
    return [nobody_python(), "-m", "kvdepot.server.cli"]


@functools.cache
def nobody_python() -> str:
    """The interpreter of a venv every user may read, with kvdepot and its daemon's
    dependencies; built on first use, removed at exit."""
    top = Path(tempfile.mkdtemp(prefix="kvd-nobody-env-", dir="/tmp"))
    atexit.register(shutil.rmtree, top, ignore_errors=True)
    os.chmod(top, 0o755)
    venv = top / "venv"
    subprocess.run(
        [other_users_interpreter(), "-m", "venv", "--without-pip", str(venv)],
        check=True,
        capture_output=True,
    )
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    for dist in dependencies():
        copy_distribution(dist, site)
    copy_kvdepot(site)
    copy_test_sources(top / "checkout")
    # Other users cannot write the bytecode caches: kvdepot's are made here (the
    # dependencies' came with their files).
    import compileall

    compileall.compile_dir(site / "kvdepot", quiet=1, workers=1)
    for path in [top, *top.rglob("*")]:  # every user reads and enters, nobody writes
        st = path.lstat()
        mode = st.st_mode
        if stat.S_ISLNK(mode) or (stat.S_ISREG(mode) and st.st_nlink > 1):
            continue  # a hard link: its mode is its original's (link_or_copy)
        extra = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) or mode & stat.S_IXUSR else 0)
        if mode & extra != extra:
            os.chmod(path, stat.S_IMODE(mode) | extra)
    return str(venv / "bin" / "python")


def nobody_script(script: Path) -> str:
    """A copy of this checkout's `script` (a file under tests/) that uid 65534 may read,
    beside a readable copy of the whole tests package (what it imports of it)."""
    checkout = Path(nobody_python()).parents[2] / "checkout"
    return str(checkout / Path(script).resolve().relative_to(ROOT))


def copy_test_sources(checkout: Path) -> None:
    """The tests package's Python sources, at their paths under `checkout`: scripts run
    as uid 65534 (tests/security/owners.py) import their helpers from it."""
    tests = ROOT / "tests"
    for path in sorted(tests.rglob("*.py")):
        if "__pycache__" not in path.parts:
            link_or_copy(path, checkout / path.relative_to(ROOT))


def readable_by_everyone(path: Path) -> bool:
    """Whether a user with no groups may open `path` and enter every directory above it."""
    path = path.resolve()
    if not path.is_file() or path.stat().st_mode & stat.S_IROTH == 0:
        return False
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)


def other_users_interpreter() -> str:
    """An interpreter of this Python version that every user may run: this one's base
    when its path allows (a pyenv build under a 0700 home does not), else the system's."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [
        getattr(sys, "_base_executable", sys.executable),
        f"/usr/local/bin/python{version}",
        f"/usr/bin/python{version}",
    ]
    for candidate in candidates:
        if readable_by_everyone(Path(candidate)):
            return candidate
    raise RuntimeError(
        f"no python{version} that uid {NOBODY} may run (tried {', '.join(candidates)}): "
        f"install Debian's python{version}"
    )


def dependencies() -> list[importlib.metadata.Distribution]:
    """The installed distributions kvdepot[server,disk] needs, recursively."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(req, set(EXTRAS)) for req in importlib.metadata.requires("kvdepot") or []]
    while todo:
        text, extras = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not any(
            req.marker.evaluate({"extra": extra}) for extra in (extras or {""})
        ):
            continue
        dist = importlib.metadata.distribution(req.name)
        key = dist.metadata["Name"].lower()
        if key in found or key == "kvdepot":
            continue
        found[key] = dist
        todo.extend((sub, set(req.extras)) for sub in dist.requires or [])
    return list(found.values())


def copy_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    """The files `dist` installed into its site-packages (not its scripts in bin/)."""
    if dist.files is None:
        raise RuntimeError(f"{dist.metadata['Name']} lists no files (no RECORD)")
    root = Path(str(dist.locate_file(""))).resolve()
    for file in dist.files:
        src = Path(str(dist.locate_file(file))).resolve()
        if not src.is_relative_to(root) or not src.is_file():
            continue
        link_or_copy(src, site / src.relative_to(root))


def copy_kvdepot(site: Path) -> None:
    """This checkout's kvdepot as it imports here (sources and built C extensions),
    each package of pyproject.toml's package-dir where this environment finds it."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for name in sorted(package_dirs):  # parents before their subpackages
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        src = Path(spec.submodule_search_locations[0])
        dst = site.joinpath(*name.split("."))
        for path in sorted(src.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            link_or_copy(path.resolve(), dst / path.relative_to(src))
    dist = importlib.metadata.distribution("kvdepot")
    info = Path(str(dist.locate_file(""))) / f"kvdepot-{dist.version}.dist-info"
    if info.is_dir():  # its entry points and version
        shutil.copytree(info, site / info.name, dirs_exist_ok=True)


def link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():  # a RECORD may name a file twice
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.stat().st_mode & stat.S_IROTH:  # linked only when a link changes no mode
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem
            pass
    shutil.copy2(src, dst)


@contextmanager
def unprivileged_daemon(*args: str) -> Iterator[DaemonProcess]:
    """Starts the daemon under setpriv as uid/gid 65534 (caller must be root)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        raise RuntimeError("needs root and setpriv (util-linux)")
    workdir = Path(f"/tmp/kvd-nobody-{os.getpid()}")
    workdir.mkdir(mode=0o777, exist_ok=True)
    os.chmod(workdir, 0o777)  # the daemon creates its sockets here
    d = DaemonProcess(
        workdir,
        *(args or ("--pool-size", "16MiB", "--pvm")),
        command=[*AS_NOBODY, *nobody_kvdepot()],
    )
    try:
        d.start()
        yield d
    finally:
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)
