"""Small models with seeded random weights, saved as safetensors, for real vLLM engines.

No weights can be downloaded in the test environment, and vLLM's `load_format="dummy"`
generates token 0 forever. A model built from a config.json with seeded random weights
(normal, std 0.02) gives real, deterministic, prompt-dependent outputs: exactly what
comparing an engine with and without kvdepot needs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"

#: name -> config directory under tests/data
CONFIGS = {
    "opt": DATA / "hf-config-opt-125m",  # OPT-125m shape: 12 layers, 9 MiB per 128-token block
    "gemma3-hybrid": DATA / "hf-config-gemma3-hybrid",  # sliding-window + full attention
}


def build_model(name: str, out_dir: Path, seed: int = 1234) -> Path:
    """Writes config.json and model.safetensors (float32) into out_dir; returns out_dir.

    Idempotent: an existing complete model in out_dir is reused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    raw = json.loads((CONFIGS[name] / "config.json").read_text())
    raw["torch_dtype"] = "float32"
    tmp = out_dir / "_config"
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(raw))
    config = AutoConfig.from_pretrained(tmp)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(out_dir, safe_serialization=True)
    shutil.rmtree(tmp)
    return out_dir
