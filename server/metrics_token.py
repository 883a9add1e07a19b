"""The metrics endpoint's bearer token (`--metrics-token-file`), read once at start."""

from __future__ import annotations

from kvdepot.server.secret_files import SecretFileError, read_secret_file

MAX_TOKEN_BYTES = 4096


class MetricsTokenError(ValueError):
    """A token file that cannot be used; the message is one line and holds no token."""


def read_token(path: str) -> str:
    """The bearer token in `path` (its first line); MetricsTokenError (one line) if the
    file is missing, others may read or change it, or it holds no token."""
    where = f"--metrics-token-file {path}"
    try:
        raw = read_secret_file(
            path,
            where,
            forbidden=0o007,
            mode_advice=f"lets other users read or change the token; chmod o-rwx {path}",
            max_bytes=MAX_TOKEN_BYTES,
            too_large=f"larger than {MAX_TOKEN_BYTES} bytes",
        )
    except SecretFileError as exc:
        raise MetricsTokenError(str(exc)) from None
    token = raw.decode(errors="replace").partition("\n")[0].strip()
    if not token or not token.isprintable() or " " in token:
        raise MetricsTokenError(f"{where}: its first line is no token (printable, no spaces)")
    return token
