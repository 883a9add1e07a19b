"""The namespace's model identity: the same weights in two directories are one model;
other weights, or another config, are another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvdepot.client.vllm.model_identity import model_identity


def make_model(root: Path, weights: bytes, **config: object) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(
        json.dumps({"model_type": "opt", "hidden_size": 64, "_name_or_path": str(root), **config})
    )
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_same_model_in_two_places_is_one_identity(tmp_path: Path) -> None:
    weights = bytes(range(256)) * 4096  # 1 MiB
    a = make_model(tmp_path / "mnt-a" / "opt", weights)
    b = tmp_path / "mnt-b" / "copy-of-opt"
    shutil.copytree(a, b)
    (b / "config.json").write_text(
        json.dumps({"model_type": "opt", "hidden_size": 64, "_name_or_path": str(b)})
    )
    assert model_identity(str(a)) == model_identity(str(b))
    assert model_identity(str(a)).startswith("local:")


def test_other_weights_or_config_are_another_model(tmp_path: Path) -> None:
    weights = bytearray(bytes(range(256)) * 4096)
    base = model_identity(str(make_model(tmp_path / "base", bytes(weights))))
    changed = bytearray(weights)
    changed[len(changed) // 2] ^= 0xFF  # one byte in the middle sample
    assert model_identity(str(make_model(tmp_path / "tuned", bytes(changed)))) != base
    assert (
        model_identity(str(make_model(tmp_path / "wider", bytes(weights), hidden_size=128))) != base
    )
    assert model_identity(str(make_model(tmp_path / "longer", bytes(weights) + b"\0"))) != base


def test_a_hub_id_is_its_own_identity() -> None:
    assert model_identity("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
