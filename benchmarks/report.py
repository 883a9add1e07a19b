"""Turning a bench result into the targets check, a text table, and a plot."""

from __future__ import annotations

from typing import Any

RATIO_TARGET = 0.8  # several engines together / in-process aggregate
SIZE_RATIO_TARGET = 0.9  # one engine, jobs of 16+ chunks / in-process
CEILING_TARGET_GBPS = 100.0  # 2x an H200's PCIe one way
MEMMOVE_FRACTION_TARGET = 0.6  # largest jobs / the machine's all-core memmove
FLOOR_RATIO_TARGET = 1.3  # empty job / bare gRPC echo, p50
OVERHEAD_TARGET_MS = 1.0
LOOKUP_TARGET = 1e6


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's four targets, each with the figure that decides it."""
    out = []
    big = [r for r in result["throughput"] if r["chunks"] >= 16]
    if big:
        pairs = [(r[d]["ratio"], f"{d} {r['chunks']}") for r in big for d in ("store", "load")]
        worst, where = min(pairs)
        out.append(
            {
                "name": "daemon / in-process, jobs of 16+ chunks, both directions",
                "target": f">= {SIZE_RATIO_TARGET}",
                "measured": worst,
                "where": where,
                "met": worst >= SIZE_RATIO_TARGET,
            }
        )
    lat = result["latency"]
    if lat:
        # Per job means the fixed part: the smallest job (one key, one chunk of
        # pages). What grows with a job's keys and pages shows in the other rows
        # and in the ratio target; the worst of them is named beside it.
        smallest = min(r["chunks"] for r in lat)
        row = max(
            (r for r in lat if r["chunks"] == smallest), key=lambda r: r["overhead_ms"]["p50"]
        )
        worst = max(lat, key=lambda r: r["overhead_ms"]["p50"])
        value = row["overhead_ms"]["p50"]
        out.append(
            {
                "name": f"per-job overhead p50 (round trip - copy), {smallest}-chunk jobs",
                "target": f"< {OVERHEAD_TARGET_MS} ms",
                "measured": value,
                "where": f"{row['direction']}; largest: {worst['overhead_ms']['p50']:.3f} ms at "
                f"{worst['direction']} {worst['chunks']}",
                "met": value < OVERHEAD_TARGET_MS,
            }
        )
    rate, source = lookup_rate(result)
    if rate is not None:
        out.append(
            {
                "name": "scheduler-side lookups",
                "target": f">= {LOOKUP_TARGET:.0f} keys/s",
                "measured": rate,
                "where": source,
                "met": rate >= LOOKUP_TARGET,
            }
        )
    ceiling = [r for r in result.get("control_ceiling", []) if r["chunks"] == 16]
    if ceiling:
        worst_row = min(ceiling, key=lambda r: r["equivalent_gbps"])
        out.append(
            {
                "name": "control-plane ceiling, 16-chunk jobs, 2 engines x 4 in flight, copies off",
                "target": f">= {CEILING_TARGET_GBPS} GB/s-equivalent",
                "measured": worst_row["equivalent_gbps"],
                "where": f"{worst_row['direction']}, {worst_row['jobs_per_s']:.0f} jobs/s of "
                f"{worst_row['job_bytes'] / (1 << 20):.0f} MiB",
                "met": worst_row["equivalent_gbps"] >= CEILING_TARGET_GBPS,
            }
        )
    out += _limit_targets(result)
    out += _scheduler_targets(result.get("connector") or {})
    agg = result["aggregate"]
    if agg:
        top = max(agg, key=lambda r: r["engines"])
        worst = min((top[d]["ratio"], d) for d in ("store", "load"))
        out.append(
            {
                "name": f"{top['engines']} engines together / in-process aggregate",
                "target": f">= {RATIO_TARGET}",
                "measured": worst[0],
                "where": worst[1],
                "met": worst[0] >= RATIO_TARGET,
            }
        )
    return out


