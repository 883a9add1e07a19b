"""The Grafana dashboard (deploy/grafana/kvdepot.json) against a live daemon.

- Every metric a panel's PromQL names is one the daemon exports: the metric names are
  parsed out of each expression and looked up in a real scrape of `kvdepot serve
  --metrics-port` (histogram series by their _bucket/_sum/_count names).
- Every expression evaluates in a real Prometheus (Debian's `prometheus` package) that
  scrapes that daemon, and selects series: a wrong label or a typo in a function shows.
- The dashboard has a data source variable and a node (instance) variable, and every
  query filters by the node.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import DaemonProcess, connect
from tests.support.engine import Engine, Geometry
from tests.support.fleet_key import shared_key_args
from tests.support.ops import free_port, load, store
from tests.support.redis_servers import RedisServer, free_ports, redis_available

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "kvdepot.json"
INSTANCE_FILTER = 'instance=~"$instance"'

# PromQL words that look like identifiers but name no metric.
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
     "bool", "offset", "inf", "nan"}
)  # fmt: skip


def _strip(expr: str) -> str:
    """The expression without strings, label matchers, ranges and grouping labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (function and aggregation names and
    keywords are followed by '(' or are PromQL words; numbers start with a digit)."""
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", _strip(expr)):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def unfiltered_selectors(expr: str) -> list[str]:
    """Metric selectors in `expr` that do not filter by the dashboard's node variable."""
    bad = []
    for name in metric_names(expr):
        for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(\{{[^}}]*\}})?", expr):
            if not m.group(1) or INSTANCE_FILTER not in m.group(1):
                bad.append(m.group(0))
    return bad


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows keep theirs inside


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    return [(p["title"], t["expr"]) for p in panels(dash) for t in p.get("targets", [])]


# --- the parser itself ----------------------------------------------------------------------


def test_metric_name_parser() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, direction) (rate(kvdepot_transfer_copy_seconds_"
        'bucket{instance=~"$instance", job="a"}[$__rate_interval]))) / on (instance) '
        'group_left kvdepot_pool_capacity_bytes{instance=~"$instance"} > bool 0 or vector(1)'
    )
    assert metric_names(expr) == {
        "kvdepot_transfer_copy_seconds_bucket",
        "kvdepot_pool_capacity_bytes",
    }
    assert metric_names("sum(rate(up[5m])) by (job)") == {"up"}
    assert unfiltered_selectors('kvdepot_engines + kvdepot_namespaces{instance=~"$instance"}') == [
        "kvdepot_engines"
    ]


# --- the dashboard's shape ------------------------------------------------------------------


def test_dashboard_variables_and_panels() -> None:
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    node = variables["instance"]
    assert node["type"] == "query" and node["datasource"]["uid"] == "${datasource}"
    assert "label_values(kvdepot_build_info, instance)" in json.dumps(node["query"])
    assert node["multi"] and node["includeAll"]

    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
            assert not unfiltered_selectors(t["expr"]), (p["title"], t["expr"])

    # What an operator looks for (the list): each metric family is on some panel.
    used = set().union(*(metric_names(e) for _, e in queries(dash)))
    for needed in (
        "kvdepot_pool_used_bytes",
        "kvdepot_pool_pinned_bytes",
        "kvdepot_lookup_hits_total",
        "kvdepot_lookups_total",
        "kvdepot_transfer_size_bytes_count",
        "kvdepot_transfer_size_bytes_sum",
        "kvdepot_transfer_copy_seconds_bucket",
        "kvdepot_evictions_total",
        "kvdepot_dropped_stores_total",
        "kvdepot_engines",
        "kvdepot_failed_transfers_total",
        "kvdepot_pinned_keys_total",
        "kvdepot_remote_up",
        "kvdepot_remote_errors_total",
        "kvdepot_aborted_writes_total",
        "kvdepot_disk_capacity_bytes",
        "kvdepot_disk_used_bytes",
        "kvdepot_disk_write_bytes_total",
        "kvdepot_disk_read_bytes_total",
        "kvdepot_disk_write_drops_total",
        "kvdepot_disk_hits_total",
        "kvdepot_disk_recovery_scanned_bytes",
        "kvdepot_disk_up",
    ):
        assert needed in used, f"no panel shows {needed}"


# --- against a live daemon ------------------------------------------------------------------


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "info": ("_info",), "summary": ("_sum", "_count")}  # fmt: skip


