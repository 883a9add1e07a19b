"""`kvdepot bench --remote URL` runs end to end against a real Redis and reports
its figures (their values are the bench's business, not this test's)."""

from __future__ import annotations

import json
import subprocess

from tests.support.daemon import kvdepot_command


def test_bench_remote_reports_tier_and_bare_figures(redis_standalone) -> None:
    out = subprocess.run(
        [*kvdepot_command(), "bench", "--remote", redis_standalone.url, "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    g = r["throughput"]["gb_per_s"]
    assert set(g) == {"bare_write", "bare_read", "tier_write", "tier_read"}
    assert all(v > 0 for v in g.values())
    m = r["miss_to_load"]
    assert m["bytes_identical"] and m["node_b"]["remote_hits"] == m["rows"]
    assert m["node_b"]["remote_verify_failures"] == 0
    assert "ratio" in out.stderr and "miss to block" in out.stderr