def _scheduler_targets(conn: dict[str, Any]) -> list[dict[str, Any]]:
    """What the connector adds to a scheduler step, over what vLLM's own CPU offloading
    manager adds in the same run (medians over rounds), per kind of step."""
    added, rounds = conn.get("added_ms") or {}, conn.get("added_rounds") or {}
    if "kvdepot" not in added or "vllm_cpu" not in added:
        return []
    out = []
    for step, label in (("admission_step", "admission"), ("decode_step", "decode")):
        mine, theirs = added["kvdepot"][step], added["vllm_cpu"][step]
        pairs = list(zip(rounds.get("kvdepot", []), rounds.get("vllm_cpu", []), strict=True))
        lower = sum(a[step] <= b[step] for a, b in pairs)
        ratio = mine / theirs if theirs > 0 else float("inf")
        out.append(
            {
                "name": f"scheduler time added per {label} step / vLLM CPU manager's",
                "target": "<= 1.0",
                "measured": ratio,
                "where": f"{mine:.3f} ms vs {theirs:.3f} ms; at or below in {lower} of "
                f"{len(pairs)} rounds",
                "met": ratio <= 1.0,
            }
        )
    return out


def memory_fractions(result: dict[str, Any]) -> list[tuple[int, str, float, float]]:
    """(chunks, direction, daemon GB/s, fraction of the all-core memmove) per row."""
    mm = (result.get("machine_limits") or {}).get("memmove") or {}
    if not mm.get("all_cores_gbps"):
        return []
    return [
        (r["chunks"], d, r[d]["daemon_gbps"], r[d]["daemon_gbps"] / mm["all_cores_gbps"])
        for r in result["throughput"]
        for d in ("store", "load")
    ]


def _limit_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies at memory speed (largest jobs) and the empty job against gRPC's echo."""
    out = []
    fractions = memory_fractions(result)
    if fractions:
        biggest = max(c for c, *_ in fractions)
        chunks, d, _, worst = min((f for f in fractions if f[0] == biggest), key=lambda f: f[3])
        out.append(
            {
                "name": f"daemon GB/s / all-core memmove, {chunks}-chunk jobs",
                "target": f">= {MEMMOVE_FRACTION_TARGET}",
                "measured": worst,
                "where": d,
                "met": worst >= MEMMOVE_FRACTION_TARGET,
            }
        )
    lim = result.get("machine_limits") or {}
    if "empty_job_over_echo" in lim:
        value = lim["empty_job_over_echo"]
        out.append(
            {
                "name": "empty-job round trip p50 / bare gRPC echo p50",
                "target": f"<= {FLOOR_RATIO_TARGET}",
                "measured": value,
                "where": f"{result['latency_floor']['rtt_ms']['p50']:.3f} ms / "
                f"{lim['grpc_echo']['rtt_ms']['p50']:.3f} ms",
                "met": value <= FLOOR_RATIO_TARGET,
            }
        )
    return out


def lookup_rate(result: dict[str, Any]) -> tuple[float | None, str]:
    """The connector's lookup rate when its bench ran, else the client mirror's."""
    conn = result.get("connector") or {}
    if conn and "skipped" not in conn and "error" not in conn:
        # connector_bench reports microseconds per OffloadingManager.lookup() call.
        per_call = (conn.get("lookup_us") or {}).get("kvdepot")
        if isinstance(per_call, int | float) and per_call > 0:
            return 1e6 / per_call, "vLLM connector (KVDepotOffloadingManager.lookup)"
    ctl = result.get("control") or {}
    if "lookup_keys_per_s" in ctl:
        return ctl["lookup_keys_per_s"], "client mirror"
    return None, ""


def _gbps(x: float) -> str:
    return f"{x:6.2f}"


