"""The fleet key: the secret every node of a fleet shares, read from a file.

Rows written to the remote tier carry a keyed BLAKE3 MAC under this key
(kvdepot.server.remote.codec, format 2), so a node loads only rows a holder
of the key wrote: write access to the shared Redis is not enough.

The file (`--remote-key-file`, KVDEPOT_REMOTE_KEY_FILE) holds the current key
on its first line and, optionally, the previous one on its second (rotation:
rows are verified with either, written with the current). A row a node admits
remembers the id of the key that verified it (`Slot.admitted_by`), so that a
restart without that key drops it wherever the node kept it (docs/security.md).
Each key is a line of at least 32 characters (e.g. `openssl rand -hex 32`); blank lines and lines
starting with `#` are skipped. The file must not be readable or writable by
anyone but its owner (mode & 0o077 == 0): a key others can read is no secret.

The keys themselves never leave this module: it keeps only what is derived from
them (the MAC key and an 8-byte id, both BLAKE3 derive_key outputs), and no
message it raises contains a key.
"""

from __future__ import annotations

from dataclasses import dataclass

from blake3 import blake3

from kvdepot.server.secret_files import SecretFileError, read_secret_file

MIN_KEY_CHARS = 32
KEY_ID_BYTES = 8
# What a row admitted under format 1 (--remote-insecure, no key) remembers in place
# of a key id: a derived id is never this (but with odds of 2^-64).
INSECURE_ID = b"\xff" * KEY_ID_BYTES
_MAC_CONTEXT = "kvdepot 2025-07 remote tier value MAC v2"
_ID_CONTEXT = "kvdepot 2025-07 remote tier key id v2"


class KeyFileError(ValueError):
    """A key file that cannot be used; the message is one line and names no key."""


@dataclass(frozen=True, repr=False)
class FleetKey:
    id: bytes  # 8 bytes, written in each value's header: which key made its MAC
    mac_key: bytes  # 32 bytes, the keyed-BLAKE3 key

    def __repr__(self) -> str:  # never the key, even in a traceback
        return f"FleetKey(id={self.id.hex()})"


def derive(secret: bytes) -> FleetKey:
    """The MAC key and id of one secret (separate derivations: the id, which is
    stored in the clear, tells nothing about the MAC key)."""
    return FleetKey(
        id=blake3(secret, derive_key_context=_ID_CONTEXT).digest(KEY_ID_BYTES),
        mac_key=blake3(secret, derive_key_context=_MAC_CONTEXT).digest(),
    )


@dataclass(frozen=True)
class Keyring:
    """The current key (writes, reads) and the previous one (reads only)."""

    current: FleetKey
    previous: FleetKey | None = None

    def by_id(self, key_id: bytes) -> FleetKey | None:
        if key_id == self.current.id:
            return self.current
        if self.previous is not None and key_id == self.previous.id:
            return self.previous
        return None

    @property
    def ids(self) -> frozenset[bytes]:
        """The ids of the keys held: a row admitted under another is dropped."""
        return frozenset(k.id for k in (self.current, self.previous) if k is not None)

    @classmethod
    def from_secrets(cls, current: bytes, previous: bytes | None = None) -> Keyring:
        return cls(derive(current), derive(previous) if previous else None)


def load_key_file(path: str) -> Keyring:
    """The keyring of `path`; KeyFileError (one line) if it cannot be used."""
    try:
        raw = read_secret_file(
            path,
            f"--remote-key-file {path}",
            forbidden=0o077,
            mode_advice=(
                f"lets other users or the group read or change the fleet key; chmod 600 {path}"
            ),
            max_bytes=4096,
            too_large="larger than 4 KiB, not a key file",
        )
    except SecretFileError as exc:
        raise KeyFileError(str(exc)) from None
    lines = [ln.strip() for ln in raw.splitlines()]
    keys = [ln for ln in lines if ln and not ln.startswith(b"#")]
    if not keys:
        raise KeyFileError(f"--remote-key-file {path}: no key in it")
    if len(keys) > 2:
        raise KeyFileError(
            f"--remote-key-file {path}: {len(keys)} keys; at most two (current, then previous)"
        )
    for n, k in enumerate(keys, 1):
        if len(k) < MIN_KEY_CHARS:
            raise KeyFileError(
                f"--remote-key-file {path}: key {n} has {len(k)} characters, fewer than "
                f"{MIN_KEY_CHARS} (make one with: openssl rand -hex 32)"
            )
    previous = keys[1] if len(keys) > 1 and keys[1] != keys[0] else None
    return Keyring.from_secrets(keys[0], previous)
