"""The deployment files: systemd unit, its environment file, Kubernetes manifests.

Checked with the tools that will read them (systemd-analyze, the Kubernetes JSON schemas via
kubernetes-validate, yamllint), and for agreement with each other and with the daemon's
settings: the socket path, the settings' names, sizes. A missing tool fails the test with
what to install; it never skips, so a green run means the files were checked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "kvdepot.service"
ENV_FILE = DEPLOY / "systemd" / "kvdepot.env"
K8S = DEPLOY / "k8s"
YAMLLINT_CONFIG = REPO / ".yamllint"

# The settings `kvdepot serve` reads from the environment, one per flag (docs/architecture.md
# §11). test_known_settings_match_the_daemon keeps this list honest.
KNOWN_SETTINGS = frozenset(
    {
        "KVDEPOT_SOCKET",
        "KVDEPOT_LISTEN",
        "KVDEPOT_POOL_SIZE",
        "KVDEPOT_POOL_FILE",
        "KVDEPOT_METRICS_PORT",
        "KVDEPOT_METRICS_ADDR",
        "KVDEPOT_METRICS_TOKEN_FILE",
        "KVDEPOT_KV_EVENTS",
        "KVDEPOT_KV_EVENTS_TOPIC",
        "KVDEPOT_MAX_SESSIONS",
        "KVDEPOT_MAX_REGISTRATIONS_PER_SESSION",
        "KVDEPOT_MAX_SESSIONS_PER_PID",
        "KVDEPOT_MAX_SESSIONS_PER_UID",
        "KVDEPOT_MAX_UNATTESTED_SESSIONS",
        "KVDEPOT_MAX_CALLS_PER_PID",
        "KVDEPOT_MAX_CALLS_PER_UID",
        "KVDEPOT_MAX_POOL_HELD",
        "KVDEPOT_PVM",
        "KVDEPOT_MAX_PINNED_PER_SESSION",
        "KVDEPOT_MAX_WRITING_PER_SESSION",
        "KVDEPOT_MAX_WATCHES_PER_SESSION",
        "KVDEPOT_FD_RESERVE",
        "KVDEPOT_LOG_LEVEL",
        "KVDEPOT_SOCKET_MODE",
        "KVDEPOT_SOCKET_GROUP",
        "KVDEPOT_ADMIN_SOCKET",
        "KVDEPOT_ADMIN_GROUP",
        "KVDEPOT_TLS_CERT",
        "KVDEPOT_TLS_KEY",
        "KVDEPOT_TLS_CLIENT_CA",
        "KVDEPOT_NO_DESTRUCTIVE_ADMIN",
        "KVDEPOT_COPY_THREADS",
        "KVDEPOT_GPU_COPY_THREADS",
        "KVDEPOT_NUMA",
        "KVDEPOT_SHARDS",
        "KVDEPOT_MAX_JOB_KEYS",
        "KVDEPOT_MAX_JOB_BLOCKS",
        "KVDEPOT_MAX_JOB_PAGES",
        "KVDEPOT_MAX_BATCH_KEYS",
        "KVDEPOT_NAMESPACE_SHARE",
        "KVDEPOT_RESERVATION_TIMEOUT",
        "KVDEPOT_EVICTION_POLICY",
        "KVDEPOT_REMOTE",
        "KVDEPOT_REMOTE_PASSWORD",
        "KVDEPOT_REMOTE_PASSWORD_FILE",
        "KVDEPOT_REMOTE_CA_FILE",
        "KVDEPOT_REMOTE_TTL",
        "KVDEPOT_REMOTE_WRITE",
        "KVDEPOT_REMOTE_MAX_INFLIGHT_BYTES",
        "KVDEPOT_REMOTE_KEY_FILE",
        "KVDEPOT_DISK",
        "KVDEPOT_DISK_SIZE",
        "KVDEPOT_DISK_WRITE",
        "KVDEPOT_DISK_WRITE_PRIORITY",
        "KVDEPOT_REMOTE_INSECURE",
    }
)
# What the connector reads from an engine container's environment.
CONNECTOR_SETTINGS = frozenset({"KVDEPOT_NAMESPACE_SALT"})

SOCKET_PATH = "/run/kvdepot/kvdepot.sock"
SOCKET_URI = "unix://" + SOCKET_PATH
# Native sidecars (init containers with restartPolicy: Always) are GA from 1.33; the schema
# of 1.27 and older rejects the field, which the manifests rely on.
K8S_VERSION = "1.33.0"

EXPECTED_KV_TRANSFER_CONFIG = {
    "kv_connector": "KVDepotConnector",
    "kv_connector_module_path": "kvdepot.client.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"kvdepot_socket": SOCKET_URI},
}


# --- helpers ------------------------------------------------------------------------------


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail(
            "systemd-analyze not found on PATH: install Debian's `systemd` package "
            "(apt-get install systemd); the unit file cannot be checked without it"
        )
    return tool


def _unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order; systemd allows repeated keys."""
    entries = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert not line.endswith("\\"), f"continuation lines make the unit hard to read: {raw}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {raw!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def _unit_values(key: str, section: str = "Service") -> list[str]:
    entries = _unit_entries(UNIT.read_text())
    return [v for s, k, v in entries if s == section and k == key]


