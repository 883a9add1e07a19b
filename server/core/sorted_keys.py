"""A sorted set of keys in chunks, for paging and walking an index in slices.

Admin/ListBlocks pages by key and bulk eviction walks a namespace a slice at a
time; both must cost O(log n + page), not O(n), with 10^6 blocks. A plain sorted
list costs O(n) per insert (memmove), a tree costs memory; this is the middle
way (the layout sortedcontainers uses): a list of sorted chunks of at most
`CHUNK` keys, with each chunk's first key indexed for bisection. Insert and
remove are O(log n + CHUNK); `after(key, n)` is O(log n + n).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator

CHUNK = 1024  # a chunk splits in two at 2 * CHUNK keys


class SortedKeys:
    """Distinct bytes keys in ascending order."""

    def __init__(self) -> None:
        self._chunks: list[list[bytes]] = []
        self._firsts: list[bytes] = []  # _chunks[i][0], for bisection
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _chunk_of(self, key: bytes) -> int:
        """The chunk that holds `key`, or would: the last one starting at or before it."""
        return max(bisect_right(self._firsts, key) - 1, 0)

    def add(self, key: bytes) -> None:
        """Adds `key` (the caller guarantees it is absent)."""
        # add and remove run for every row stored and evicted: _chunk_of inlined, and
        # a chunk's first key rewritten only when it changes.
        chunks, firsts = self._chunks, self._firsts
        if not chunks:
            chunks.append([key])
            firsts.append(key)
            self._len = 1
            return
        i = bisect_right(firsts, key) - 1
        if i < 0:  # before every key: it becomes the first chunk's first
            i = 0
            firsts[0] = key
        chunk = chunks[i]
        insort(chunk, key)
        self._len += 1
        if len(chunk) > 2 * CHUNK:
            half = chunk[CHUNK:]
            del chunk[CHUNK:]
            chunks.insert(i + 1, half)
            firsts.insert(i + 1, half[0])

    def remove(self, key: bytes) -> None:
        """Removes `key`; KeyError when absent."""
        firsts = self._firsts
        i = bisect_right(firsts, key) - 1
        if i < 0:
            raise KeyError(key)
        chunk = self._chunks[i]
        j = bisect_left(chunk, key)
        if j == len(chunk) or chunk[j] != key:
            raise KeyError(key)
        del chunk[j]
        self._len -= 1
        if not j:
            if chunk:
                firsts[i] = chunk[0]
            else:
                del self._chunks[i]
                del firsts[i]

    def after(self, key: bytes | None, limit: int) -> list[bytes]:
        """Up to `limit` keys greater than `key` (from the first when None), in order."""
        if not self._chunks or limit <= 0:
            return []
        if key is None:
            i, j = 0, 0
        else:
            i = self._chunk_of(key)
            j = bisect_right(self._chunks[i], key)
        out: list[bytes] = []
        while i < len(self._chunks) and len(out) < limit:
            chunk = self._chunks[i]
            out.extend(chunk[j : j + limit - len(out)])
            i, j = i + 1, 0
        return out

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            yield from chunk
