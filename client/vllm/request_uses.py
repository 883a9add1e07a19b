"""What each request did with the daemon's chunks, for eviction's sake (scheduler thread).

A lookup walks a request's chunks from the first, so the daemon keeps prefixes by
admitting the chunks used together tail first (kvdepot.server.core.eviction). Two
things only the scheduler knows feed that:

- `RequestUses`: the chunks a request used, loaded, offered again while already
  stored (a prefix vLLM found in its own GPU cache), or stored, kept per group in
  the order vLLM named them (chunks ascending). When the request finishes, the
  manager sends them as one touch (UnpinSender.touch): the daemon makes them young
  again, the head youngest. This is how a prefix that requests keep using stays,
  and it costs no bytes: the connector never sends a stored chunk again.
- `OfferCounts`: vLLM's `store_threshold` admission, with vLLM's meaning
  (kv_offload.cpu.manager): every chunk offered for store is counted, the least
  recently offered forgotten past `max_tracker_size`; a chunk is stored only once
  offered `store_threshold` times (below 2: at once).

Both are plain objects the manager owns and calls from vLLM's scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class RequestUses:
    """The chunks each live request used, per group, in the order first used."""

    def __init__(self) -> None:
        # request -> group -> keys (a dict: ordered, each key once).
        self._uses: dict[str, dict[bytes, dict[bytes, None]]] = {}

    def note(self, req_id: str, keys: Iterable[bytes]) -> None:
        """`req_id` used `keys` (one group's or several, group-major, ascending)."""
        groups = self._uses.get(req_id)
        if groups is None:
            groups = self._uses[req_id] = {}
        for key in keys:
            group = key[-4:]  # the offload key's group id (big-endian)
            used = groups.get(group)
            if used is None:
                used = groups[group] = {}
            used[key] = None

    def finish(self, req_id: str) -> list[bytes]:
        """Forgets `req_id` and returns its chunks as a job names them: group-major
        (groups ascending), each group's chunks in the order they were used."""
        groups = self._uses.pop(req_id, None)
        if not groups:
            return []
        return [key for group in sorted(groups) for key in groups[group]]

    def clear(self) -> None:
        self._uses.clear()

    def __len__(self) -> int:
        return len(self._uses)


class OfferCounts:
    """vLLM's `store_threshold` with `max_tracker_size` (see the module docstring)."""

    def __init__(self, threshold: int, max_size: int) -> None:
        self.threshold = threshold
        self.max_size = max_size
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    @property
    def on(self) -> bool:
        return self.threshold >= 2

    def offer(self, offered: Sequence[bytes], candidates: list[bytes]) -> list[bytes]:
        """Counts one offer of each of `offered` and returns the `candidates` (keys
        not stored yet, among `offered`) offered at least `threshold` times."""
        counts = self._counts
        protected = 0  # counted keys of this offer: never forgotten to make room for it
        for key in offered:
            n = counts.get(key)
            if n is not None:
                counts.move_to_end(key)
                counts[key] = n + 1
                protected += 1
        unprotected = len(counts) - protected
        for key in offered:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if not unprotected:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1
        threshold = self.threshold
        return [k for k in candidates if counts.get(k, 0) >= threshold]

    def clear(self) -> None:
        self._counts.clear()
