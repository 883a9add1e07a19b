"""What a lookup reaches of a prompt: its chunks from the first up to the first miss."""

from __future__ import annotations

from collections.abc import Sequence


def reach(ready: Sequence[bool]) -> tuple[int, int]:
    """(the leading chunks a lookup reaches, the chunks held behind the first miss: chunks
    no lookup reaches), from each chunk's readiness, in the prompt's order."""
    lead = list(ready).index(False) if False in ready else len(ready)
    return lead, sum(ready[lead:])
