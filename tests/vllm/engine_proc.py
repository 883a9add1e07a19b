"""A second vLLM engine in its own process (test scenario 5).

    python -m tests.vllm.engine_proc --socket unix:///... --prompt-seed 7 --length 160

Builds a SyntheticEngine (real Scheduler and worker connector, memfd KV), runs one
prompt, waits until its chunks are ready in the daemon, and prints one JSON line:
{"namespace": ..., "keys": [hex, ...], "external_tokens": n, "digest": sha256 of the
prompt's full blocks}. Then it exits, ending its session (the blocks stay).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

for _k, _v in (
    ("VLLM_TARGET_DEVICE", "cpu"),
    ("HF_HUB_OFFLINE", "1"),
    ("VLLM_LOGGING_LEVEL", "WARNING"),
):
    os.environ.setdefault(_k, _v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--prompt-seed", type=int, default=7)
    ap.add_argument("--length", type=int, default=160)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--salt", default="")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)

    from kvdepot.testing.vllm_engine import EngineConfig, SyntheticEngine, prompt_for

    engine = SyntheticEngine(
        EngineConfig(
            socket=args.socket,
            dtype=args.dtype,
            salt=args.salt,
            model_dir=args.model_dir,
            num_gpu_blocks=64,
        )
    )
    try:
        engine.wait_registered()
        prompt = prompt_for(args.prompt_seed, args.length)
        [rec] = engine.generate([prompt])
        keys = engine.offload_keys(prompt)
        engine.wait_ready(keys)
        full = len(prompt) // 16
        digest = engine.kv_digest(0, 0, rec.block_ids[0][:full])
        print(
            json.dumps(
                {
                    "namespace": engine.manager.namespace_id,
                    "keys": [k.hex() for k in keys],
                    "external_tokens": rec.external_tokens,
                    "digest": digest,
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
    finally:
        engine.shutdown()
    return 0


def run_engine_process(socket: str, prompt_seed: int, length: int = 160) -> dict[str, Any]:
    """Runs this module in a new process against the daemon at `socket` (the test's
    model config, the CPU environment) and returns the JSON line it printed."""
    from kvdepot.testing.environment import cpu_environment, find_model_dir

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable, "-m", "tests.vllm.engine_proc",
            "--socket", socket,
            "--prompt-seed", str(prompt_seed),
            "--length", str(length),
            "--model-dir", str(find_model_dir(repo / "tests")),
        ],
        cwd=repo,
        env={**os.environ, **cpu_environment(), "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
