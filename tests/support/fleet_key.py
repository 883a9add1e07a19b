"""Fleet keys for tests of the remote tier: key files as the daemon wants them
(mode 0600), and one shared by every node the tests start unless a test makes
its own (kvdepot.server.remote.fleet_key)."""

from __future__ import annotations

import atexit
import secrets
import shutil
import tempfile
from pathlib import Path

from kvdepot.server.remote.codec import Codec
from kvdepot.server.remote.fleet_key import Keyring

_shared: Path | None = None
_shared_secret = secrets.token_hex(32)


def new_secret() -> str:
    return secrets.token_hex(32)


def write_key_file(path: Path, *keys: str, mode: int = 0o600) -> Path:
    """A key file: the current key, then (optionally) the previous one."""
    path.write_text("".join(k + "\n" for k in keys))
    path.chmod(mode)
    return path


def shared_key_args() -> list[str]:
    """`--remote-key-file PATH` of one key file for this test run: the nodes the tests
    start form one fleet."""
    global _shared
    if _shared is None:
        d = Path(tempfile.mkdtemp(prefix="kvdepot-fleet-"))
        atexit.register(shutil.rmtree, d, True)
        _shared = write_key_file(d / "fleet.key", _shared_secret)
    return ["--remote-key-file", str(_shared)]


def shared_codec() -> Codec:
    """The codec of the nodes started with `shared_key_args()`: to read or write
    their rows from a test."""
    return Codec(Keyring.from_secrets(_shared_secret.encode()))
