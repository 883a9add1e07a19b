"""Shares of the pool per namespace: what `kvdepot serve --namespace-share` guarantees.

One engine's long prompts could otherwise evict every other engine's prefixes. An
operator gives a namespace (or every namespace whose id starts with a prefix: the
engines of one model, or a tenant's salted ids) a share of the pool; while a namespace
holds no more than its share, stores of other namespaces do not evict its rows
(`kvdepot.server.core.index_evict`). Its own stores, Evict and Clear still may; what it
holds beyond its share is evicted as ever, least recently used first. Without the
setting nothing changes.

Sans-I/O: parsed once from the setting's text, asked once per namespace when it is
declared (`BlockIndex.declare_namespace`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamespaceShares:
    """(pattern, fraction) rows, the first matching a namespace id wins. A pattern is a
    namespace id, or a prefix of ids ending in `*`; fractions add up to at most 1."""

    rows: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, text: str) -> NamespaceShares:
        """`ID=FRACTION[,PREFIX*=FRACTION...]`; raises ValueError saying what is wrong."""
        rows: list[tuple[str, float]] = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            pattern, sep, value = part.rpartition("=")
            pattern = pattern.strip()
            if not sep or not pattern or pattern == "*":
                raise ValueError(
                    f"{part!r}: a share is NAMESPACE=FRACTION or PREFIX*=FRACTION "
                    f"(e.g. kvd1-3f9c*=0.25)"
                )
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                raise ValueError(f"{part!r}: the share must be a fraction in (0, 1]")
            rows.append((pattern, fraction))
        total = sum(f for _, f in rows)
        if total > 1 + 1e-9:
            raise ValueError(f"the shares add up to {total:g} of the pool: at most 1")
        return cls(tuple(rows))

    def fraction_for(self, namespace_id: str) -> float:
        """The share of the pool `namespace_id` is guaranteed (0: none)."""
        for pattern, fraction in self.rows:
            if pattern.endswith("*"):
                if namespace_id.startswith(pattern[:-1]):
                    return fraction
            elif namespace_id == pattern:
                return fraction
        return 0.0

    def __str__(self) -> str:
        return ",".join(f"{p}={f:g}" for p, f in self.rows)
