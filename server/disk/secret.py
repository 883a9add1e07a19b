"""The disk tier's record key: created at first use, kept where only the daemon reads it.

`load_or_create(directory)` returns the `RecordKey` of the tier's directory:
`<dir>/kvdepot-disk.key`, 32 random bytes (os.urandom). The file is the daemon's
own as the tier's file is (kvdepot.server.memory.private_files): in a directory
the daemon owns and nobody else may write (checked by the caller, created 0700
when missing), opened with O_NOFOLLOW, mode 0600, owned by the daemon's euid; a
file anyone else could read or replace is refused (UnsafeFileError, a start-up
error). Clients never reach it: they talk to the daemon over its socket, and the
key never leaves this process (nothing sends it, logs it, or writes it elsewhere).

A missing key is created, written atomically (a crash leaves the whole key or
none). One that is not 32 bytes (damaged) is replaced, logged: the records
written under the old key no longer authenticate and are not adopted, which
costs a recompute (the disk is a cache), never a wrong byte. The caller holds the
tier file's lock, so two daemons never create one at once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvdepot.server.disk.record import KEY_BYTES, RecordKey
from kvdepot.server.memory import private_files

log = logging.getLogger("kvdepot.disk")

FILE_NAME = "kvdepot-disk.key"
WHAT = "the disk tier's record key"


def load_or_create(directory: Path) -> RecordKey:
    """The directory's record key, created when missing or damaged. Raises
    UnsafeFileError (someone else's file, or one others may read), OSError."""
    path = directory / FILE_NAME
    try:
        secret = private_files.read_private(str(path), WHAT)
    except FileNotFoundError:
        secret = None
    if secret is not None and len(secret) == KEY_BYTES:
        return RecordKey(secret)
    if secret is not None:
        log.warning(
            "%s %s has %d bytes, not %d (damaged): a new key replaces it, and the records "
            "written under the old one are not adopted (recomputed when asked for)",
            WHAT,
            path,
            len(secret),
            KEY_BYTES,
        )
    secret = os.urandom(KEY_BYTES)
    private_files.write_atomically(path, secret, WHAT)
    log.info("created %s %s (mode 0600)", WHAT, path)
    return RecordKey(secret)
