"""Files are the daemon's own (docs/security.md): the pool file, its lock, snapshot
and journal, with real `kvdepot serve` processes.

Attacks: a pool directory others may write (/dev/shm itself, 0777, 0770), one of
another uid; a pool file, lock, snapshot or journal planted by someone else,
given mode 0666, or made a symlink (to a file of the daemon's user, or dangling
where O_CREAT would create the target). Each is refused before anything is
opened, with one ERROR line and exit 2, and the file the link points at is left
as it was; beside each, the legitimate path works: a fresh directory the daemon
creates 0700, files 0600, a warm restart and a crash recovery byte-exact.

Crafted journals (the header without its fields, a file cut mid-record, a
malformed record, rows claiming a huge, overlapping or out-of-pool extent): the
daemon starts, serves, recovers what verifies, and its log says why it dropped
the rest. Fuzzing of the replay and the snapshot decoder: test_files_fuzz.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdepot.server.core import journal
from kvdepot.server.memory import journal_file, pool_file, private_files
from kvdepot.server.memory.arena import Arena
from tests.support import soak
from tests.support.daemon import DaemonProcess, connect, kvdepot_command
from tests.support.engine import Engine, make_key
from tests.support.faults import DaemonFactory, admin, stats
from tests.test_crash_recovery import served_rows_are_intact, wait_sealed
from tests.test_warm_restart import NS, store_rows, verify_rows, wait_recovered

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534
SUFFIXES = {"": "the pool file", ".lock": "lock file", ".index": "snapshot", ".journal": "journal"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short private directory (Unix socket paths are limited to 108 bytes)."""
    return tmp_path_factory.mktemp("kvf")


def private_dir(path: Path) -> Path:
    path.mkdir()
    os.chmod(path, 0o700)
    return path


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def serve_refused(work: Path, pool: Path, *words: str) -> str:
    """`kvdepot serve --pool-file pool` exits 2 with one ERROR line holding `words`."""
    out = subprocess.run(
        [*kvdepot_command(), "serve", "--socket", str(work / "k.sock"), "--pool-size", "4MiB",
         "--pool-file", str(pool)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = [ln for ln in out.stderr.splitlines() if "ERROR" in ln or "Traceback" in ln]
    assert len(lines) == 1, out.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def store_and_load(d: DaemonProcess) -> None:
    """The legitimate path: rows stored by both ranks load back byte for byte."""
    client = connect(d, "legit")
    keys, _ = store_rows(client)
    verify_rows(client, keys)
    client.close()


# -- the legitimate path -----------------------------------------------------------------------


def test_a_fresh_directory_is_created_0700_and_restarts_stay_byte_exact(
    daemon_factory: DaemonFactory, work: Path
) -> None:
    state = work / "state"  # missing: the daemon creates it, 0700
    pool = state / "kvdepot.pool"
    d = daemon_factory("--pool-size", "32MiB", "--pool-file", str(pool))
    assert mode_of(state) == 0o700 and os.stat(state).st_uid == os.geteuid()
    for suffix in ("", ".lock", ".journal"):
        f = Path(str(pool) + suffix)
        assert mode_of(f) == 0o600 and os.stat(f).st_uid == os.geteuid(), suffix
    client = connect(d, "writer")
    keys, half = store_rows(client)
    wait_sealed(pool, keys)
    client.close()

    assert d.stop() == 0  # clean: the snapshot, 0600 too
    assert mode_of(Path(str(pool) + ".index")) == 0o600
    d.start()
    assert stats(admin(d.admin_channel())).warm_restarted
    client = connect(d, "after-stop")
    verify_rows(client, keys)
    assert client.lookup(NS, half) == [False] * len(half)
    client.close()

    d.kill()  # a crash: the journal brings the rows back
    d.start()
    s = wait_recovered(admin(d.admin_channel()))
    assert s.recovery_blocks_verified == len(keys), s
    client = connect(d, "after-kill")
    verify_rows(client, keys)
    client.close()
    assert mode_of(state) == 0o700


# -- the directory -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o770, 0o720])
def test_a_directory_others_may_write_is_refused(
    daemon_factory: DaemonFactory, work: Path, mode: int
) -> None:
    shared = work / "shm"  # like /dev/shm itself (1777), or a group's directory
    shared.mkdir()
    os.chmod(shared, mode)
    pool = shared / "kvdepot.pool"
    line = serve_refused(
        work, pool, "writable by group or others", f"mode {mode:04o}", f"{shared}/kvdepot/"
    )
    assert not pool.exists() and not Path(str(pool) + ".lock").exists(), line
    # What the message advises: a directory of the daemon's own inside it.
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(shared / "kvdepot" / "k.pool"))
    assert mode_of(shared / "kvdepot") == 0o700
    store_and_load(d)


@needs_root
def test_a_directory_of_another_uid_is_refused(daemon_factory: DaemonFactory, work: Path) -> None:
    theirs = private_dir(work / "theirs")
    os.chown(theirs, NOBODY, NOBODY)
    serve_refused(work, theirs / "kvdepot.pool", f"belongs to uid {NOBODY}", "not to the daemon")
    assert os.listdir(theirs) == []
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(work / "ours" / "k.pool"))
    store_and_load(d)