def _unit_value(key: str, section: str = "Service") -> str:
    values = _unit_values(key, section)
    assert len(values) == 1, f"{key}= in [{section}]: expected once, found {values}"
    return values[0]


def _verifiable_copy(directory: Path, unit_text: str | None = None) -> Path:
    """A copy of the unit whose ExecStart binary exists on this machine.

    systemd-analyze verify rejects an ExecStart= whose executable is missing, and
    /usr/local/bin/kvdepot only exists where the daemon is installed. The kvdepot console
    script of this environment, or the running Python, stands in; nothing else changes.
    """
    text = UNIT.read_text() if unit_text is None else unit_text
    stand_in = shutil.which("kvdepot") or sys.executable
    new, count = re.subn(
        r"^ExecStart=/usr/local/bin/kvdepot\b", f"ExecStart={stand_in}", text, flags=re.M
    )
    assert count == 1, "ExecStart=/usr/local/bin/kvdepot ... not found in the unit"
    copy = directory / "kvdepot.service"
    copy.write_text(new)
    return copy


def _run_verify(unit: Path) -> tuple[int, list[str]]:
    """systemd-analyze verify on `unit`; returns (exit status, diagnostics about our unit).

    verify exits 0 after many problems it merely logs (an unknown key, a value it cannot
    parse, which systemd then ignores), so the diagnostics count as failures too. Lines about
    other units (dependencies installed on this machine) are not ours to fix.
    """
    proc = subprocess.run(
        [_systemd_analyze(), "verify", "--man=no", "--recursive-errors=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    ours = [line for line in lines if unit.name in line or str(unit) in line]
    return proc.returncode, ours


def _load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    yaml = _require("yaml", "PyYAML")
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def _require(module: str, package: str) -> Any:
    """Import a test tool, failing (not skipping) with what to install when it is missing."""
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(
            f"{package} is not installed: pip install -e '.[test]' (or pip install {package})"
        )


def _manifests() -> list[Path]:
    files = sorted(K8S.glob("*.yaml")) + sorted(K8S.glob("*.yml"))
    assert files, f"no manifests under {K8S}"
    return files


def _objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _manifests():
        for doc in _load_yaml_documents(path):
            yield path, doc


def _object(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in _objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def _container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name!r}")


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _mount_volume(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that `container` mounts at `path`."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == path]
    assert len(names) == 1, f"{container['name']} mounts nothing (or twice) at {path}"
    (volume,) = [v for v in spec["volumes"] if v["name"] == names[0]]
    return volume


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


def _bytes(quantity: str) -> int:
    """512MiB, 64GiB (kvdepot) or 36Gi, 1G (Kubernetes) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmgt]i?)?b?", quantity.strip(), flags=re.I)
    assert m, f"cannot read size {quantity!r}"
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def _assert_health_probes(container: dict[str, Any]) -> None:
    socket_path = _env(container)["KVDEPOT_SOCKET"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:3] == ["kvdepot", "status", "--probe"], (probe, command)
        assert f"--socket={socket_path}" in command, (probe, command)


def _kv_transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    args = container["args"]
    i = args.index("--kv-transfer-config")
    return json.loads(args[i + 1])


# --- systemd unit -------------------------------------------------------------------------


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    copy = _verifiable_copy(tmp_path)
    status, diagnostics = _run_verify(copy)
    if any(re.search(r"\b(user|group)\b", d, flags=re.I) for d in diagnostics):
        # Some systemd versions may resolve User=/Group= during verify, and the kvdepot
        # account only exists where the unit is installed (deploy/README.md creates it).
        # Only then, and only for that, retry with this machine's own user and group: every
        # other diagnostic still fails the test.
        import grp
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(os.getgid()).gr_name
        text = copy.read_text()
        text = re.sub(r"^User=kvdepot$", f"User={user}", text, flags=re.M)
        text = re.sub(r"^Group=kvdepot$", f"Group={group}", text, flags=re.M)
        copy.write_text(text)
        status, diagnostics = _run_verify(copy)
    assert status == 0 and not diagnostics, "\n".join(diagnostics) or f"exit status {status}"


def test_verify_would_catch_a_broken_unit(tmp_path: Path) -> None:
    # The check above is only worth something if verify's logged complaints are caught.
    broken = UNIT.read_text().replace("Type=notify", "Type=notify-typo\nWatchdgSec=30", 1)
    status, diagnostics = _run_verify(_verifiable_copy(tmp_path, broken))
    assert status != 0 or diagnostics


def test_unit_hardening_exposure(tmp_path: Path) -> None:
    # systemd's own review of the sandboxing (0 = locked down, 10 = none). The unit scores
    # 3.5 ("OK") on systemd 252; this fails if hardening options get lost.
    copy = _verifiable_copy(tmp_path)
    proc = subprocess.run(
        [_systemd_analyze(), "security", "--offline=yes", "--threshold=40", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_unit_settings() -> None:
    assert _unit_value("Type") == "notify"
    assert _unit_value("NotifyAccess") == "main"
    assert _unit_value("ExecStart") == "/usr/local/bin/kvdepot serve"
    assert _unit_value("EnvironmentFile") == "-/etc/kvdepot/kvdepot.env"
    assert _unit_value("RuntimeDirectory") == "kvdepot"
    # The socket directory goes away on stop; nothing may keep it.
    assert _unit_values("RuntimeDirectoryPreserve") == []
    assert _unit_value("WatchdogSec") == "30"
    assert _unit_value("LimitMEMLOCK") == "infinity"
    assert _unit_value("Restart") == "on-failure"
    assert _unit_value("User") == "kvdepot"
    assert _unit_value("Group") == "kvdepot"
    assert _unit_value("RemoveIPC") == "no"  # the pool file in /dev/shm outlives a restart
    assert "/dev/shm" in _unit_value("ReadWritePaths").split()
    assert _unit_value("MemoryDenyWriteExecute") == "no"  # the CUDA driver's JIT needs W+X
    assert any(v.startswith("char-nvidia") for v in _unit_values("DeviceAllow"))
    assert set(_unit_value("RestrictAddressFamilies").split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
    }
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectControlGroups",
        "RestrictNamespaces",
        "LockPersonality",
    ):
        assert _unit_value(key) == "yes", key
    assert _unit_value("ProtectSystem") == "strict"
    assert _unit_value("SystemCallArchitectures") == "native"
    start_timeout = _unit_value("TimeoutStartSec")
    assert int(start_timeout) >= 60, "a cold start imports torch and initialises CUDA"


def test_unit_documentation_is_installed_with_it() -> None:
    # Documentation= names files that deploy/README.md's install steps put there.
    docs = _unit_values("Documentation", "Unit")
    assert docs, "no Documentation="
    readme = (DEPLOY / "README.md").read_text()
    for uri in docs:
        assert uri.startswith("file:/"), uri
        path = uri.removeprefix("file:")
        m = re.search(rf"install -D -m 0644 (\S+) {re.escape(path)}\b", readme)
        assert m, f"deploy/README.md does not install {path}"
        assert (REPO / m.group(1)).is_file(), m.group(1)


def test_manifest_probe_checks_a_live_daemon(daemon_factory: Any) -> None:
    # The probes' command, run as Kubernetes would (its socket path swapped for a test
    # daemon's): exit 0 while the daemon serves, non-zero once it is gone.
    spec = _pod_spec(_object("DaemonSet", "kvdepot"))
    command = _container(spec, "kvdepot")["livenessProbe"]["exec"]["command"]
    d = daemon_factory("--pool-size", "16MiB")
    live = [c.replace(SOCKET_PATH, d.socket_path) for c in command]
    assert live[0] == "kvdepot"
    exe = shutil.which("kvdepot", path=str(Path(sys.executable).parent)) or "kvdepot"
    run = [exe, *live[1:]]
    assert subprocess.run(run, capture_output=True, timeout=60).returncode == 0
    d.stop()
    gone = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "kvdepot status:" in gone.stderr


def test_unit_socket_is_in_runtime_directory() -> None:
    env = dict(v.split("=", 1) for v in _unit_values("Environment"))
    assert env["KVDEPOT_SOCKET"] == SOCKET_PATH
    assert Path(SOCKET_PATH).parent == Path("/run") / _unit_value("RuntimeDirectory")
    assert {k for k in env if k.startswith("KVDEPOT_")} <= KNOWN_SETTINGS


# --- environment file ---------------------------------------------------------------------


def test_env_file_names_exactly_the_known_settings() -> None:
    documented: list[str] = []
    for number, raw in enumerate(ENV_FILE.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        # Everything is commented out: the file documents, the daemon's defaults decide.
        assert line.startswith("#"), f"{ENV_FILE.name}:{number}: not commented out: {raw}"
        m = re.fullmatch(r"#\s*([A-Z][A-Z0-9_]*)=(.*)", line)
        if m:
            assert not m.group(2).startswith((" ", "'", '"')), f"line {number}: {raw}"
            documented.append(m.group(1))
    assert len(documented) == len(set(documented)), f"listed twice: {documented}"
    unknown = set(documented) - KNOWN_SETTINGS
    assert not unknown, f"the daemon does not read {sorted(unknown)}"
    missing = KNOWN_SETTINGS - set(documented)
    assert not missing, f"not documented in {ENV_FILE.name}: {sorted(missing)}"


def test_known_settings_match_the_daemon() -> None:
    # `kvdepot serve --help` names the variable behind each flag; the list above, and so
    # the env file, must name the same ones: a new flag gets documented, a removed one goes.
    import argparse

    try:
        from kvdepot.server.config import add_serve_arguments
    except ImportError as exc:
        pytest.fail(f"cannot import kvdepot.server.config ({exc}): pip install -e '.[test]'")
    parser = argparse.ArgumentParser(prog="kvdepot serve")
    add_serve_arguments(parser)
    in_help = set(re.findall(r"\bKVDEPOT_[A-Z0-9_]+", parser.format_help()))
    assert in_help == KNOWN_SETTINGS, (
        f"daemon only: {sorted(in_help - KNOWN_SETTINGS)}; "
        f"listed here only: {sorted(KNOWN_SETTINGS - in_help)}"
    )


def test_env_file_parses_when_uncommented(tmp_path: Path) -> None:
    # Uncommenting every line must give a valid EnvironmentFile: KEY=value, nothing more.
    text = "\n".join(
        line[1:] if re.match(r"#KVDEPOT_", line) else line
        for line in ENV_FILE.read_text().splitlines()
    )
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"KVDEPOT_[A-Z_]+=\S*", line), line


def test_manifests_name_only_known_settings() -> None:
    for path, obj in _objects():
        if obj["kind"] not in {"Pod", "Deployment", "DaemonSet", "StatefulSet"}:
            continue
        spec = _pod_spec(obj)
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            names = {n for n in _env(c) if n.startswith("KVDEPOT_")}
            known = KNOWN_SETTINGS | CONNECTOR_SETTINGS
            assert names <= known, (path.name, c["name"], names - known)


def test_engines_get_the_deployments_namespace_salt() -> None:
    """Every vLLM container reads the deployment's salt from a Secret, and the connector
    takes it as kvdepot_namespace_salt's default: its namespace ids cannot be computed,
    or declared first with another layout, by anyone else on the node."""
    from kvdepot.client.vllm.config import DepotSettings

    engines = 0
    for path, obj in _objects():
        if obj["kind"] not in {"Pod", "Deployment"}:
            continue
        vllm = _container(_pod_spec(obj), "vllm")
        (salt,) = [e for e in vllm["env"] if e["name"] == "KVDEPOT_NAMESPACE_SALT"]
        assert salt["valueFrom"]["secretKeyRef"]["name"] == "kvdepot-namespace-salt", path.name
        engines += 1
    assert engines == 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVDEPOT_NAMESPACE_SALT", "deployment-salt")
        assert DepotSettings.from_extra_config({}).namespace_salt == "deployment-salt"
        named = {"kvdepot_namespace_salt": "v2"}
        assert DepotSettings.from_extra_config(named).namespace_salt == "v2"
        mp.delenv("KVDEPOT_NAMESPACE_SALT")
        assert DepotSettings.from_extra_config({}).namespace_salt == ""


# --- Kubernetes manifests -----------------------------------------------------------------


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(path: Path) -> None:
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    errors = []
    for doc in _load_yaml_documents(path):
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")
    assert not errors, f"{path.name} against Kubernetes {K8S_VERSION}:\n" + "\n".join(errors)


def test_native_sidecar_needs_the_schema_that_knows_it() -> None:
    # Guards the choice of K8S_VERSION: with an older schema the sidecar must be rejected,
    # showing that strict validation does look at initContainers[].restartPolicy.
    kubernetes_validate = _require("kubernetes_validate", "kubernetes-validate")
    doc = _object("Deployment", "vllm-kvdepot")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(doc, "1.27.0", strict=True)


def test_yaml_passes_yamllint() -> None:
    _require("yamllint", "yamllint")
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    assert YAMLLINT_CONFIG.is_file(), "the repository's .yamllint is missing"
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    problems = []
    for path in [*_manifests(), YAMLLINT_CONFIG]:
        # Strict, like `yamllint --strict`: warnings fail too.
        for p in linter.run(path.read_text(), config, str(path)):
            problems.append(f"{path.relative_to(REPO)}:{p.line}:{p.column}: {p.level}: {p.message}")
    assert not problems, "\n".join(problems)


def test_sidecar_pod_wiring() -> None:
    obj = _object("Deployment", "vllm-kvdepot")
    spec = _pod_spec(obj)
    assert spec["shareProcessNamespace"] is True

    (sidecar,) = spec["initContainers"]
    assert sidecar["name"] == "kvdepot"
    assert sidecar["restartPolicy"] == "Always"  # native sidecar
    assert sidecar["image"] == "localhost/kvdepot:0.1.0"  # deploy/docker/kvdepot.Dockerfile
    env = _env(sidecar)
    assert env["KVDEPOT_SOCKET"] == SOCKET_PATH
    _assert_health_probes(sidecar)

    vllm = _container(spec, "vllm")
    assert vllm["image"] == "localhost/vllm-kvdepot:0.33.0"  # vLLM with the kvdepot client
    assert vllm["command"] == ["vllm", "serve"]
    assert _kv_transfer_config(vllm) == EXPECTED_KV_TRANSFER_CONFIG

    # One socket directory, an emptyDir, in both containers.
    run_daemon = _mount_volume(spec, sidecar, "/run/kvdepot")
    run_vllm = _mount_volume(spec, vllm, "/run/kvdepot")
    assert run_daemon is run_vllm
    assert "emptyDir" in run_daemon

    # The pool lives in a sized, memory-backed /dev/shm that holds it, and the daemon's
    # memory limit covers it (the tmpfs pages are charged to the daemon's container).
    shm = _mount_volume(spec, sidecar, "/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    pool = _bytes(env["KVDEPOT_POOL_SIZE"])
    assert env["KVDEPOT_POOL_FILE"].startswith("/dev/shm/")
    assert pool < _bytes(shm["emptyDir"]["sizeLimit"])
    assert pool < _bytes(sidecar["resources"]["limits"]["memory"])
    assert _mount_volume(spec, vllm, "/dev/shm") is shm


def test_daemonset_wiring() -> None:
    obj = _object("DaemonSet", "kvdepot")
    spec = _pod_spec(obj)
    assert spec["hostIPC"] is True
    daemon = _container(spec, "kvdepot")
    env = _env(daemon)
    assert env["KVDEPOT_SOCKET"] == SOCKET_PATH
    _assert_health_probes(daemon)
    run = _mount_volume(spec, daemon, "/run/kvdepot")
    assert run["hostPath"] == {"path": "/run/kvdepot", "type": "DirectoryOrCreate"}

    pool_dir = str(Path(env["KVDEPOT_POOL_FILE"]).parent)
    pool_volume = _mount_volume(spec, daemon, pool_dir)
    assert pool_volume.get("hostPath", {}).get("path", "").startswith("/dev/shm") or (
        pool_volume.get("emptyDir", {}).get("medium") == "Memory"
    )
    assert _bytes(env["KVDEPOT_POOL_SIZE"]) < _bytes(daemon["resources"]["limits"]["memory"])


def test_daemonset_metrics_port_is_reachable_from_the_monitoring_namespace_alone() -> None:
    """The DaemonSet binds its metrics port to 0.0.0.0; its NetworkPolicy admits only the
    monitoring namespace, on that port, to the daemon's pods."""
    daemon = _container(_pod_spec(_object("DaemonSet", "kvdepot")), "kvdepot")
    assert _env(daemon)["KVDEPOT_METRICS_ADDR"] == "0.0.0.0"
    port = int(_env(daemon)["KVDEPOT_METRICS_PORT"])
    policy = _object("NetworkPolicy", "kvdepot-metrics")
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == "kvdepot"
    assert spec["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvdepot"}
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    (peer,) = rule["from"]
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }


def test_pods_are_hardened() -> None:
    # Every pod: the runtime's default seccomp filter, and no service-account token (nothing
    # in these pods talks to the Kubernetes API; a token would be a credential to steal).
    pods = [(p, d) for p, d in _objects() if d["kind"] in ("Pod", "Deployment", "DaemonSet")]
    assert len(pods) == 3, [d["metadata"]["name"] for _, d in pods]
    for path, obj in pods:
        spec = _pod_spec(obj)
        assert spec.get("automountServiceAccountToken") is False, path.name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, path.name


def test_admin_socket_is_the_daemon_containers_alone() -> None:
    # The operator socket (Admin) lies in a volume that only the daemon's container mounts,
    # not in the socket directory the engines share: no engine reaches it, even as root.
    for kind, name, daemon_name in (
        ("DaemonSet", "kvdepot", "kvdepot"),
        ("Deployment", "vllm-kvdepot", "kvdepot"),
    ):
        spec = _pod_spec(_object(kind, name))
        daemon = _container(spec, daemon_name)
        admin_dir = str(Path(_env(daemon)["KVDEPOT_ADMIN_SOCKET"]).parent)
        assert admin_dir != str(Path(SOCKET_PATH).parent)
        volume = _mount_volume(spec, daemon, admin_dir)
        others = spec.get("initContainers", []) + spec.get("containers", [])
        for c in others:
            if c is not daemon:
                mounted = {m["name"] for m in c.get("volumeMounts", [])}
                assert volume["name"] not in mounted, (name, c["name"])
    # Under systemd: beside the data socket, in the runtime directory (0600 there).
    env = dict(v.split("=", 1) for v in _unit_values("Environment"))
    assert env["KVDEPOT_ADMIN_SOCKET"] == SOCKET_PATH + ".admin"


def test_node_daemon_client_pod_wiring() -> None:
    obj = _object("Pod", "vllm-node-kvdepot")
    spec = _pod_spec(obj)
    # Same IPC (and PID) namespace as the daemon: the host's.
    assert spec["hostIPC"] is True
    assert spec["hostPID"] is True
    daemonset = _pod_spec(_object("DaemonSet", "kvdepot"))
    assert daemonset["hostPID"] is True
    vllm = _container(spec, "vllm")
    assert _kv_transfer_config(vllm) == EXPECTED_KV_TRANSFER_CONFIG
    run = _mount_volume(spec, vllm, "/run/kvdepot")
    assert run["hostPath"]["path"] == "/run/kvdepot"
    # The client pod is in the daemon's group, which owns the socket.
    daemon = _container(daemonset, "kvdepot")
    assert daemon["securityContext"]["runAsGroup"] in spec["securityContext"]["supplementalGroups"]
