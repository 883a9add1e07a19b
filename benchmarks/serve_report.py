"""The serving benchmark's figures: runs summed up in the issue's schema, the comparison
with vLLM alone, the targets, the table and the plots."""

from __future__ import annotations

from typing import Any

from kvdepot.bench.serve_client import RunResult
from kvdepot.bench.stats import median, percentile

#: the setup that every other is compared with
REFERENCE = "vllm"
#: setup name -> (kvdepot, baseline name in the runs list)
SETUPS = {
    "kvdepot": (True, None),
    "vllm": (False, "vllm"),
    "offload": (False, "vllm-offload"),
}


def run_row(run: RunResult, model: str, servers: int) -> dict[str, Any]:
    """One entry of the JSON's `runs` list: exactly the issue's fields."""
    ok = [r for r in run.results if not r.error]
    ttft = [1e3 * r.ttft_s for r in ok]
    itl = [1e3 * x for r in ok for x in r.itl_s]
    tokens = sum(len(r.request.prompt) + len(r.token_ids) for r in ok)
    kvdepot, baseline = SETUPS[run.setup]
    return {
        "workload": run.workload,
        "model": model,
        "servers": servers,
        "kvdepot": kvdepot,
        "baseline": baseline,
        "requests": len(ok),
        "ttft_ms_p50": median(ttft),
        "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": median(itl),
        "tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "tokens_local_hit": int(run.sources["local"]),
        "tokens_kvdepot_hit": int(run.sources["kvdepot"]),
        "tokens_computed": int(run.sources["computed"]),
    }


def run_detail(run: RunResult) -> dict[str, Any]:
    """What the schema has no field for, in the same order as `runs`."""
    ok = [r for r in run.results if not r.error]
    return {
        "workload": run.workload,
        "setup": run.setup,
        "wall_s": run.wall_s,
        "requests_per_s": len(ok) / run.wall_s if run.wall_s > 0 else 0.0,
        "output_tokens_per_s": sum(len(r.token_ids) for r in ok) / run.wall_s
        if run.wall_s > 0
        else 0.0,
        "qps": run.qps,
        "token_sources": run.sources_scope,
        "errors": [r.error for r in run.results if r.error],
        "ttft_ms_by_round": _by_round(ok),
    }


def _by_round(results: list) -> dict[str, float]:  # type: ignore[type-arg]
    rounds: dict[int, list[float]] = {}
    for r in results:
        rounds.setdefault(r.request.round, []).append(1e3 * r.ttft_s)
    return {str(k): median(v) for k, v in sorted(rounds.items())}


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvdepot against vLLM alone, per workload: TTFT p50 and throughput ratios."""
    ref = {r["workload"]: r for r in runs if r["baseline"] == REFERENCE}
    out = []
    for r in runs:
        base = ref.get(r["workload"])
        if not r["kvdepot"] or base is None:
            continue
        out.append(
            {
                "workload": r["workload"],
                "ttft_p50_ratio": r["ttft_ms_p50"] / base["ttft_ms_p50"]
                if base["ttft_ms_p50"]
                else 0.0,
                "throughput_ratio": r["tokens_per_s"] / base["tokens_per_s"]
                if base["tokens_per_s"]
                else 0.0,
            }
        )
    return out


def outputs_equal(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Greedy outputs of each setup against vLLM alone's, request by request."""
    ref = {
        (r["workload"], r["phase"], r["user"], r["round"]): r["token_ids"]
        for r in results.get(REFERENCE, [])
    }
    checked = differ = 0
    examples = []
    for setup, rows in results.items():
        if setup == REFERENCE:
            continue
        for r in rows:
            want = ref.get((r["workload"], r["phase"], r["user"], r["round"]))
            if want is None or r["error"]:
                continue
            checked += 1
            if r["token_ids"] != want:
                differ += 1
                if len(examples) < 3:
                    examples.append(
                        {
                            "setup": setup,
                            "workload": r["workload"],
                            "user": r["user"],
                            "round": r["round"],
                            "got": r["token_ids"],
                            "want": want,
                        }
                    )
    return {"compared": checked, "differ": differ, "equal": differ == 0, "examples": examples}