def format_table(result: dict[str, Any]) -> str:
    """The human summary printed at the end of a run."""
    cfg = result["config"]
    m = result["machine"]
    lines = [
        f"kvdepot bench {result['version']}  ({result['elapsed_s']:.0f} s)",
        f"machine: {m['cpus']} CPU(s) {m['cpu_model']}, {m['memory_gib']:.0f} GiB, "
        f"{m['system']}, Python {m['python']}, {m['accelerator']}; load average "
        f"{m['loadavg_1min']['start']:.1f} at start, {m['loadavg_1min']['end']:.1f} at end",
        f"geometry: {cfg['geometry_text']}",
        f"daemon: {cfg['daemon']}; GB = 10^9 bytes; median of {cfg['reps']} repetitions "
        f"(warm-up jobs excluded); in-process = same planner + copy engine in the engine "
        f"process",
        f"copies: {cfg.get('copier', 'not recorded')}",
        f"content check: {result['verified']['pages']} pages stored and loaded back, "
        f"{result['verified']['mismatched_pages']} mismatched",
        "",
        "Throughput, one engine (GB/s)",
        " chunks  job MiB  runs |  store daemon  in-proc  ratio |  load daemon  in-proc  ratio",
    ]
    for r in result["throughput"]:
        s, ld = r["store"], r["load"]
        lines.append(
            f" {r['chunks']:6d}  {r['job_bytes'] / (1 << 20):7.1f}  {r['runs_per_rank']:4d} |"
            f"        {_gbps(s['daemon_gbps'])}   {_gbps(s['inproc_gbps'])}  {s['ratio']:5.2f} |"
            f"       {_gbps(ld['daemon_gbps'])}   {_gbps(ld['inproc_gbps'])}  {ld['ratio']:5.2f}"
        )
    lines += [
        "",
        "Per job through the daemon (ms; overhead = client round trip - copy; "
        "in daemon + wire = overhead; queued: a copy's mean wait for a copy thread, "
        "part of in daemon)",
        " chunks  dir      n |  rtt p50  rtt p99 | copy p50 | ovh p50  ovh p99 | in daemon"
        "   wire | non-copy | queued",
    ]
    for r in result["latency"]:
        lines.append(
            f" {r['chunks']:6d}  {r['direction']:5s} {r['samples']:4d} |"
            f" {r['rtt_ms']['p50']:8.3f} {r['rtt_ms']['p99']:8.3f} |"
            f" {r['copy_ms']['p50']:8.3f} |"
            f" {r['overhead_ms']['p50']:7.3f} {r['overhead_ms']['p99']:8.3f} |"
            f" {r['in_daemon_ms']['p50']:9.3f} {r['wire_ms']['p50']:6.3f} |"
            f" {r['noncopy_share']:7.1%}  |"
            + (f" {q:6.3f}" if (q := r.get("copy_wait_ms_mean")) is not None else "      -")
        )
    fl = result.get("latency_floor")
    if fl:
        lines.append(
            f" floor: a job naming no key, {fl['samples']} of them: round trip p50 "
            f"{fl['rtt_ms']['p50']:.3f} ms, p99 {fl['rtt_ms']['p99']:.3f} ms (in daemon "
            f"{fl['in_daemon_ms']['p50']:.3f}, wire {fl['wire_ms']['p50']:.3f})"
        )
    lim = result.get("machine_limits") or {}
    mm = lim.get("memmove") or {}
    if "all_cores_gbps" in mm:
        lines.append(
            f" memmove of {mm['bytes'] >> 20} MiB: {mm['one_thread_gbps']:.2f} GB/s on one "
            f"thread, {mm['all_cores_gbps']:.2f} GB/s on {mm['threads']}; daemon / all-core: "
            + ", ".join(f"{c} {d} {f:.2f}" for c, d, _, f in memory_fractions(result))
        )
    echo = lim.get("grpc_echo") or {}
    if "rtt_ms" in echo:
        lines.append(
            f" bare gRPC echo ({echo['message_bytes']} B, {echo['messages']} round trips): "
            f"p50 {echo['rtt_ms']['p50']:.3f} ms, p99 {echo['rtt_ms']['p99']:.3f} ms; "
            f"empty job / echo {lim['empty_job_over_echo']:.2f}"
        )
    elif echo:
        lines.append(f" bare gRPC echo: {echo.get('error')}")
    agg = result["aggregate"]
    if agg:
        lines += [
            "",
            f"Aggregate, jobs of {agg[0]['chunks']} chunks (GB/s while every engine runs)",
            " engines  procs |  store daemon  in-proc  ratio |  load daemon  in-proc  ratio",
        ]
        for r in agg:
            s, ld = r["store"], r["load"]
            lines.append(
                f" {r['engines']:7d}  {r['processes']:5d} |"
                f"        {_gbps(s['daemon_gbps'])}   {_gbps(s['inproc_gbps'])}  "
                f"{s['ratio']:5.2f} |"
                f"       {_gbps(ld['daemon_gbps'])}   {_gbps(ld['inproc_gbps'])}  "
                f"{ld['ratio']:5.2f}"
            )
    ceiling = result.get("control_ceiling") or []
    info = result.get("control_ceiling_info") or {}
    lines += [
        "",
        "Control-plane ceiling: whole job path, copies off (CUDA descriptors "
        "planned), 2 engines x 4 jobs in flight",
    ]
    if ceiling:
        lines.append(" chunks  dir   |  jobs/s  GB/s-equiv | daemon CPU ms/job  engine CPU ms/job")
        for r in ceiling:
            lines.append(
                f" {r['chunks']:6d}  {r['direction']:5s} | {r['jobs_per_s']:7.0f}  "
                f"{r['equivalent_gbps']:10.1f} | {r['daemon_cpu_ms_per_job']:17.3f}  "
                f"{r['engine_cpu_ms_per_job']:17.3f}"
            )
        if info.get("skipped_chunks"):
            lines.append(
                f" not run (pool too small for 8 jobs in flight): {info['skipped_chunks']} chunks"
            )
    else:
        lines.append(f" {info.get('skipped') or info.get('error') or 'not measured'}")
    ctl = result.get("control") or {}
    lines += ["", "Control plane"]
    if "lookup_keys_per_s" in ctl:
        lines.append(
            f" client mirror lookups {ctl['lookup_keys_per_s'] / 1e6:.2f} M keys/s; "
            f"Lookup RPC {ctl['rpc_lookup_keys_per_s'] / 1e6:.2f} M keys/s "
            f"(batches of {ctl['rpc_lookup_batch']}); "
            f"pin of {ctl['pin_keys']} keys p50 {ctl['pin_ms']['p50']:.3f} ms "
            f"p99 {ctl['pin_ms']['p99']:.3f} ms; unpin p50 {ctl['unpin_ms']['p50']:.3f} ms"
        )
    else:
        lines.append(f" client: {ctl.get('skipped') or ctl.get('error') or 'not measured'}")
    lines.append(" vLLM connector: " + _connector_summary(result.get("connector") or {}))
    lines.append(" GPU path: " + _summary(result.get("gpu") or {}))
    lines += ["", "Targets"]
    for t in result["targets"]:
        value = t["measured"]
        shown = (
            f"{value / 1e6:.2f} M keys/s"
            if "keys/s" in t["target"]
            else (
                f"{value:.3f} ms"
                if "ms" in t["target"]
                else (f"{value:.1f} GB/s" if "GB/s" in t["target"] else f"{value:.2f}")
            )
        )
        lines.append(
            f" [{'met' if t['met'] else 'MISSED'}] {t['name']}: {shown} ({t['where']}), "
            f"target {t['target']}"
        )
    for note in result.get("notes", []):
        lines.append(f" note: {note}")
    return "\n".join(lines)


