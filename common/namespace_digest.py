"""The namespace id as a digest of its inputs, computed alike by engines and the daemon.

An engine's namespace id (client/vllm/namespace.py) is 'kvd<format>-' and 40 hex digits
of a SHA-256 over the canonical JSON of its inputs: the model's identity, KV dtype and
layout, groups and their pages, parallel layout, hash algorithm and seed, salt. A worker
declares its namespace with those inputs beside the layout (`NamespaceLayout.
digest_inputs`), so the daemon can recompute the id and check that the declared layout
is the one the id was computed for: knowing an unsalted id (anyone with the same model
can compute it) is then no way to declare it with another layout first.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

#: Bump when the meaning of the digest inputs or the section byte layout changes.
NAMESPACE_FORMAT = 1
ID_PREFIX = f"kvd{NAMESPACE_FORMAT}-"
DIGEST_HEX = 40

# A digest id, or one derived from it after a dot: an engine's private namespace after
# a cache reset ('<id>.r<generation>-<nonce>'), a shard's part of it ('<id>.s0of2').
_DIGEST_ID = re.compile(r"kvd\d+-([0-9a-f]{40})(?:$|\.)")


def canonical(fields: dict[str, Any]) -> str:
    """The text the digest is taken over: sorted keys, no spaces."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def digest_id(fields: dict[str, Any], prefix: str = ID_PREFIX) -> str:
    """The namespace id of these digest inputs."""
    return prefix + hashlib.sha256(canonical(fields).encode()).hexdigest()[:DIGEST_HEX]


def digest_of(namespace_id: str) -> str | None:
    """The 40 hex digits of a digest id (of its base id, for one derived from it); None
    for an id of another form."""
    m = _DIGEST_ID.match(namespace_id)
    return m.group(1) if m else None