def check_targets(
    runs: list[dict[str, Any]], cmp: list[dict[str, Any]], limit: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The issue's targets, as far as this run measured them."""
    targets = []
    by = {c["workload"]: c for c in cmp}
    qa = by.get("multi_round_qa")
    if qa:
        targets.append(
            {
                "name": "multi-round QA: TTFT p50 kvdepot / vLLM alone <= 0.2",
                "value": qa["ttft_p50_ratio"],
                "met": qa["ttft_p50_ratio"] <= 0.2,
            }
        )
    sweep = [c for c in cmp if c["workload"].startswith("multi_round_qa@qps=")]
    if sweep:
        top = max(sweep, key=lambda c: float(c["workload"].split("=")[1]))
        targets.append(
            {
                "name": f"throughput at the highest QPS ({top['workload']}) >= 2x vLLM alone",
                "value": top["throughput_ratio"],
                "met": top["throughput_ratio"] >= 2.0,
            }
        )
    if limit and limit.get("ratio"):
        targets.append(
            {
                "name": "full-prefix hit: TTFT <= 1.3 x (bytes / GB/s + TTFT of the tail alone)",
                "value": limit["ratio"],
                "met": limit["ratio"] <= 1.3,
            }
        )
    kv = {(r["workload"], r["kvdepot"]): r for r in runs}
    before, after = kv.get(("restart:before", True)), kv.get(("restart:after", True))
    if before and after and before["ttft_ms_p50"]:
        ratio = after["ttft_ms_p50"] / before["ttft_ms_p50"]
        targets.append(
            {
                "name": "restart: first round after, TTFT p50 <= 1.5 x the round before",
                "value": ratio,
                "met": ratio <= 1.5,
            }
        )
    return targets


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"kvdepot bench serve: {result['model']} on {result['servers']} server(s); "
        f"{result['machine']['cpu_model']}, {result['machine']['cpus']} CPUs, load "
        f"{result['machine']['loadavg_1min']['start']:.1f} -> "
        f"{result['machine']['loadavg_1min']['end']:.1f}",
        "",
        f"{'workload':<24} {'setup':<13} {'req':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'tok/s':>8} {'local':>7} {'kvdepot':>8} {'computed':>8}",
    ]
    for r in result["runs"]:
        setup = "kvdepot" if r["kvdepot"] else r["baseline"]
        lines.append(
            f"{r['workload']:<24} {setup:<13} {r['requests']:>4} {r['ttft_ms_p50']:>7.0f}ms "
            f"{r['ttft_ms_p99']:>7.0f}ms {r['itl_ms_p50']:>6.0f}ms {r['tokens_per_s']:>8.0f} "
            f"{r['tokens_local_hit']:>7} {r['tokens_kvdepot_hit']:>8} {r['tokens_computed']:>8}"
        )
    if result["compare"]:
        lines += ["", f"{'kvdepot / vLLM alone':<24} {'TTFT p50':>9} {'throughput':>11}"]
        for c in result["compare"]:
            lines.append(
                f"{c['workload']:<24} {c['ttft_p50_ratio']:>8.2f}x {c['throughput_ratio']:>10.2f}x"
            )
    limit = result.get("limit") or {}
    if limit.get("ratio"):
        lines += [
            "",
            f"full-prefix hit ({limit['prompts']} prompts of {limit['prompt_tokens']} tokens, "
            f"{limit['hit_tokens']} from kvdepot): TTFT {limit['ttft_hit_ms']:.0f} ms = "
            f"{limit['ratio']:.2f}x of load {limit['load_ms']:.0f} ms "
            f"({limit['load_bytes'] / 2**20:.0f} MiB at {limit['gb_per_s']:.2f} GB/s) + tail "
            f"alone {limit['ttft_tail_ms']:.0f} ms; cold {limit['ttft_cold_ms']:.0f} ms",
        ]
    eq = result["outputs"]
    lines += [
        "",
        f"greedy outputs vs vLLM alone: {eq['compared']} compared, {eq['differ']} differ",
    ]
    for t in result["targets"]:
        lines.append(f"[{'met ' if t['met'] else 'MISS'}] {t['name']}: {t['value']:.2f}")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT CDFs with and without kvdepot, TTFT by round, throughput against QPS
    (matplotlib: `pip install 'kvdepot[bench]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for setup, rows in result["requests"].items():
        ttft = sorted(
            r["ttft_ms"] for r in rows if r["workload"] == "multi_round_qa" and not r["error"]
        )
        if ttft:
            ax.step(
                ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=setup
            )
    ax.set(title="multi-round QA: TTFT CDF", xlabel="TTFT (ms)", ylabel="fraction of requests")
    ax.legend()
    ax = axes[1]
    for d in result["details"]:
        if d["workload"] in ("multi_round_qa", "restart:before", "restart:after"):
            xs = [int(k) for k in d["ttft_ms_by_round"]]
            ax.plot(
                xs,
                list(d["ttft_ms_by_round"].values()),
                marker="o",
                label=f"{d['setup']} {d['workload']}",
            )
    ax.set(title="TTFT p50 by round", xlabel="round", ylabel="TTFT (ms)")
    ax.legend(fontsize=7)
    ax = axes[2]
    series: dict[str, list[tuple[float, float]]] = {}
    for d, r in zip(result["details"], result["runs"], strict=True):
        if d["qps"] is not None:
            series.setdefault(d["setup"], []).append((d["qps"], r["tokens_per_s"]))
    for setup, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=setup)
    ax.set(title="throughput against offered QPS", xlabel="QPS", ylabel="tokens/s")
    if series:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
