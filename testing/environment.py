"""What every synthetic-engine run needs around it: deterministic prompts, the
environment vLLM needs on a machine without a GPU, and the model config.

Standard library only: importing this module does not import vLLM (vLLM picks its
platform on first import, so `cpu_environment()` must be applied before that).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def prompt_for(seed: int, length: int) -> list[int]:
    """A deterministic prompt of `length` token ids (the same in every process)."""
    x = seed * 7919 + 1
    out = []
    for _ in range(length):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(10 + x % 30000)
    return out


def cpu_environment() -> dict[str, str]:
    """Environment variables vLLM needs to schedule on a machine without a GPU. They
    must be set before vllm is first imported (vLLM picks its platform then), so set
    them in the environment of the process, or before importing vLLM."""
    return dict(_CPU_ENV)


def find_model_dir(start: Path | None = None) -> Path:
    """The OPT-125m model config the tests use (`tests/data/hf-config-opt-125m` in the
    repository), or the directory named by `KVDEPOT_TEST_MODEL_DIR`."""
    env = os.environ.get("KVDEPOT_TEST_MODEL_DIR")
    if env:
        return Path(env)
    here = (start or Path(__file__)).resolve()
    for parent in [here, *here.parents]:
        candidate = parent / "tests" / "data" / "hf-config-opt-125m"
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        "tests/data/hf-config-opt-125m not found (run from a kvdepot checkout, or set "
        "KVDEPOT_TEST_MODEL_DIR to a directory holding a Hugging Face config.json)"
    )


def model_dir_for_tp(tp: int, dest: Path) -> Path:
    """The test model's config where `tp` ranks can split its attention heads: the
    model itself when they can (OPT-125m's 12 heads: TP 1, 2, 3, 4, 6, 12), else a copy
    in `dest` with the fewest heads `tp` divides that still divide its hidden size (TP=8:
    24 heads of 32). The scheduler's work does not depend on the heads; vLLM only checks
    that the ranks can split them. ValueError when no head count fits."""
    source = find_model_dir()
    config = json.loads((source / "config.json").read_text())
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if heads % tp == 0:
        return source
    wanted = math.lcm(heads, tp)
    if hidden % wanted:
        raise ValueError(
            f"the test model ({heads} attention heads, hidden size {hidden}) cannot be "
            f"split over {tp} ranks"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({**config, "num_attention_heads": wanted}))
    return dest
