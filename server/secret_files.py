"""A small file holding a secret, read once at start (`--metrics-token-file`, the
fleet key's `--remote-key-file`): opened, checked on its open fd, read.

Checked on the fd (a regular file; none of `forbidden` mode bits set; at most
`max_bytes`), not on a name that may change between the check and the read. A
refusal is one line naming the setting and never holding the file's contents.
"""

from __future__ import annotations

import os
import stat


class SecretFileError(ValueError):
    """A secret file that cannot be used: one line, without its contents."""


def read_secret_file(
    path: str, where: str, *, forbidden: int, mode_advice: str, max_bytes: int, too_large: str
) -> bytes:
    """The bytes of `path`. `where` starts every message (e.g. "--metrics-token-file
    PATH"); a mode with any `forbidden` bit is refused with "mode NNNN
    {mode_advice}", a file over `max_bytes` with `too_large`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SecretFileError(f"{where}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)  # the file opened, not a name that may change meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{where}: not a regular file")
        if st.st_mode & forbidden:
            raise SecretFileError(f"{where}: mode {stat.S_IMODE(st.st_mode):04o} {mode_advice}")
        if st.st_size > max_bytes:
            raise SecretFileError(f"{where}: {too_large}")
        raw = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # grew since fstat
        raise SecretFileError(f"{where}: {too_large}")
    return raw