# -- planted files -----------------------------------------------------------------------------


def plant_other_uid(path: Path, victim: Path) -> None:
    path.write_bytes(b"planted")
    os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)


def plant_world_writable(path: Path, victim: Path) -> None:
    path.write_bytes(b"planted")
    os.chmod(path, 0o666)


def plant_symlink(path: Path, victim: Path) -> None:
    path.symlink_to(victim)


def plant_dangling_symlink(path: Path, victim: Path) -> None:
    # O_CREAT through it would create the target: must not happen.
    path.symlink_to(victim.with_name(victim.name + ".created"))


PLANTS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "other-uid": (plant_other_uid, f"belongs to uid {NOBODY}"),
    "mode-0666": (plant_world_writable, "has mode 0666"),
    "symlink": (plant_symlink, "is a symbolic link"),
    "dangling-symlink": (plant_dangling_symlink, "is a symbolic link"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_pool_file_lock_snapshot_or_journal_is_refused(
    daemon_factory: DaemonFactory, work: Path, plant: str
) -> None:
    if plant == "other-uid" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    how, words = PLANTS[plant]
    state = private_dir(work / "state")
    pool = state / "kvdepot.pool"
    victim = work / "victim"  # a file of the daemon's own user, outside the pool directory
    secret = os.urandom(4096)
    victim.write_bytes(secret)
    os.chmod(victim, 0o600)
    for suffix, what in SUFFIXES.items():
        target = Path(str(pool) + suffix)
        how(target, victim)
        line = serve_refused(work, pool, words, str(target), what)
        # Nothing read, written, truncated, created or locked through the planted file.
        assert victim.read_bytes() == secret, line
        assert not victim.with_name("victim.created").exists(), line
        target.unlink()
        assert os.listdir(state) == [], (suffix, os.listdir(state))
    # Beside it, the same directory serves once the planted files are gone.
    d = daemon_factory("--pool-size", "16MiB", "--pool-file", str(pool))
    store_and_load(d)
    assert victim.read_bytes() == secret


# -- at open time ------------------------------------------------------------------------------


def test_every_open_refuses_what_the_start_check_refuses(work: Path) -> None:
    """A file swapped in after the start-up check (a race) is still refused where it
    is opened: O_NOFOLLOW and the checks on the open fd, in each reader and writer."""
    state = private_dir(work / "state")
    pool = str(state / "kvdepot.pool")
    elsewhere = work / "elsewhere"
    for suffix in ("", ".lock", ".index", ".journal"):
        Path(pool + suffix).symlink_to(elsewhere)  # dangling: O_CREAT would create it
    with pytest.raises(private_files.UnsafeFileError, match="symbolic link"):
        Arena(1 << 20, pool)
    with pytest.raises(private_files.UnsafeFileError, match="symbolic link"):
        pool_file.lock_pool_file(pool)
    with pytest.raises(private_files.UnsafeFileError, match="symbolic link"):
        pool_file.prepare_start(pool, 1 << 20, 4096)
    with pytest.raises(private_files.UnsafeFileError, match="symbolic link"):
        journal_file.read(pool)
    assert not elsewhere.exists()
    for suffix in ("", ".lock", ".index", ".journal"):
        Path(pool + suffix).unlink()
        Path(pool + suffix).write_bytes(b"x")
        os.chmod(pool + suffix, 0o666)
    with pytest.raises(private_files.UnsafeFileError, match="mode 0666"):
        Arena(1 << 20, pool)
    with pytest.raises(private_files.UnsafeFileError, match="mode 0666"):
        pool_file.lock_pool_file(pool)
    with pytest.raises(private_files.UnsafeFileError, match="mode 0666"):
        journal_file.read(pool)
    # The daemon's own files, as it creates them, pass.
    for suffix in ("", ".lock", ".index", ".journal"):
        Path(pool + suffix).unlink()
    arena = Arena(1 << 20, pool)
    arena.close()
    os.close(pool_file.lock_pool_file(pool))
    assert mode_of(Path(pool)) == mode_of(Path(pool + ".lock")) == 0o600


# -- crafted journals --------------------------------------------------------------------------


def killed_with_rows(daemon_factory: DaemonFactory, work: Path) -> tuple[DaemonProcess, Path, list]:
    """A daemon that stored checksummed rows and was SIGKILLed: its journal is replayed
    at the next start."""
    pool = private_dir(work / "state") / "kvdepot.pool"
    d = daemon_factory("--pool-size", "32MiB", "--pool-file", str(pool))
    client = connect(d, "writer")
    keys, _ = store_rows(client)
    wait_sealed(pool, keys)
    client.close()
    d.kill()
    return d, pool, keys


def records(data: bytes) -> list[bytes]:
    """The journal's whole records (frames), in order."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "little")
        out.append(data[pos : pos + 8 + length])
        pos += 8 + length
    return out


def frame(payload: bytes) -> bytes:
    return journal._frame(payload)


def test_a_journal_header_without_its_fields_starts_empty_not_a_restart_loop(
    daemon_factory: DaemonFactory, work: Path
) -> None:
    d, pool, keys = killed_with_rows(daemon_factory, work)
    jpath = Path(str(pool) + journal.SUFFIX)
    # A valid length and CRC, a valid JSON object, no pool_size (was: KeyError at every start).
    jpath.write_bytes(frame(journal.HEADER + json.dumps({"format": 1}).encode()))
    d.start()  # raises if the daemon exits
    s = stats(admin(d.admin_channel()))
    assert s.ready_blocks == 0 and s.recovery_blocks_total == 0
    log = d.log()
    assert "lacks a valid pool_size and granularity" in log, log[-3000:]
    assert "starting with an empty pool" in log
    assert "Traceback" not in log
    store_and_load(d)  # and it serves


CRAFTS = ("truncated", "malformed-record", "bad-extents")


@pytest.mark.parametrize("craft", CRAFTS)
def test_a_crafted_journal_recovers_what_verifies_and_logs_the_rest(
    daemon_factory: DaemonFactory, work: Path, craft: str
) -> None:
    d, pool, keys = killed_with_rows(daemon_factory, work)
    jpath = Path(str(pool) + journal.SUFFIX)
    data = jpath.read_bytes()
    old = journal.replay(data)
    assert len(old.rows) == len(keys) and list(old.layouts) == [NS]
    recs = records(data)
    expect_log: list[str]
    if craft == "truncated":  # cut in the middle of the last record
        jpath.write_bytes(data[: len(data) - len(recs[-1]) // 2])
        expect_log = ["is damaged after", "torn"]
    elif craft == "malformed-record":  # a READY record two bytes long, CRC valid
        jpath.write_bytes(data + frame(journal.READY + b"\x00\x00"))
        expect_log = ["is damaged after", "malformed"]
    else:
        (ns, key0), row0 = next(iter(old.rows.items()))
        assert ns == NS
        crafted = [
            journal.ready(0, make_key(900, 0, b"x"), 0, 1 << 40, 0),  # a huge extent
            journal.ready(0, make_key(901, 0, b"x"), row0.offset, row0.size, 0),  # overlaps
            journal.ready(0, make_key(902, 0, b"x"), 1 << 30, row0.size, 0),  # outside
            journal.ready(0, make_key(903, 0, b"x"), 2**64 - 4096, row0.size, 0),  # wraps
        ]
        jpath.write_bytes(data + b"".join(crafted))
        expect_log = [
            "1 wrong size, 1 extent not free or misaligned, 2 outside the pool",
            "dropped (wrong size: 1099511627776 bytes",
        ]
    d.start()
    stub = admin(d.admin_channel())
    s = wait_recovered(stub)
    log = d.log()
    assert "Traceback" not in log
    for words in expect_log:
        assert words in log, (words, log[-3000:])
    client = connect(d, "reader")
    geo = soak.geometry(NS)
    engines = [Engine(client, geo, r) for r in range(geo.world_size)]  # joins the namespace
    served = served_rows_are_intact(client, keys)  # every served byte is the stored byte
    if craft == "bad-extents":
        assert s.recovery_blocks_rejected == 4, s
        assert served == len(keys) == s.recovery_blocks_verified
        verify_rows(client, keys)
        crafted_keys = [make_key(c, 0, b"x") for c in range(900, 904)]
        assert client.lookup(NS, crafted_keys) == [False] * 4
    else:
        assert served == s.recovery_blocks_verified > 0, s
        assert s.ready_blocks == s.recovery_blocks_verified
    del engines
    client.close()
