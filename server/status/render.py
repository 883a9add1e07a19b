"""What `kvdepot status` shows: a report (kvdepot.server.status.report) rendered for
the screen with rich.

`render(report)` is the whole screen: the pool with a bar (pinned ▓, used █, free ░),
warm-up and page-locking progress, blocks, traffic rates, namespaces, engines, the
tiers below the pool, the NUMA placement and, for a daemon of several shards, which
shard this is and the table of them all. Pure: it reads the report and returns rich
renderables; `kvdepot status` (kvdepot.server.status) prints them.
"""

from __future__ import annotations

import json
from typing import Any

from kvdepot.common.escape import escaped
from kvdepot.server.sizes import format_size
from kvdepot.server.status.report import REMOTE_COUNTERS, admin_socket_of, shard_sockets

BAR_WIDTH = 40


def fmt_age(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 or x == 0 else f"{x:.1f}"


def shown(text: str) -> Any:
    """Text a client chose (or any string not ours), for a rich cell: control
    characters escaped, and never read as rich markup ("[/]" would raise, "[blink]" style)."""
    from rich.text import Text

    return Text(escaped(text))


def short_id(ns_id: str) -> str:
    """'kvd1-' + 40 hex digits is too wide for a table: the first 8 digits tell them apart."""
    return ns_id if len(ns_id) <= 16 else ns_id[:13] + "…"


def _pool_bar(capacity: int, used: int, pinned: int, width: int = BAR_WIDTH) -> Any:
    """Pinned (▓), used and not pinned (█), free (░): shapes tell them apart without colour."""
    from rich.text import Text

    if capacity <= 0:
        return Text("░" * width, style="dim")
    n_used = min(width, round(width * used / capacity))
    n_pinned = min(n_used, round(width * pinned / capacity))
    if used and n_used == 0:
        n_used = 1  # something is there: show it
    bar = Text()
    bar.append("▓" * n_pinned, style="magenta")
    bar.append("█" * (n_used - n_pinned), style="cyan")
    bar.append("░" * (width - n_used), style="dim")
    return bar


def _disk(disk: dict[str, Any] | None, rates: dict[str, Any] | None) -> list[Any]:
    """The disk tier: off, or its health, use, traffic, drops and index recovery."""
    from rich.table import Table
    from rich.text import Text

    if not disk:
        return []
    g = Table.grid(padding=(0, 1))
    g.add_column(style="bold", no_wrap=True, min_width=11)
    g.add_column()
    if not disk.get("disk_enabled"):
        g.add_row("disk", Text("off (kvdepot serve --disk DIR)", style="dim"))
        return [g]
    capacity, used = disk.get("disk_capacity_bytes", 0), disk.get("disk_used_bytes", 0)
    use = f"{format_size(used)} of {format_size(capacity)}, {disk.get('disk_records', 0)} records"
    if disk.get("disk_write_mode"):
        use += f", writes on {disk['disk_write_mode']}"
    if disk.get("disk_healthy"):
        g.add_row("disk", Text.assemble(("healthy", "green"), f" · {use}"))
    else:
        why = disk.get("disk_down_reason") or "not answering"
        g.add_row("disk", Text(f"DOWN: {why} (RAM only until it recovers)", style="bold red"))
    if rates is not None and "disk_writes_per_second" in rates:
        asked = rates["disk_hits_per_second"] + rates["disk_misses_per_second"]
        hit = f", {100 * rates['disk_hits_per_second'] / asked:.0f}% hit" if asked else ""
        g.add_row(
            "",
            f"writes {format_size(rates['disk_write_bytes_per_second'])}/s · reads "
            f"{format_size(rates['disk_read_bytes_per_second'])}/s{hit}",
        )
    drops = sum(disk.get("disk_write_drops", {}).values())
    recovery = (
        ""
        if disk.get("disk_recovery_complete", True)
        else " · index coming back: "
        + (
            f"{format_size(disk.get('disk_recovery_scanned_bytes', 0))} of "
            f"{format_size(disk.get('disk_recovery_total_bytes', 0))} scanned"
        )
    )
    g.add_row(
        "",
        f"dropped writes {drops} · rejected {disk.get('disk_rejected', 0)} · errors "
        f"{disk.get('disk_errors', 0)}{recovery}",
    )
    return [g]


def _remote(remote: dict[str, Any] | None, rates: dict[str, Any] | None) -> list[Any]:
    """The remote tier: off, or its health, traffic and trouble; fields this version
    does not know are listed as they come."""
    from rich.table import Table
    from rich.text import Text

    if not remote:
        return []
    g = Table.grid(padding=(0, 1))
    g.add_column(style="bold", no_wrap=True, min_width=11)
    g.add_column()
    known = {"remote_enabled", "remote_healthy", "remote_inflight_bytes", *REMOTE_COUNTERS}
    if remote.get("remote_enabled") is False:
        g.add_row("remote", Text("off (kvdepot serve --remote URL)", style="dim"))
        return [g]
    if "remote_healthy" in remote:
        health = (
            Text("healthy", style="green")
            if remote["remote_healthy"]
            else Text("DOWN: not answering (lookups are local only)", style="bold red")
        )
        g.add_row("remote", health)
    if rates is not None and "remote_writes_per_second" in rates:
        reads = rates["remote_reads_per_second"]
        asked = rates["remote_hits_per_second"] + rates["remote_misses_per_second"]
        hit = f", {100 * rates['remote_hits_per_second'] / asked:.0f}% hit" if asked else ""
        g.add_row(
            "",
            f"writes {fmt_rate(rates['remote_writes_per_second'])}/s "
            f"{format_size(rates['remote_write_bytes_per_second'])}/s · reads {fmt_rate(reads)}/s "
            f"{format_size(rates['remote_read_bytes_per_second'])}/s{hit}",
        )
    if "remote_errors" in remote:
        drops = remote.get("remote_write_drops", 0) + remote.get("remote_fetch_drops", 0)
        g.add_row(
            "",
            f"errors {remote['remote_errors']} · verify failures "
            f"{remote.get('remote_verify_failures', 0)} · drops {drops} · in flight "
            f"{format_size(remote.get('remote_inflight_bytes', 0))}",
        )
    for k, v in remote.items():
        if k not in known:
            g.add_row("", f"{k} {_value(v)}")
    return [g]


def _value(v: object) -> str:
    return json.dumps(v) if isinstance(v, dict | list) else str(v)


def _progress(total: int, done: int, fraction: float, complete: bool) -> Any:
    """A pool-wide progress line: a bar, the percentage, "done" at the end."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    line = Table.grid(padding=(0, 1))
    line.add_row(
        ProgressBar(total=max(1, total), completed=done, width=BAR_WIDTH),
        f"{100 * fraction:.0f}%" + (" done" if complete else ""),
    )
    return line


def _numa_lines(numa: dict[str, Any] | None) -> list[str]:
    """The placement in a line or two (one node needs no CPU list: every CPU is on it),
    and the GPUs' own copy threads, once a GPU has registered."""
    if numa is None:
        return []
    gpus = numa.get("gpu_copy_devices") or []
    if not gpus:
        return _placement_lines(numa)
    line = f"GPU copy threads: {numa['gpu_copy_threads']} for each of {plural(len(gpus), 'GPU')}"
    # Where they run, on a host of several nodes (a daemon before per-GPU nodes sends none).
    nodes = numa.get("gpu_copy_nodes") or []
    if numa["host_nodes"] > 1 and any(n >= 0 for n in nodes):
        per_node: dict[int, int] = {}
        for n in nodes:
            per_node[n] = per_node.get(n, 0) + 1
        line += "; on " + ", ".join(
            f"node {n} ({plural(k, 'GPU')})" if n >= 0 else f"no one node ({plural(k, 'GPU')})"
            for n, k in sorted(per_node.items(), key=lambda nk: (nk[0] < 0, nk[0]))
        )
    return [*_placement_lines(numa), line]


# A loop this busy is one core saturated: jobs queue for the control plane itself.
LOOP_SATURATED = 0.9


def _loop_line(loop: dict[str, Any]) -> Any:
    """How much of its one core the event loop used; past LOOP_SATURATED, what to do."""
    from rich.text import Text

    over = "" if loop["over"] == "interval" else " since start"
    line = Text(f"{100 * loop['busy_fraction']:.0f}% of a core busy{over}")
    if loop["busy_fraction"] >= LOOP_SATURATED:
        line.append(
            " — the control plane is this daemon's limit: run more --shards", style="yellow"
        )
    return line


def _copy_lines(copies: dict[str, Any] | None) -> list[Any]:
    """How busy the copy threads are and how long a copy waits for one: a line for the
    shared CPU threads and one for the GPUs' own (once a GPU has registered); and a
    warning for each set of threads holding a stalled copy."""
    from rich.text import Text

    if copies is None:  # a daemon older than the copy-time fields
        return []
    over = "" if copies["over"] == "interval" else " since start"
    lines: list[Any] = []
    for kind in ("cpu", "gpu"):
        c = copies.get(kind)
        if c is None:
            continue
        n = c["copies"]
        counted = f"{n} cop{'y' if n == 1 else 'ies'}{over}"
        lines.append(
            f"{kind.upper()} {plural(c['threads'], 'thread')} {100 * c['busy_fraction']:.0f}% "
            f"busy, wait {c['wait_ms_mean']:.2f} ms a copy ({counted})"
        )
        top = c.get("busiest")  # several GPUs: the one whose threads were busiest
        if top is not None:
            lines.append(
                f"busiest GPU {top['device']}: {100 * top['busy_fraction']:.0f}% busy, "
                f"wait {top['wait_ms_mean']:.2f} ms a copy"
            )
    for who, age in copies.get("stalled", {}).items():
        threads = "the CPU threads" if who == "CPU" else f"GPU {who}"
        lines.append(
            Text(
                f"STALLED: a copy on {threads} has run {age:.0f} s (a hung DMA?); while "
                "every one of those threads holds one, their jobs fail at once",
                style="red",
            )
        )
    return lines


def _placement_lines(numa: dict[str, Any]) -> list[str]:
    threads = numa["copy_threads"]
    if numa["policy"] == "off":
        pinned = sum(1 for t in threads if t["cpus"])
        return [f"off ({numa['basis']})" + (f", {pinned} copy threads pinned" if pinned else "")]
    nodes = ",".join(str(n) for n in numa["pool_nodes"])
    hosts = plural(numa["host_nodes"], "node")
    if numa["host_nodes"] == 1:
        return [
            f"{hosts}: pool {numa['policy']} on node {nodes}, {len(threads)} copy threads on it"
        ]
    per_node: dict[tuple[Any, Any], int] = {}
    for t in threads:
        per_node[t["node"], t["cpus"]] = per_node.get((t["node"], t["cpus"]), 0) + 1
    where = ", ".join(
        f"{k} on node {n} (CPUs {c})" if c else f"{k} not pinned" for (n, c), k in per_node.items()
    )
    return [
        f"{hosts}: pool {numa['policy']} on nodes {nodes} ({numa['basis']})",
        f"copy threads: {where}",
    ]


def _other_shards(r: dict[str, Any], shard: int, count: int) -> str:
    """How to see the other shards in full: each is a daemon of its own, on its own
    sockets (kvdepot.common.shards.shard_socket: shard 0 on the socket, shard i on
    PATH.shardI)."""
    sockets = [data for data, _ in shard_sockets(r["socket"], r["admin_socket"], shard, count)]
    others = [f"--socket {path}" for i, path in enumerate(sockets) if i != shard]
    if count > 3:  # shard 0 and the pattern, not every path
        others = [f"--socket {sockets[0]}", f"--socket {sockets[0]}.shardI (I = 1..{count - 1})"]
    hint = f"figures are this shard's; the others: kvdepot status {' or '.join(others)}"
    if r["admin_socket"] != admin_socket_of(r["socket"]):  # a named --admin-socket
        hint += " (with --admin-socket ADMIN.shardI)"
    return hint


def _shards_table(rows: list[dict[str, Any]], this: int) -> Any:
    """The node: every shard's pool, blocks, sessions, jobs and event loop (its share of
    a core since the last reading, or since the shard started: the caption says which)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title="shards", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = ("shard", "pool used", "ready", "sessions", "ranks", "lane jobs", "loop busy")
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    blank = [""] * (len(columns) - 2)
    total_used = total_cap = 0
    since_start = False
    for row in rows:
        label = f"{row['shard']}{' *' if row['shard'] == this else ''}"
        if "error" in row:
            table.add_row(label, Text(shown(row["error"]), style="red"), *blank)
            continue
        total_used += row["used_bytes"]
        total_cap += row["capacity_bytes"]
        loop = row.get("loop")
        busy = Text("")
        if loop is not None:
            since_start |= loop["over"] != "interval"
            saturated = loop["busy_fraction"] >= LOOP_SATURATED
            busy = Text(f"{100 * loop['busy_fraction']:.0f}%", style="yellow" if saturated else "")
        table.add_row(
            label,
            f"{format_size(row['used_bytes'])} of {format_size(row['capacity_bytes'])}",
            str(row["ready_blocks"]),
            str(row["sessions"]),
            str(row["registrations"]),
            str(row["lane_jobs"]),
            busy,
        )
    table.add_row("node", f"{format_size(total_used)} of {format_size(total_cap)}", *blank)
    table.caption = "loop busy: each shard's event loop, share of a core " + (
        "since the shard started" if since_start else "over the last interval"
    )
    table.caption_justify = "left"
    return table


def render(r: dict[str, Any]) -> Any:
    """The screen for one report (see build_report)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    d, pool, warm, blocks = r["daemon"], r["pool"], r["warmup"], r["blocks"]
    parts: list[Any] = []
    header = Text()
    header.append(f"kvdepot {d['version']}", style="bold")
    header.append(f"  boot {d['boot_id']}  up {fmt_age(d['uptime_seconds'])}")
    count = d.get("shard_count", 1)
    if count > 1:
        header.append(f"  shard {d['shard']} of {count}", style="bold")
    parts.append(header)
    if count > 1:
        parts.append(Text(_other_shards(r, d["shard"], count), style="dim"))

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("socket", shown(r["socket"]))
    cap = pool["capacity_bytes"]
    bar = _pool_bar(cap, pool["used_bytes"], pool["pinned_bytes"])
    bar.append(f" {100 * pool['used_fraction']:.1f}% of {format_size(cap)}")
    grid.add_row("pool", bar)
    backing = d["pool_backing"] + (", warm restart" if d["warm_restarted"] else "")
    grid.add_row(
        "",
        f"used {format_size(pool['used_bytes'])} · pinned {format_size(pool['pinned_bytes'])} "
        f"· free {format_size(pool['free_bytes'])} ({backing})",
    )
    grid.add_row("", f"largest free extent {format_size(pool['largest_free_extent_bytes'])}")
    grid.add_row("warm-up", _progress(cap, warm["done_bytes"], warm["fraction"], warm["complete"]))
    if warm.get("populating_bytes"):
        grid.add_row("", f"engine memory being mapped: {format_size(warm['populating_bytes'])}")
    lock = r.get("page_locking")
    if lock is not None:  # a CUDA host: DMA wants the pool page-locked
        grid.add_row(
            "page-lock",
            _progress(cap, lock["locked_bytes"], lock["fraction"], lock["complete"]),
        )
        if lock["error"]:
            grid.add_row(
                "",
                Text(
                    f"stopped: {lock['error']} (copies still work, slower; raise the "
                    f"locked-memory limit)",
                    style="yellow",
                ),
            )
    for i, line in enumerate(_numa_lines(r.get("numa"))):
        grid.add_row("numa" if i == 0 else "", line)
    rec = r.get("recovery") or {}
    if rec.get("recovery_blocks_total") or rec.get("recovery_complete") is False:
        grid.add_row(
            "recovery",
            f"{rec.get('recovery_blocks_verified', 0)} of "
            f"{rec.get('recovery_blocks_total', 0)} blocks verified and served again, "
            f"{rec.get('recovery_blocks_rejected', 0)} dropped"
            + (" (done)" if rec.get("recovery_complete") else " (verifying)"),
        )
    grid.add_row(
        "blocks",
        f"{blocks['ready']} ready · {blocks['writing']} writing · "
        f"{blocks['pinned']} pinned · {blocks['inflight_jobs']} jobs in flight "
        f"({blocks['job_lanes_open']} job lanes)",
    )
    loop = r.get("loop")
    if loop is not None:
        grid.add_row("event loop", _loop_line(loop))
    for i, line in enumerate(_copy_lines(r.get("copies"))):
        grid.add_row("copies" if i == 0 else "", line)
    rates = r["rates"]
    if rates is None:
        grid.add_row("rates", Text("need two readings (--interval > 0)", style="dim"))
    else:
        grid.add_row(
            f"last {rates['interval_seconds']:.1f}s",
            f"stores {fmt_rate(rates['stores_per_second'])}/s "
            f"{format_size(rates['store_bytes_per_second'])}/s · "
            f"loads {fmt_rate(rates['loads_per_second'])}/s "
            f"{format_size(rates['load_bytes_per_second'])}/s",
        )
        by_reason = ", ".join(
            f"{k} {fmt_rate(v)}" for k, v in rates["evictions_by_reason_per_second"].items() if v
        )
        lookups = rates["lookups_per_second"]
        hit = f" ({100 * rates['hits_per_second'] / lookups:.0f}% hit)" if lookups else ""
        grid.add_row(
            "",
            f"evictions {fmt_rate(rates['evictions_per_second'])}/s"
            + (f" ({by_reason})" if by_reason else "")
            + f" · dropped stores {fmt_rate(rates['dropped_stores_per_second'])}/s"
            + f" · lookups {fmt_rate(lookups)}/s{hit}",
        )
        if "pin_keys_per_second" in rates:  # newer daemons: the connector's hits, errors
            pins = rates["pin_keys_per_second"]
            ready = f" ({100 * rates['pinned_keys_per_second'] / pins:.0f}% ready)" if pins else ""
            failed = rates["failed_store_jobs_per_second"] + rates["failed_load_jobs_per_second"]
            grid.add_row(
                "", f"pins {fmt_rate(pins)} keys/s{ready} · failed jobs {fmt_rate(failed)}/s"
            )
    t = r["totals"]
    grid.add_row(
        "since start",
        f"stores {t['stores']} ({format_size(t['stored_bytes'])}) · loads {t['loads']} "
        f"({format_size(t['loaded_bytes'])})",
    )
    grid.add_row(
        "",
        f"lookups {t['lookups']} ({t['hits']} hits) · evictions {t['evictions']} · "
        f"dropped stores {t['dropped_stores']}",
    )
    grid.add_row(
        "", f"{plural(t['sessions'], 'session')} · {plural(t['registrations'], 'registration')}"
    )
    if "pin_keys" in t:
        failed = t["failed_store_jobs"] + t["failed_load_jobs"]
        grid.add_row(
            "",
            f"pins {plural(t['pin_keys'], 'key')} ({t['pinned_keys']} ready) · "
            f"failed jobs {failed}",
        )
    parts.append(grid)
    if r.get("shards"):
        parts.append(_shards_table(r["shards"], d["shard"]))
    parts.extend(_remote(r["remote"], r["rates"]))
    parts.extend(_disk(r.get("disk"), r["rates"]))

    ns_table = Table(
        title="namespaces", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, expand=False
    )
    ns_table.add_column("namespace", no_wrap=True)
    ns_table.add_column("description", overflow="ellipsis", no_wrap=True, max_width=30)
    for name in ("ready", "writing"):
        ns_table.add_column(name, justify="right")
    ns_table.add_column("bytes", justify="right", no_wrap=True)
    ns_table.add_column("evicted", justify="right")
    for ns in r["namespaces"]:
        held = format_size(ns["used_bytes"])
        if ns.get("share_bytes"):  # --namespace-share
            held += f" of {format_size(ns['share_bytes'])} share"
        ns_table.add_row(
            shown(short_id(ns["id"])),
            shown(ns["description"]),
            str(ns["ready_blocks"]),
            str(ns["writing_blocks"]),
            held,
            str(ns.get("evicted_blocks", 0)),
        )
    if not r["namespaces"]:
        ns_table.add_row(Text("none yet", style="dim"), "", "", "", "", "")
    parts.append(ns_table)

    eng = Table(title="engines", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    eng.add_column("engine", overflow="ellipsis", no_wrap=True, max_width=28)
    eng.add_column("pid", justify="right")
    eng.add_column("ranks", no_wrap=True)
    eng.add_column("path", no_wrap=True)
    eng.add_column("registered", justify="right", no_wrap=True)
    eng.add_column("pins", justify="right")
    eng.add_column("age", justify="right", no_wrap=True)
    why: dict[str, str] = {}
    for e in r["engines"]:
        for reg in e["registrations"]:
            why.setdefault(reg["memory_path"], reg["memory_path_reason"])
        eng.add_row(
            shown(e["client_name"] or e["engine_id"] or e["session_id"]),
            str(e["pid"]),
            ",".join(map(str, e["ranks"])) or "-",
            ",".join(e["memory_paths"]) or "-",
            format_size(e["registered_bytes"]),
            str(e["pinned_blocks"]),
            fmt_age(e["connected_seconds"]),
        )
    if not r["engines"]:
        eng.add_row(Text("none connected", style="dim"), "", "", "", "", "", "")
    parts.append(eng)
    for path, reason in sorted(why.items()):
        parts.append(Text(f"  {path}: {reason}", style="dim"))

    if r["other"]:  # figures of a newer daemon: one wrapped line, --json has them too
        parts.append(
            Text(
                "more: " + " · ".join(f"{k} {_value(v)}" for k, v in r["other"].items()),
                style="dim",
            )
        )
    return Group(*parts)
