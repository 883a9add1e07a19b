"""The metrics endpoint: GET /metrics over HTTP, on a thread of its own.

The endpoint may be reachable from other hosts (`--metrics-addr 0.0.0.0`, the DaemonSet),
so whoever reaches it must not be able to slow the engines:

- With `--metrics-token-file` a request is answered only if it carries
  `Authorization: Bearer <token>`; any other gets 401 before any metric is read.
- One thread answers one request at a time (a connection that sends nothing is dropped
  after REQUEST_TIMEOUT_S), and it sleeps after each request so that it uses at most
  DUTY_CYCLE of a CPU: Python threads share one interpreter lock, and a thread busy
  answering a flood would hold the event loop's thread back too. That also bounds how
  often a scrape reads the state on the event loop (a callback there, O(namespaces):
  kvdepot.server.metrics): a few dozen times a second at most, whatever the flood.
"""

from __future__ import annotations

import hmac
import http.server
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

DUTY_CYCLE = 0.1
REQUEST_TIMEOUT_S = 5.0
PATHS = ("/metrics", "/")


def _handler(
    registry: CollectorRegistry, token: str | None
) -> type[http.server.BaseHTTPRequestHandler]:
    expected = f"Bearer {token}".encode() if token else None

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # a connection that sends nothing is dropped

        def do_GET(self) -> None:
            if self.path.partition("?")[0] not in PATHS:
                self._answer(404, b"only /metrics is served here\n")
            elif expected is not None and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode(errors="replace"), expected
            ):
                self._answer(401, b"a bearer token is needed\n", ("WWW-Authenticate", "Bearer"))
            else:
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._answer(200, encoder(registry), ("Content-Type", content_type))

        def _answer(self, code: int, body: bytes, *headers: tuple[str, str]) -> None:
            self.send_response(code)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a request a line on stderr would be a flood of its own

    return Handler


class _Server(http.server.HTTPServer):
    """One request at a time, and a rest after each in proportion to its CPU time."""

    request_queue_size = 64  # connections waiting their turn (Prometheus' among a flood)

    def process_request(self, request: Any, client_address: Any) -> None:
        used = time.thread_time()
        super().process_request(request, client_address)
        used = time.thread_time() - used
        time.sleep(used * (1 - DUTY_CYCLE) / DUTY_CYCLE)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away, or a broken request: nothing to tell anyone


def serve(
    registry: CollectorRegistry, port: int, addr: str, token: str | None
) -> Callable[[], None]:
    """Serves http://addr:port/metrics on a daemon thread; returns what stops it."""
    server = _Server((addr, port), _handler(registry, token))
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server.shutdown