def _connector_summary(conn: dict[str, Any]) -> str:
    """connector_bench's headline: lookups, the pin RPC, what a scheduler step pays."""
    if "lookup_us" not in conn:
        return _summary(conn)
    parts = []
    lk = conn["lookup_us"]
    if "kvdepot" in lk:
        parts.append(
            f"lookup {lk['kvdepot']:.3f} us/key ({1 / lk['kvdepot']:.2f} M keys/s)"
            + (f" vs vLLM CPU {lk['vllm_cpu']:.3f} us" if "vllm_cpu" in lk else "")
        )
    for path in ("lane", "gRPC"):
        pin = (conn.get("pin") or {}).get(f"1024_keys_{path}")
        if pin:
            parts.append(
                f"pin of 1024 keys ({path}) p50 {pin['p50_ms']:.3f} ms p99 {pin['p99_ms']:.3f} ms"
            )
    added = (conn.get("added_ms") or {}).get("kvdepot")
    if added:
        parts.append(
            f"scheduler step +{added['decode_step']:.3f} ms (decode), "
            f"+{added['admission_step']:.3f} ms (admission)"
        )
    theirs = (conn.get("added_ms") or {}).get("vllm_cpu")
    if theirs:
        parts.append(
            f"vLLM CPU manager +{theirs['decode_step']:.3f} ms, +{theirs['admission_step']:.3f} ms"
        )
    steps = conn.get("step_ms") or {}
    if "decode_in_connector_ms" in steps.get("kvdepot", {}) and "vllm_cpu" in steps:
        mine, vllm = steps["kvdepot"], steps["vllm_cpu"]
        parts.append(
            "inside the connector's methods "
            f"{mine['decode_in_connector_ms']:.3f} ms (decode), "
            f"{mine['admission_in_connector_ms']:.3f} ms (admission); vLLM CPU "
            f"{vllm['decode_in_connector_ms']:.3f} ms, {vllm['admission_in_connector_ms']:.3f} ms"
        )
    return "; ".join(parts) or "measured (see --json)"