def exported(port: int) -> tuple[set[str], set[str]]:
    """(names the daemon exports, names with at least one series now). A counter whose
    series carry a label (a drop reason, say) exports its name before its first series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        families = list(text_string_to_metric_families(resp.read().decode()))
    names = {f.name + suffix for f in families for suffix in _SUFFIXES.get(f.type, ("",))}
    return names, {s.name for f in families for s in f.samples}


@pytest.fixture
def busy_daemon(daemon_factory: Any, tmp_path: Path) -> Iterator[tuple[DaemonProcess, int]]:
    """A daemon with metrics on, a remote tier (a real redis-server) and a disk tier,
    after a few stores and a load (histograms non-empty)."""
    if not redis_available():
        pytest.fail("redis-server not found: apt-get install redis-server (scripts/test.sh does)")
    (port, redis_port) = free_ports(2)
    redis = RedisServer(tmp_path / "redis", redis_port).start()
    try:
        d = daemon_factory(
            "--pool-size",
            "16MiB",
            "--metrics-port",
            str(port),
            "--remote",
            redis.url,
            *shared_key_args(),
            "--disk",
            str(tmp_path / "disk"),
            "--disk-size",
            "16MiB",
        )
        client = connect(d.target, "grafana-test")
        try:
            geo = Geometry(
                groups=[[4096, 4096]], world_size=1, num_blocks=128, namespace="grafana-test"
            )
            eng = Engine(client, geo, 0)
            store(eng, range(0, 4))
            load(eng, range(0, 2), base_block=64)
            client.lookup("grafana-test", [b"\0" * 36])
            yield d, port
        finally:
            client.close()
    finally:
        redis.stop()


def test_every_panel_names_exported_metrics(busy_daemon: tuple[DaemonProcess, int]) -> None:
    _, port = busy_daemon
    names, _ = exported(port)
    missing = [
        f"{title}: {name} (in {expr})"
        for title, expr in queries(dashboard())
        for name in sorted(metric_names(expr))
        if name not in names
    ]
    assert not missing, "panels query metrics the daemon does not export:\n" + "\n".join(missing)
    # The check can fail: a name the daemon does not export is reported.
    assert "kvdepot_no_such_metric_total" not in names
    assert {"kvdepot_remote_up", "kvdepot_disk_up", "kvdepot_transfer_copy_seconds_bucket"} <= names
    assert metric_names('rate(kvdepot_no_such_metric_total{instance=~"$instance"}[5m])') == {
        "kvdepot_no_such_metric_total"
    }


def _prometheus() -> str:
    tool = shutil.which("prometheus")
    if tool is None:
        pytest.fail("prometheus not found: apt-get install prometheus (scripts/test.sh does)")
    return tool


def _get(url: str) -> Any:
    """Prometheus' JSON answer, errors (HTTP 400 for a bad query) included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def test_every_query_evaluates_in_prometheus(
    busy_daemon: tuple[DaemonProcess, int], tmp_path: Path
) -> None:
    d, metrics_port = busy_daemon
    prom_port = free_port()
    target = f"127.0.0.1:{metrics_port}"
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: kvdepot\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(
        [
            _prometheus(),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr: str) -> dict[str, Any]:
        return _get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))

    try:
        # A few scrapes, with traffic between them, so rate() has points to work on.
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                up = query(f'count_over_time(up{{instance="{target}"}}[1m])')["data"]["result"]
                if up and float(up[0]["value"][1]) >= 4:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus scraped the daemon too rarely"
            time.sleep(0.5)

        values = _get(
            f"{api}/label/instance/values?"
            + urllib.parse.urlencode({"match[]": "kvdepot_build_info"})
        )["data"]
        assert target in values, "the node variable's query finds no daemon"

        # What Grafana puts there for one selected node: a regex in a PromQL string, so
        # its backslashes are doubled.
        node = re.escape(target).replace("\\", "\\\\")
        _, with_series = exported(metrics_port)
        problems = []
        for title, expr in queries(dashboard()):
            live = expr.replace("$instance", node).replace("$__rate_interval", "1m")
            answer = query(live)
            if answer["status"] != "success":
                problems.append(f"{title}: {expr}: {answer}")
            # Series must come back, unless a metric has none yet (no drop so far, say).
            elif not answer["data"]["result"] and metric_names(expr) <= with_series:
                problems.append(f"{title}: {expr}: selects no series")
        assert not problems, "\n".join(problems)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert d.proc is not None and d.proc.poll() is None
