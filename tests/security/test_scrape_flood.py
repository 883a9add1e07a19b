"""A scrape flood costs the engines nothing much (docs/security.md, "Metrics").

An attacker process (tests/security/scrape_flood.py) requests /metrics in a loop on 8
threads for 8 s, while a victim engine measures its Lookup latency against the same
figure just before, and loads its rows byte for byte. With `--metrics-token-file` the
attacker, without the token, gets 401 for every request and a scrape with the token
still answers; without a token file every scrape is answered, one at a time, and the
endpoint's thread works a bounded share of the time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.security.test_operator import serve_refused
from tests.security.test_preauth import Victim
from tests.support.faults import DaemonFactory, rss_mib
from tests.support.ops import free_port

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).parent
SECONDS = 8.0
THREADS = 8
TOKEN = "s3cret-scrape-token"


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("endpoint", ["open", "token"])
def test_a_scrape_flood_does_not_slow_the_engines(
    daemon_factory: DaemonFactory, tmp_path: Path, endpoint: str
) -> None:
    port = free_port()
    args = ["--pool-size", "64MiB", "--metrics-port", str(port)]
    if endpoint == "token":
        token_file = tmp_path / "metrics.token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        args += ["--metrics-token-file", str(token_file)]
    d = daemon_factory(*args)
    url = f"http://127.0.0.1:{port}/metrics"
    victim = Victim(d)
    quiet = victim.lookup_ms(n=400)
    rss_quiet = rss_mib(d.proc.pid)
    p = subprocess.Popen(
        [sys.executable, str(HERE / "scrape_flood.py"), url, str(SECONDS), str(THREADS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdin is not None and p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        cpu_before, t = cpu_s(d.proc.pid), time.monotonic()
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(0.5)  # under way
        loud = victim.lookup_ms(n=400, seconds=SECONDS - 2)
        rss_loud = rss_mib(d.proc.pid)
        cpu = (cpu_s(d.proc.pid) - cpu_before) / (time.monotonic() - t)
        if endpoint == "token":  # Prometheus, with the token, during the flood
            status, body = get(url, TOKEN)
            assert status == 200 and "kvdepot_pool_used_bytes" in body, status
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    codes = json.loads(out.strip().splitlines()[-1])
    print(
        f"\n{endpoint}: victim Lookup ms quiet p50 {statistics.median(quiet):.2f} "
        f"max {max(quiet):.1f}; under {codes} in {SECONDS} s: p50 "
        f"{statistics.median(loud):.2f} max {max(loud):.1f}; RSS MiB {rss_quiet:.0f} -> "
        f"{rss_loud:.0f}; daemon CPU {cpu:.2f} (victim's Lookups included)"
    )
    if endpoint == "token":
        # 401 for each request answered (a connection past the listen queue is refused).
        assert "200" not in codes and codes.get("401", 0) >= 100, codes
        assert get(url)[0] == 401 and get(url, "wrong")[0] == 401
    else:
        assert codes.get("200", 0) >= 100, codes
    base = statistics.median(quiet)
    assert statistics.median(loud) < max(1.5 * base, base + 1.0), (base, loud)
    assert victim.round_trips()


def test_a_token_file_others_can_read_stops_the_start(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    line = serve_refused(tmp_path, "--metrics-port", str(free_port()),
                         "--metrics-token-file", str(token_file))  # fmt: skip
    assert "--metrics-token-file" in line and "chmod o-rwx" in line and TOKEN not in line
    line = serve_refused(tmp_path, "--metrics-token-file", str(tmp_path / "missing"))
    assert "No such file" in line, line


def test_only_the_metrics_path_is_served(daemon_factory: DaemonFactory) -> None:
    port = free_port()
    daemon_factory("--pool-size", "64MiB", "--metrics-port", str(port))
    assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    assert get(f"http://127.0.0.1:{port}/secrets")[0] == 404
