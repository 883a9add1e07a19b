"""`kvdepot serve` settings: Prometheus metrics and the node's KV-event stream."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting


@dataclass
class ObservingSettings:
    """Prometheus metrics and the KV-event stream for routers."""

    metrics_port: int | None = setting(
        "--metrics-port",
        parse=parsers.whole_number(0, 65535),
        metavar="PORT",
        shown="off",
        help="serve Prometheus metrics on this port",
    )
    metrics_addr: str = setting(
        "--metrics-addr",
        "127.0.0.1",
        parse=parsers.address,
        metavar="ADDR",
        help="address the metrics endpoint listens on: loopback by default, 0.0.0.0 (or "
        "the pod IP) for a scrape from another host or pod",
    )
    metrics_token_file: str | None = setting(
        "--metrics-token-file",
        metavar="PATH",
        shown="none: every request is answered",
        help="a bearer token (the file's first line) that every scrape must send "
        "(`Authorization: Bearer TOKEN`; Prometheus: `authorization: {credentials_file: ...}`); "
        "others get 401. Others must not read it (chmod o-rwx)",
    )
    kv_events: str | None = setting(
        "--kv-events",
        parse=parsers.zmq_tcp,
        metavar="tcp://HOST:PORT",
        shown="off",
        help="publish the pool's blocks to KV-cache-aware routers (llm-d, Dynamo) in "
        "vLLM's KV-event format, as vLLM does: tcp://*:PORT binds PORT (replay requests "
        "on PORT+1), tcp://HOST:PORT connects to a router's SUB socket",
    )
    kv_events_topic: str = setting(
        "--kv-events-topic",
        "",
        metavar="TOPIC",
        shown="none",
        help="the ZMQ topic of --kv-events' messages (llm-d expects kv@POD-IP@MODEL)",
    )
