"""The Kubernetes example for the remote tier: lint-clean, a patch of the real
DaemonSet, and every variable it sets is a setting the daemon reads."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvdepot.server.config import settings

REPO = Path(__file__).resolve().parents[2]
REMOTE = REPO / "deploy" / "k8s" / "remote"


def test_patch_targets_the_daemonset_and_sets_known_variables() -> None:
    kust = yaml.safe_load((REMOTE / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../kvdepot-daemonset.yaml"]
    base = [d for d in yaml.safe_load_all((REMOTE / kust["resources"][0]).read_text()) if d]
    (ds,) = [d for d in base if d["kind"] == "DaemonSet"]
    (patch_path,) = [p["path"] for p in kust["patches"]]
    patch = yaml.safe_load((REMOTE / patch_path).read_text())
    assert (patch["kind"], patch["metadata"]["name"], patch["metadata"]["namespace"]) == (
        ds["kind"],
        ds["metadata"]["name"],
        ds["metadata"]["namespace"],
    )
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    names = [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]]
    assert container["name"] in names
    known = {s.env for _, s in settings()} | {"KVDEPOT_REMOTE_PASSWORD"}
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= known, set(env) - known
    # The password comes from a Secret, never a literal.
    assert "value" not in env["KVDEPOT_REMOTE_PASSWORD"]
    assert env["KVDEPOT_REMOTE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    # The values parse as the daemon would parse them.
    by_env = {s.env: s for _, s in settings()}
    for name, e in env.items():
        if "value" in e:
            by_env[name].from_env(e["value"])
    # TLS to the store, and the fleet key: without it the daemon refuses to start.
    assert env["KVDEPOT_REMOTE"]["value"].startswith("rediss://")
    assert "KVDEPOT_REMOTE_INSECURE" not in env
    key_path = Path(env["KVDEPOT_REMOTE_KEY_FILE"]["value"])
    spec = patch["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    key_volume = volumes[mounts[str(key_path.parent)]]
    assert key_volume["emptyDir"]["medium"] == "Memory"  # never on a disk
    # The init container copies the Secret's key there as the daemon's user, mode 0400
    # (a Secret's files are root's; the daemon refuses a key file others can read).
    (init,) = [c for c in spec["initContainers"] if c["name"] == "fleet-key"]
    script = " ".join(init["command"])
    daemon_uid = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsUser"]
    assert f"-o {daemon_uid}" in script and "-m 0400" in script and str(key_path) in script
    secret_mount = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    (secret_volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert secret_volume["secret"]["defaultMode"] == 0o400
    assert f"{secret_mount[secret_volume['name']]}/fleet.key" in script


def test_yamllint_strict() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig(file=str(REPO / ".yamllint"))
    for path in sorted(REMOTE.glob("*.yaml")):
        problems = list(linter.run(path.read_text(), conf, str(path)))
        assert not problems, (path, problems)
