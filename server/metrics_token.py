"""The metrics endpoint's bearer token (`--metrics-token-file`), read once at start."""

from __future__ import annotations

import os
import stat

MAX_TOKEN_BYTES = 4096


class MetricsTokenError(ValueError):
    """A token file that cannot be used; the message is one line and holds no token."""


def read_token(path: str) -> str:
    """The bearer token in `path` (its first line); MetricsTokenError (one line) if the
    file is missing, others may read or change it, or it holds no token."""
    where = f"--metrics-token-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise MetricsTokenError(f"{where}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # the file opened, not a name that may change meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise MetricsTokenError(f"{where}: not a regular file")
        if st.st_mode & 0o007:
            raise MetricsTokenError(
                f"{where}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read or change "
                f"the token; chmod o-rwx {path}"
            )
        raw = os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_TOKEN_BYTES:
        raise MetricsTokenError(f"{where}: larger than {MAX_TOKEN_BYTES} bytes")
    token = raw.decode(errors="replace").partition("\n")[0].strip()
    if not token or not token.isprintable() or " " in token:
        raise MetricsTokenError(f"{where}: its first line is no token (printable, no spaces)")
    return token
