"""A real vLLM engine (`vllm.LLM`) driven over stdin/stdout, one JSON object per line.

    python tests/engine/llm_runner.py '<json settings>'

Settings: {"model": DIR, "kv_transfer_config": {...} or null, "llm": {extra LLM kwargs}}.
Commands (stdin): {"op": "generate", "prompts": [[ids...]], "max_tokens": N,
"logprobs": K} -> {"outputs": [{"token_ids", "logprobs", "num_cached_tokens"}]};
{"op": "metrics"} -> {"metrics": {name{labels}: value}}; {"op": "reset_prefix_cache",
"reset_connector": bool} (vLLM's own cache, and the connector's when asked);
{"op": "reload_weights", "weights_path": DIR} (new weights in place); {"op": "exit"}.
Answers are stdout lines starting with MARK (vLLM logs to stdout too); the first is
{"ready": true} once the engine is up. The engine runs with vLLM's defaults apart from
what the settings say, stats logging on.
"""

from __future__ import annotations

import json
import sys

MARK = "@@kvdepot-runner "


def answer(obj: object) -> None:
    print(MARK + json.dumps(obj), flush=True)


def metric_values(llm) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Counters and gauges by 'name{k=v,...}' (histograms by their count)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k != "engine")
        key = f"{m.name}{{{labels}}}" if labels else m.name
        value = getattr(m, "value", None)
        if value is None:
            value = getattr(m, "count", 0)
        out[key] = out.get(key, 0.0) + float(value)
    return out


def main() -> None:
    settings = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs = {
        "model": settings["model"],
        "skip_tokenizer_init": True,
        "disable_log_stats": False,
        "seed": 0,
        **settings.get("llm", {}),
    }
    if settings.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = settings["kv_transfer_config"]
    llm = LLM(**kwargs)
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd["op"] == "reset_prefix_cache":
            reset = llm.reset_prefix_cache(reset_connector=cmd.get("reset_connector", False))
            answer({"reset": bool(reset)})
            continue
        if cmd["op"] == "reload_weights":  # a weight update, in place (as RL loops do it)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["weights_path"]})
            answer({"reloaded": True})
            continue
        if cmd["op"] == "metrics":
            answer({"metrics": metric_values(llm)})
            continue
        params = SamplingParams(
            temperature=0.0,
            max_tokens=cmd.get("max_tokens", 8),
            logprobs=cmd.get("logprobs", 1),
            detokenize=False,
        )
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]],
            params,
            use_tqdm=False,
        )
        outputs = []
        for r in results:
            c = r.outputs[0]
            steps = c.logprobs or []
            chosen = [float(s[t].logprob) for t, s in zip(c.token_ids, steps, strict=True)]
            outputs.append(
                {
                    "token_ids": list(c.token_ids),
                    "logprobs": chosen,
                    "num_cached_tokens": int(r.num_cached_tokens or 0),
                }
            )
        answer({"outputs": outputs})


if __name__ == "__main__":
    main()
