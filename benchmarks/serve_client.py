"""The serving benchmark's client: streaming completions timed per token, and where the
prompt tokens came from, read off vLLM's own counters.

Standard library only (http.client in threads): one connection per request in flight,
so nothing in the client queues a request behind another.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from kvdepot.bench.serve_workloads import Request, Workload
from kvdepot.bench.vllm_server import HTTPServer, prometheus_value

#: vLLM's prompt-token counter, by source (vllm/v1/metrics/stats.py PromptTokenStats)
SOURCES = {
    "local": "local_cache_hit",
    "kvdepot": "external_kv_transfer",
    "computed": "local_compute",
}


@dataclass
class Result:
    request: Request
    setup: str
    start: float = 0.0  # time.monotonic() when sent
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # usage.prompt_tokens_details (local + external)
    #: tokens by source for this request (None when requests overlapped: per run then)
    sources: dict[str, float] | None = None
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        r = self.request
        return {
            "setup": self.setup,
            "workload": r.workload,
            "phase": r.phase,
            "user": r.user,
            "round": r.round,
            "server": r.server,
            "prompt_tokens": len(r.prompt),
            "output_tokens": len(self.token_ids),
            "ttft_ms": self.ttft_s * 1e3,
            "e2e_ms": self.e2e_s * 1e3,
            "itl_ms_mean": 1e3 * sum(self.itl_s) / len(self.itl_s) if self.itl_s else 0.0,
            "cached_tokens": self.cached_tokens,
            "sources": self.sources,
            "token_ids": self.token_ids,
            "error": self.error,
        }


def counters(server: HTTPServer) -> dict[str, float]:
    """vLLM's prompt tokens by source on `server`, so far."""
    page = server.metrics()
    return {
        name: prometheus_value(page, "vllm:prompt_tokens_by_source_total", source=source)
        for name, source in SOURCES.items()
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def stream(server: HTTPServer, req: Request, setup: str, timeout: float = 600.0) -> Result:
    """One streaming completion (greedy, a fixed number of tokens), timed at the client:
    TTFT to the first chunk with a token, ITL between chunks with tokens."""
    out = Result(req, setup)
    url = urllib.parse.urlsplit(server.base)
    body = json.dumps(
        {
            "model": server.model_name(),
            "prompt": list(req.prompt),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # every setup generates the same number of tokens
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
    )
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        out.start = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        last = 0.0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.monotonic()
            usage = chunk.get("usage")
            if usage and usage.get("prompt_tokens_details"):
                out.cached_tokens = usage["prompt_tokens_details"].get("cached_tokens")
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if not ids:
                    continue
                if not out.token_ids:
                    out.ttft_s = now - out.start
                else:
                    out.itl_s.append(now - last)
                last = now
                out.token_ids.extend(ids)
        out.e2e_s = time.monotonic() - out.start
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


@dataclass
class RunResult:
    setup: str
    workload: str
    results: list[Result]
    wall_s: float
    #: tokens by source over the run, every server together
    sources: dict[str, float]
    #: "per request" (one at a time: each request's own counter deltas) or "per run"
    sources_scope: str
    qps: float | None = None


def run_serial(
    servers: list[HTTPServer], setup: str, name: str, requests: list[Request]
) -> RunResult:
    """One request at a time: each request's own deltas of vLLM's counters."""
    results = []
    started = time.monotonic()
    totals: dict[str, float] = dict.fromkeys(SOURCES, 0.0)
    for req in requests:
        server = servers[req.server]
        before = counters(server)
        res = stream(server, req, setup)
        res.sources = delta(counters(server), before)
        for k, v in res.sources.items():
            totals[k] += v
        results.append(res)
    return RunResult(setup, name, results, time.monotonic() - started, totals, "per request")


def run_open_loop(
    servers: list[HTTPServer], setup: str, name: str, workload: Workload, qps: float
) -> RunResult:
    """Requests offered at `qps` (round-major, evenly spaced), each user's next round
    no earlier than its previous answer: counters per run (requests overlap)."""
    before = [counters(s) for s in servers]
    users = sorted({r.user for r in workload.requests})
    slots = {(r.user, r.round): i for i, r in enumerate(workload.requests)}
    results: list[Result] = []
    lock = threading.Lock()
    t0 = time.monotonic() + 0.05

    def user_loop(user: int) -> None:
        for rnd in workload.rounds:
            for req in rnd:
                if req.user != user:
                    continue
                wait = t0 + slots[(req.user, req.round)] / qps - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                res = stream(servers[req.server], req, setup)
                with lock:
                    results.append(res)

    threads = [threading.Thread(target=user_loop, args=(u,), daemon=True) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    totals: dict[str, float] = dict.fromkeys(SOURCES, 0.0)
    for server, b in zip(servers, before, strict=True):
        for k, v in delta(counters(server), b).items():
            totals[k] += v
    results.sort(key=lambda r: (r.request.round, r.request.user))
    return RunResult(setup, name, results, wall, totals, "per run", qps)
