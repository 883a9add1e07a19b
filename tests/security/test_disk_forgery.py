"""The disk tier trusts only what it wrote (docs/security.md).

Against a real `kvdepot serve --disk`, the forger (tests/security/disk_forger.py, a
process of its own, in a namespace of its own) Puts a row whose bytes hold a disk
record header for the victim's namespace and a key the victim has not stored, with
a digest anyone can compute, exactly as the record format of before accepted it. The
disk is sized so that the next rows evict the forger's record and a smaller victim
row reuses its extent's head: the forged header is then in free space, right where
the recovery scan, after the victim's record, looks for the next one. The daemon is
killed (SIGKILL) and started again on the same disk file; the scan walks the freed
space.

The attack fails: the victim's namespace does not have the key (Prefetch answers
ABSENT, nothing is loaded), and the log says, in words, that a header of the old
format and one that did not authenticate (the same forgery in the current format,
under a key the forger guessed) were not adopted. Beside it the legitimate path
works: the victim's two rows and the forger's own row come back from disk byte for
byte. On the code before records were keyed (commit 0192de0), the victim's Prefetch
answered FETCHING for the key and its Get returned the forger's 0xEE bytes.
"""

from __future__ import annotations

import hashlib
import json
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvdepot.client import DepotClient
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.security import disk_forger
from tests.support.daemon import DaemonProcess, connect, kvdepot_command, stats

pytest.importorskip("blake3")
pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).parent
PAGE = 4096
VICTIM = "victim-ns"
FORGER = "forger-ns"
VICTIM_LAYERS = [4096, 4096]
VICTIM_ROW = 2 * sum(VICTIM_LAYERS)  # 16 KiB: a 20 KiB record
FORGER_RECORD = PAGE + disk_forger.ROW  # 68 KiB
VICTIM_RECORD = PAGE + VICTIM_ROW
# The forger's two records, then the victim's first: the file is full but for one
# page, so the victim's second row evicts the least recently used record (the
# carrier, at offset 0) and, best fit, takes the head of its extent.
CAPACITY = 2 * FORGER_RECORD + VICTIM_RECORD + PAGE
DISK_SIZE = CAPACITY + PAGE  # the tier keeps the last page for its probe
# The forged header lands right after the victim's record at offset 0.
FORGED_AT = VICTIM_RECORD - PAGE  # payload offset in the carrier
WAIT = 30.0  # seconds: generous, for a loaded machine


def victim_key(name: bytes) -> bytes:
    return hashlib.sha256(b"victim " + name).digest() + (0).to_bytes(4, "big")


