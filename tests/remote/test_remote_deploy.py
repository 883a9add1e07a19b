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


def test_yamllint_strict() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig(file=str(REPO / ".yamllint"))
    for path in sorted(REMOTE.glob("*.yaml")):
        problems = list(linter.run(path.read_text(), conf, str(path)))
        assert not problems, (path, problems)
