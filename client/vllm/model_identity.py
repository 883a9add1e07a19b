"""What a model is, independent of where its files lie.

Two engines that serve the same weights from different directories (two mounts of one
volume, a copy on local disk) compute the same KV bytes, so they must meet in the same
namespace; a path is no identity. A local model is identified by its config (less the
keys that only record where or by what it was saved) and a fingerprint of its weight
files: each file's name relative to the model directory, its size and a hash of three
64 KiB samples (start, middle, end). Reading a few hundred KiB per shard keeps start-up
fast, and any retrained or fine-tuned weights differ in every sample. A model named by a
hub id is identified by the id, which is the same everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

#: Files whose bytes decide the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")
#: config.json keys that record provenance, not the model.
_PROVENANCE_KEYS = ("_name_or_path", "_commit_hash", "transformers_version")
_SAMPLE = 64 * 1024


def _file_fingerprint(path: Path, digest: hashlib._Hash) -> None:
    size = path.stat().st_size
    digest.update(f"{size}:".encode())
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
            f.seek(offset)
            digest.update(f.read(_SAMPLE))


def _config_text(model_dir: Path) -> str:
    path = model_dir / "config.json"
    if not path.is_file():
        return ""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return path.read_bytes().hex()
    if isinstance(config, dict):
        for key in _PROVENANCE_KEYS:
            config.pop(key, None)
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=16)
def model_identity(name: str) -> str:
    """'local:' + 32 hex digits for a model directory or file, else the name itself."""
    path = Path(os.path.expanduser(name))
    if not path.exists():
        return name
    digest = hashlib.sha256()
    if path.is_file():
        _file_fingerprint(path, digest)
    else:
        digest.update(_config_text(path).encode())
        weights = sorted(
            p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        )
        for weight in weights:
            digest.update(str(weight.relative_to(path)).encode() + b"\0")
            _file_fingerprint(weight, digest)
    return "local:" + digest.hexdigest()[:32]
