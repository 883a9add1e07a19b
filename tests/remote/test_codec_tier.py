"""The value framing and the RedisTier contract against real Redis servers."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvdepot.server.core.index_types import MAX_CHUNK_EVENT_BYTES
from kvdepot.server.remote import codec
from kvdepot.server.remote.fleet_key import INSECURE_ID, Keyring
from kvdepot.server.remote.redis_tier import RedisTier
from kvdepot.server.remote.tier import TierUnavailable
from tests.support.redis_servers import RedisServer, free_ports

NS = "ns-a"
KEY = os.urandom(32) + b"\0\0\0\1"


KEYED = codec.Codec(Keyring.from_secrets(b"k" * 64))
CRC_ONLY = codec.Codec(None)


@pytest.mark.parametrize("c", [KEYED, CRC_ONLY], ids=["keyed", "crc-only"])
def test_codec_round_trip_and_every_kind_of_bad_value(c: codec.Codec) -> None:
    payload = os.urandom(100_000)
    value = c.encode(NS, KEY, payload)
    assert len(value) == c.frame_bytes(NS, KEY, len(payload))
    assert bytes(c.decode(value, NS, KEY, len(payload))) == payload
    flipped = bytearray(value)
    flipped[-5] ^= 1
    cases = {
        "truncated": value[:-1],
        "bad_magic": b"XXXX" + value[4:],
        "wrong_namespace": value,  # read as another namespace's
        "wrong_key": value,
        "wrong_length": value,
        "bad_mac" if c is KEYED else "bad_checksum": bytes(flipped),
    }
    for reason, bad in cases.items():
        ns = "ns-b" if reason == "wrong_namespace" else NS
        key = KEY[:-1] + b"\2" if reason == "wrong_key" else KEY
        size = len(payload) - 1 if reason == "wrong_length" else len(payload)
        with pytest.raises(codec.VerifyError) as info:
            c.decode(bad, ns, key, size)
        assert info.value.reason == reason
    with pytest.raises(codec.VerifyError):
        c.decode(b"short", NS, KEY, 1)


def test_keyed_rows_verify_only_under_the_fleet_key_and_old_rows_never() -> None:
    """Another key's MAC, a CRC-only (format 1) frame and a format-2 frame with a
    forged MAC are refused; the previous key is still accepted (rotation)."""
    payload = os.urandom(10_000)
    new, old = b"n" * 40, b"o" * 40
    rotated = codec.Codec(Keyring.from_secrets(new, old))
    by_old = codec.Codec(Keyring.from_secrets(old)).encode(NS, KEY, payload)
    assert bytes(rotated.decode(by_old, NS, KEY, len(payload))) == payload
    with pytest.raises(codec.VerifyError) as info:  # a node that has only the new key
        codec.Codec(Keyring.from_secrets(new)).decode(by_old, NS, KEY, len(payload))
    assert info.value.reason == "unknown_key"
    with pytest.raises(codec.VerifyError) as info:
        rotated.decode(CRC_ONLY.encode(NS, KEY, payload), NS, KEY, len(payload))
    assert info.value.reason == "old_format"
    # Right format, right key id, MAC made up: what a writer without the key can do.
    forged = bytearray(rotated.encode(NS, KEY, payload))
    forged[28:60] = os.urandom(32)
    with pytest.raises(codec.VerifyError) as info:
        rotated.decode(bytes(forged), NS, KEY, len(payload))
    assert info.value.reason == "bad_mac"
    assert KEYED.remote_key(NS, KEY).startswith(b"kvd2:")
    assert CRC_ONLY.remote_key(NS, KEY).startswith(b"kvd1:")


@pytest.mark.parametrize("c", [KEYED, CRC_ONLY], ids=["keyed", "crc-only"])
def test_a_row_carries_its_chunk_event_authenticated_and_bounded(c: codec.Codec) -> None:
    """The chunk event travels in the value between the key and the payload, covered
    by the MAC (or CRC); a row without one is framed as older kvdepot framed it; an
    event past the bound is never written nor read."""
    payload, event = os.urandom(5000), os.urandom(700)
    value = c.encode(NS, KEY, payload, event)
    assert len(value) == c.frame_bytes(NS, KEY, len(payload), len(event))
    row = c.admit(value, NS, KEY, len(payload))
    assert bytes(row.payload) == payload and row.chunk_event == event
    # Without an event: the reserved field stays 0, the frame and MAC older nodes made.
    plain = c.encode(NS, KEY, payload)
    assert len(plain) == c.frame_bytes(NS, KEY, len(payload))
    assert plain[10:12] == b"\0\0" and c.admit(plain, NS, KEY, len(payload)).chunk_event == b""
    # One bit of the event flipped: refused like a flipped payload bit.
    at = c.header_bytes + len(NS) + len(KEY)
    flipped = bytearray(value)
    flipped[at + 3] ^= 1
    with pytest.raises(codec.VerifyError) as info:
        c.admit(bytes(flipped), NS, KEY, len(payload))
    assert info.value.reason == ("bad_mac" if c is KEYED else "bad_checksum")
    # The event moved into the payload (the length field lowered): refused.
    shifted = bytearray(value)
    shifted[10:12] = (len(event) - 1).to_bytes(2, "big")
    with pytest.raises(codec.VerifyError):
        c.admit(bytes(shifted), NS, KEY, len(payload) + 1)
    # Past the bound: the writer leaves it out; a value that claims one is refused.
    too_long = os.urandom(MAX_CHUNK_EVENT_BYTES + 1)
    assert c.encode(NS, KEY, payload, too_long) == plain
    huge = bytearray(plain)
    huge[10:12] = (MAX_CHUNK_EVENT_BYTES + 1).to_bytes(2, "big")
    with pytest.raises(codec.VerifyError) as info:
        c.admit(bytes(huge), NS, KEY, len(payload))
    assert info.value.reason == "event_too_large"


def test_a_row_remembers_which_key_admitted_it() -> None:
    """`admit` answers the id of the key that verified the row: what the pool and the
    disk keep so that dropping that key drops the row (docs/security.md)."""
    payload = os.urandom(1000)
    new, old = b"n" * 40, b"o" * 40
    rotated = codec.Codec(Keyring.from_secrets(new, old))
    ring = rotated.keyring
    assert ring is not None and rotated.held_ids == {ring.current.id, ring.previous.id}
    by_old = codec.Codec(Keyring.from_secrets(old)).encode(NS, KEY, payload)
    got, admitted_by, _ = rotated.admit(by_old, NS, KEY, len(payload))
    assert bytes(got) == payload and admitted_by == ring.previous.id  # type: ignore[union-attr]
    _, admitted_by, _ = rotated.admit(rotated.encode(NS, KEY, payload), NS, KEY, len(payload))
    assert admitted_by == ring.current.id
    _, admitted_by, _ = CRC_ONLY.admit(CRC_ONLY.encode(NS, KEY, payload), NS, KEY, len(payload))
    assert admitted_by == INSECURE_ID and CRC_ONLY.held_ids == {INSECURE_ID}
    assert INSECURE_ID not in rotated.held_ids  # a keyed node keeps no CRC-only row


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("which", ["standalone", "cluster"])
def test_put_is_once_per_key_get_and_exists_answer_in_order(which, request) -> None:
    server = request.getfixturevalue(f"redis_{which}")
    url = server.url

    async def go() -> None:
        tier = RedisTier(url)
        d = time.monotonic() + 5
        keys = [KEYED.remote_key(NS, os.urandom(36)) for _ in range(20)]
        assert await tier.put_many([(k, b"v" + k) for k in keys[:10]], 60, d) == [True] * 10
        # Set-if-absent: the first writer wins, later writers are told.
        again = await tier.put_many([(k, b"other") for k in keys], 60, d)
        assert again == [False] * 10 + [True] * 10
        got = await tier.get_many([*keys, b"kvd1:absent"], d)
        assert got[:10] == [b"v" + k for k in keys[:10]] and got[10:20] == [b"other"] * 10
        assert got[20] is None
        assert await tier.exists_many([keys[0], b"kvd1:absent"], d) == [True, False]
        # Sizes before downloading; a bounded read never sends more than its limit.
        sizes = await tier.sizes_many([keys[0], keys[15], b"kvd1:absent"], d)
        assert sizes == [1 + len(keys[0]), len(b"other"), 0]
        capped = await tier.get_many([keys[0], keys[15], b"kvd1:absent"], d, [4, 100, 10])
        assert capped == [(b"v" + keys[0])[:4], b"other", None]
        if which == "cluster":
            assert tier.cluster
        await tier.close()

    run(go())


def test_ttl_is_set(redis_standalone) -> None:
    from tests.support.redis_servers import cli

    async def go() -> bytes:
        tier = RedisTier(redis_standalone.url)
        k = KEYED.remote_key(NS, os.urandom(18).hex().encode())  # printable, for redis-cli
        await tier.put_many([(k, b"x")], 100, time.monotonic() + 5)
        await tier.close()
        return k

    k = run(go())
    ttl = int(cli(redis_standalone.port, "TTL", k.decode()))
    assert 90 <= ttl <= 100


def test_a_server_that_is_down_or_stalled_costs_at_most_the_deadline(tmp_path) -> None:
    """Nothing listening, then a server frozen with SIGSTOP: calls raise
    TierUnavailable by their deadline; once it answers again, calls succeed."""
    port = free_ports(1)[0]

    async def timed(tier: RedisTier, budget: float) -> float:
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable):
            await tier.get_many([b"kvd1:k"], time.monotonic() + budget)
        return time.monotonic() - t0

    async def go() -> None:
        tier = RedisTier(f"redis://127.0.0.1:{port}")
        assert await timed(tier, 0.5) < 1.0  # refused
        s = RedisServer(tmp_path / "r", port).start()
        try:
            assert await tier.get_many([b"kvd1:k"], time.monotonic() + 2) == [None]
            s.proc.send_signal(19)  # SIGSTOP: accepts nothing, answers nothing
            assert await timed(tier, 0.3) < 0.8
            s.proc.send_signal(18)  # SIGCONT
            assert await tier.get_many([b"kvd1:k"], time.monotonic() + 2) == [None]
        finally:
            s.kill()
        await tier.close()

    run(go())