def victim_row(k: bytes) -> bytes:
    seed = hashlib.sha256(b"victim's row" + k).digest()
    return (seed * (VICTIM_ROW // len(seed) + 1))[:VICTIM_ROW]


def joined(d: DaemonProcess, namespace: str, layers: list[int], blocks: int) -> DepotClient:
    c = connect(d, namespace)
    layout = pb.NamespaceLayout(
        id=namespace,
        world_size=1,
        blocks_per_chunk=blocks,
        groups=[pb.GroupLayout(layer_page_bytes=layers)],
    )
    c.register_kv(layout, 0, None, [], [])
    return c


def written(c: DepotClient, n: int) -> None:
    wait_for(
        lambda: (s := stats(c)).disk_writes >= n and s.disk_inflight_bytes == 0,
        WAIT,
        what=f"{n} records on disk",
    )


def forge(d: DaemonProcess, target: bytes) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(HERE / "disk_forger.py"),
            "--target",
            d.target,
            "--namespace",
            FORGER,
            "--victim",
            VICTIM,
            "--victim-key",
            target.hex(),
            "--victim-length",
            str(VICTIM_ROW),
            "--at",
            str(FORGED_AT),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def promoted(c: DepotClient, namespace: str, keys: list[bytes]) -> list[int]:
    states = list(c.prefetch(namespace, keys, timeout=5.0).states)
    came = [k for k, st in zip(keys, states, strict=True) if st == pb.PrefetchResponse.FETCHING]
    wait_for(lambda: all(c.lookup(namespace, came)), WAIT, what="rows promoted from disk")
    return states


def test_a_forged_record_in_a_tenants_row_is_never_adopted(daemon_factory, tmp_path) -> None:
    d = daemon_factory(
        "--pool-size", "16MiB", "--disk", str(tmp_path / "disk"),
        "--disk-size", str(DISK_SIZE), "--disk-write-priority", "normal",
    )  # fmt: skip
    target, v1, v2 = victim_key(b"target"), victim_key(b"one"), victim_key(b"two")
    victim = joined(d, VICTIM, VICTIM_LAYERS, 2)
    got = forge(d, target)
    assert got["put_carrier"] == got["put_own"] == "stored", got
    written(victim, 2)  # the carrier at offset 0, the forger's own row after it
    # The carrier must be the disk's oldest record, the one evicted below: its write and
    # the own row's run together and may end in either order, so the own row is touched.
    owner = joined(d, FORGER, disk_forger.LAYERS, disk_forger.BLOCKS_PER_CHUNK)
    owner.unpin(FORGER, [], wait=True, touch=[bytes.fromhex(got["own"])])
    owner.close()
    assert victim.put(VICTIM, v1, 0, victim_row(v1)).outcome == "stored"
    written(victim, 3)
    assert victim.put(VICTIM, v2, 0, victim_row(v2)).outcome == "stored"
    written(victim, 4)
    s = stats(victim)
    assert (s.disk_evicted, s.disk_records) == (1, 3), s  # the carrier went
    victim.close()

    d.kill()  # an unclean stop: no checkpoint, the scan walks the freed space
    d.start(timeout=60)
    victim = joined(d, VICTIM, VICTIM_LAYERS, 2)
    s = wait_for(lambda: (s := stats(victim)).disk_recovery_complete and s, WAIT, "index back")
    assert s.disk_recovery_source == "scan"

    # The attack fails: the victim's namespace has no such key, on disk or in RAM.
    # (Two calls: a Prefetch fetches a leading run, nothing after a key no tier has.)
    states = promoted(victim, VICTIM, [target]) + promoted(victim, VICTIM, [v1, v2])
    assert states[0] == pb.PrefetchResponse.ABSENT, (states, d.log()[-3000:])
    assert victim.lookup(VICTIM, [target]) == [False]
    with pytest.raises(grpc.RpcError):
        victim.get(VICTIM, target, 0)
    log = d.log()
    assert "1 record headers of an older format (before version 2) were not adopted" in log
    if got["current_format_forgery"]:  # and the same forgery under a guessed key
        assert "1 pages that look like record headers did not authenticate" in log
    key_file = tmp_path / "disk" / "kvdepot-disk.key"  # the key: the daemon's alone
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # Beside it, every legitimate record comes back byte for byte.
    assert states[1:] == [pb.PrefetchResponse.FETCHING] * 2
    for k in (v1, v2):
        assert victim.get(VICTIM, k, 0) == victim_row(k)
    forger = joined(d, FORGER, disk_forger.LAYERS, disk_forger.BLOCKS_PER_CHUNK)
    own = bytes.fromhex(got["own"])
    assert promoted(forger, FORGER, [own]) == [pb.PrefetchResponse.FETCHING]
    assert forger.get(FORGER, own, 0) == disk_forger.plain_row(own)
    s = stats(victim)
    assert (s.disk_records, s.disk_rejected) == (3, 0), s
    forger.close()
    victim.close()


def test_a_disk_key_others_could_read_stops_the_start(daemon_factory, tmp_path) -> None:
    """The key is the daemon's alone: a key file of mode 0644 (or a symlink, or
    another uid's: private_files' checks) ends the start with one line, exit 2, and
    never the key's bytes; made 0600 again, the same directory serves."""
    disk = tmp_path / "disk"
    d = daemon_factory("--pool-size", "16MiB", "--disk", str(disk), "--disk-size", "1MiB")
    assert d.stop() == 0
    key_file = disk / "kvdepot-disk.key"
    secret = key_file.read_bytes()
    key_file.chmod(0o644)
    out = subprocess.run(
        [*kvdepot_command(), "serve", "--socket", str(tmp_path / "k.sock"),
         "--pool-size", "16MiB", "--disk", str(disk), "--disk-size", "1MiB"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.decode(errors="replace")
    lines = [ln for ln in err.splitlines() if "ERROR" in ln or "Traceback" in ln]
    assert len(lines) == 1 and "record key" in lines[0] and "0644" in lines[0], err[-3000:]
    assert secret not in out.stderr and secret.hex() not in err
    key_file.chmod(0o600)
    d.start()
    assert stats(d).disk_healthy
