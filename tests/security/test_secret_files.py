"""The secret files' one reader (server/secret_files.py), which the metrics token and
the fleet key share: checked on the open fd, refused in one line that never holds
the file's contents; the daemon-level refusals are in test_scrape_flood.py and
test_fleet.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvdepot.server.secret_files import SecretFileError, read_secret_file

SECRET = b"s3cret-" * 8


def read(path: Path, forbidden: int = 0o077, max_bytes: int = 4096) -> bytes:
    return read_secret_file(
        str(path),
        "--x-file",
        forbidden=forbidden,
        mode_advice="lets others read it",
        max_bytes=max_bytes,
        too_large="too large",
    )


def write(path: Path, data: bytes, mode: int) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_a_private_file_is_read_and_the_forbidden_bits_are_the_callers(tmp_path: Path) -> None:
    assert read(write(tmp_path / "key", SECRET, 0o600)) == SECRET
    group = write(tmp_path / "token", SECRET, 0o640)
    assert read(group, forbidden=0o007) == SECRET  # the token: its group may read it
    with pytest.raises(SecretFileError) as refused:
        read(group, forbidden=0o077)  # the fleet key: nobody else
    assert str(refused.value) == "--x-file: mode 0640 lets others read it"


@pytest.mark.parametrize("case", ["missing", "fifo", "directory", "too large"])
def test_what_is_no_secret_file_is_one_line_without_its_contents(tmp_path: Path, case: str) -> None:
    path = tmp_path / "f"
    if case == "fifo":  # a reader of a FIFO would block: refused on the fd, unread
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR)  # a writer end, so that opening it does not wait
    elif case == "directory":
        path.mkdir(mode=0o700)
    elif case == "too large":
        write(path, SECRET * 100, 0o600)
    with pytest.raises(SecretFileError) as refused:
        read(path, max_bytes=len(SECRET))
    if case == "fifo":
        os.close(fd)
    message = str(refused.value)
    assert message.startswith("--x-file: ") and "\n" not in message
    assert SECRET.decode() not in message
    assert {
        "missing": "No such file or directory",
        "fifo": "not a regular file",
        "directory": "not a regular file",
        "too large": "too large",
    }[case] in message
