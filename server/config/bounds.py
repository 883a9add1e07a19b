"""`kvdepot serve` settings: what one request may ask, the pool's shares per namespace,
reservations and eviction."""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.server import setting_parsers as parsers
from kvdepot.server.config.table import setting
from kvdepot.server.core.shares import NamespaceShares


@dataclass
class BoundSettings:
    """Bounds on one request, the pool's shares per namespace, reservations, the eviction policy."""

    max_job_keys: int = setting(
        "--max-job-keys",
        4096,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in keys",
    )
    # Bounds on what one request may make the event loop do (docs/security.md):
    # checked on the message's counts before anything is built from it.
    max_job_blocks: int = setting(
        "--max-job-blocks",
        16384,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in GPU block ids (16384 blocks of 16 tokens: 256k tokens)",
    )
    max_job_pages: int = setting(
        "--max-job-pages",
        1 << 20,
        parse=parsers.whole_number(1),
        metavar="N",
        help="largest transfer job in pages (block ids x layers of their group; Llama-3-405B's "
        "126 layers x 8192 blocks fit); larger jobs are refused with RESOURCE_EXHAUSTED",
    )
    # (setting() makes a dataclass field; the default is built per ServeConfig.)
    namespace_share: NamespaceShares = setting(  # noqa: RUF009
        "--namespace-share",
        default_factory=NamespaceShares,
        parse=NamespaceShares.parse,
        metavar="NS=FRACTION,...",
        shown="",
        help="a share of the pool per namespace (an id, or a prefix of ids ending in *), "
        "e.g. 'kvd1-3f9c*=0.25': while a namespace holds no more than its share, other "
        "namespaces' stores do not evict its rows; shares add up to at most 1 (default: "
        "none, every row competes in one LRU)",
    )
    max_batch_keys: int = setting(
        "--max-batch-keys",
        16384,
        parse=parsers.whole_number(1),
        metavar="N",
        help="keys in one Lookup, Pin, Unpin or Prefetch call",
    )
    reservation_timeout: float = setting(
        "--reservation-timeout",
        60.0,
        parse=parsers.seconds,
        shown="60",
        metavar="SECONDS",
        help="seconds a partly written block row may wait for its other ranks",
    )
    eviction_policy: str = setting(
        "--eviction-policy",
        "lru",
        parse=parsers.one_of("lru", "arc"),
        help="which rows a full pool evicts first: lru (the least recently used) or arc "
        "(adaptive replacement: rows used again are kept from rows used once)",
    )
