"""The one back-off policy (kvdepot.common.backoff) gives each of its users the
delays it had before: DepotClient's session reconnect 0.05 s doubling to 2 s with
[0.5, 1.5) jitter, the remote tier's probe 0.5 s doubling to 10 s, the lanes' reopen
a fixed 5 s; a success starts again at the first delay."""

from __future__ import annotations

import pytest

from kvdepot.common.backoff import Backoff
from kvdepot.server.remote.health import remote_health


def test_doubling_to_the_cap_and_reset_on_success() -> None:
    b = Backoff(0.5, 10.0)
    assert [b.next_delay() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    b.reset()
    assert b.next_delay() == 0.5


def test_a_fixed_wait() -> None:
    b = Backoff(5.0, 5.0)
    assert {b.next_delay() for _ in range(5)} == {5.0}


def test_jitter_stays_within_half_and_one_and_a_half_of_the_schedule() -> None:
    b = Backoff(0.05, 2.0, jitter=True)
    schedule = [0.05 * 2**i for i in range(6)] + [2.0] * 4
    for planned in schedule:
        assert 0.5 * planned <= b.next_delay() < 1.5 * planned


@pytest.mark.parametrize("args", [(-1.0, 1.0), (2.0, 1.0), (1.0, 2.0, 0.5)])
def test_nonsense_is_refused(args) -> None:
    with pytest.raises(ValueError, match="back-off"):
        Backoff(*args)


def test_a_tier_below_the_pool_probes_after_the_same_delays(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr("kvdepot.server.tier_health.time.monotonic", lambda: now[0])
    health = remote_health("redis://test")
    waits = []
    for _ in range(7):
        health.failed("refused")
        assert not health.usable()
        waits.append(health._retry_at - now[0])
        now[0] = health._retry_at
        assert health.usable()  # the probe is due
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    health.succeeded()
    health.failed("refused again")  # a new outage starts at the first delay
    assert health._retry_at - now[0] == 0.5 and health.outages == 2
