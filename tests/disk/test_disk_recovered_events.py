"""Records the disk tier brings back at start are announced on Watch (STORED of tier
DISK): a restarted daemon's disk is known to routers and to the connector's
`take_events()`, whether the Watch stream began before the index rebuild handed
them over (its batches are announced) or after (a new stream is told what is on
disk). A record whose header no longer verifies is dropped and never announced."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.server.disk.files import FILE_NAME
from kvdepot.server.disk.record import NAMESPACE_AT
from kvdepot.server.disk.tier import DiskTier
from kvdepot.testing.waiting import wait_for
from kvdepot.v1 import depot_pb2 as pb
from tests.disk.helpers import NS, key, opened, write
from tests.disk.test_disk_daemon import GEO, serve, store
from tests.disk.test_disk_events import DISK, Events
from tests.disk.test_disk_recovery import patch, records_on_disk
from tests.support.daemon import connect, stats
from tests.support.engine import Engine

pytest.importorskip("blake3")

ROWS = 120


def disk_keys_announced(d, events: Events) -> list[bytes]:
    """Starts a Watch on a fresh connection; the keys it hears are on disk, once the
    index is back and the stream has caught up."""
    c = connect(d, "router")
    Engine(c, GEO, 0)  # joins the namespace, as a router's session does
    watch = c.watch(GEO.namespace, events)
    s = wait_for(lambda: (s := stats(c)).disk_recovery_complete and s, what="index back")
    wait_for(
        lambda: len(set(events.keys(pb.WatchEvent.STORED, DISK))) == s.disk_records,
        what="every record on disk announced",
    )
    watch.stop()
    c.close()
    return events.keys(pb.WatchEvent.STORED, DISK)


def test_a_restarted_daemon_announces_the_records_its_disk_holds(
    daemon_factory, tmp_path: Path
) -> None:
    d = serve(daemon_factory, tmp_path / "disk")
    c = connect(d, "engine")
    keys = store(Engine(c, GEO, 0), range(ROWS))
    wait_for(lambda: stats(c).disk_writes == ROWS, what="rows on disk")
    c.close()

    assert d.stop() == 0  # a clean stop: the index comes back from its checkpoint
    d.start()
    events = Events()
    assert sorted(set(disk_keys_announced(d, events))) == sorted(keys)
    assert not events.of(pb.WatchEvent.REMOVED, DISK)

    # After a SIGKILL the scan brings the records back; one whose header was damaged
    # meanwhile does not verify: dropped, and never announced.
    d.kill()
    path = tmp_path / "disk" / FILE_NAME
    where = records_on_disk(path)
    damaged = keys[7]
    patch(path, where[(GEO.namespace, damaged)] + NAMESPACE_AT + 1, b"\x00")  # its namespace id
    d.start()
    c = connect(d, "engine")
    s = wait_for(lambda: (s := stats(c)).disk_recovery_complete and s, what="index back")
    assert (s.disk_recovery_source, s.disk_records) == ("scan", ROWS - 1)
    c.close()
    announced = disk_keys_announced(d, Events())
    assert sorted(set(announced)) == sorted(k for k in keys if k != damaged)


def test_the_index_rebuild_hands_its_records_to_the_watcher(tmp_path: Path) -> None:
    with opened(tmp_path, 16 << 20) as tier:
        for i in range(40):
            write(tier, key(i), 3 * 4096)
    for source in ("checkpoint", "scan"):
        if source == "scan":
            (tmp_path / "kvdepot-disk.index").unlink(missing_ok=True)
        heard: list[list[tuple[str, bytes, object]]] = []
        tier = DiskTier(tmp_path, 16 << 20)
        tier.watch(heard.append)  # before open, as the daemon's DiskLink does
        tier.open()
        try:
            assert tier.wait_recovered(10)
            assert tier.snapshot()["recovery_source"] == source
            changes = [change for batch in heard for change in batch]
            assert sorted(changes) == sorted((NS, key(i), None) for i in range(40))
            assert sorted(tier.keys_of(NS, 100)) == sorted(key(i) for i in range(40))
            assert len(tier.keys_of(NS, 5)) == 5 and tier.keys_of("other", 5) == []
        finally:
            tier.close()