def _summary(section: dict[str, Any]) -> str:
    if "skipped" in section:
        return f"skipped ({section['skipped']})"
    if "error" in section:
        return f"error ({section['error']})"
    if not section:
        return "not measured"
    flat = []
    for k, v in section.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            flat.append(f"{k}={v:.4g}")
    return ", ".join(flat[:8]) or "measured (see --json)"


def plot(result: dict[str, Any], path: str) -> None:
    """A four-panel PNG: GB/s by job size, ratio, latency split, aggregate."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    rows = result["throughput"]
    sizes = [r["chunks"] for r in rows]
    ax = axes[0][0]
    for d, color in (("store", "tab:blue"), ("load", "tab:orange")):
        ax.plot(sizes, [r[d]["daemon_gbps"] for r in rows], "o-", color=color, label=f"{d}, daemon")
        ax.plot(
            sizes, [r[d]["inproc_gbps"] for r in rows], "s--", color=color, label=f"{d}, in-process"
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("chunks per job")
    ax.set_ylabel("GB/s")
    ax.set_title("One engine")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for d, color in (("store", "tab:blue"), ("load", "tab:orange")):
        ax.plot(sizes, [r[d]["ratio"] for r in rows], "o-", color=color, label=d)
    ax.axhline(RATIO_TARGET, color="grey", linestyle=":", label=f"target {RATIO_TARGET}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("chunks per job")
    ax.set_ylabel("daemon / in-process")
    ax.set_title("Share of the in-process limit")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    lat = result["latency"]
    labels = [f"{r['direction']}\n{r['chunks']}" for r in lat]
    # Shares, not ms: job sizes span 60x, and what matters is how much is not copying.
    copy = [100 * r["copy_ms"]["p50"] / max(r["rtt_ms"]["p50"], 1e-9) for r in lat]
    over = [100 - c for c in copy]
    ax.bar(labels, copy, label="copy", color="tab:green")
    ax.bar(labels, over, bottom=copy, label="overhead (rtt - copy)", color="tab:red")
    for i, r in enumerate(lat):
        ax.text(i, 102, f"{r['rtt_ms']['p50']:.1f} ms", ha="center", fontsize=7)
    ax.set_ylim(0, 112)
    ax.set_ylabel("% of the round trip (p50)")
    ax.set_title("Per job through the daemon (p50 round trip above)")
    ax.legend(fontsize=8, loc="lower right")
    ax = axes[1][1]
    agg = result["aggregate"]
    if agg:
        n = [r["engines"] for r in agg]
        for d, color in (("store", "tab:blue"), ("load", "tab:orange")):
            ax.plot(n, [r[d]["daemon_gbps"] for r in agg], "o-", color=color, label=f"{d}, daemon")
            ax.plot(
                n, [r[d]["inproc_gbps"] for r in agg], "s--", color=color, label=f"{d}, in-process"
            )
        ax.set_xticks(n)
        ax.set_xlabel("engine processes")
        ax.set_ylabel("aggregate GB/s")
        ax.set_title(f"Engines side by side (jobs of {agg[0]['chunks']} chunks)")
        ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"kvdepot bench {result['version']}: {result['config']['geometry_text']}\n"
        f"{m['cpus']} CPU(s) {m['cpu_model']}, {m['accelerator']}, load average "
        f"{m['loadavg_1min']['start']:.1f} at start",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
