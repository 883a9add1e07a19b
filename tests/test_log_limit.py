"""The log limiter (kvdepot.server.core.log_limit), directly: sans-I/O, the time given."""

from __future__ import annotations

import pytest

from kvdepot.server.core.log_limit import LogLimiter, held_note


def test_a_key_logs_its_burst_then_its_rate_and_says_what_it_held() -> None:
    lim = LogLimiter(burst=3, rate=1.0)
    assert [lim.admit("a", 0.0) for _ in range(5)] == [0, 0, 0, None, None]
    assert lim.admit("a", 0.5) is None  # half a token
    assert lim.admit("a", 1.0) == 3  # one token back: logs, and tells of the three held
    assert lim.admit("a", 1.0) is None
    assert lim.admit("a", 100.0) == 1  # refilled to the burst, no more
    assert [lim.admit("a", 100.0) for _ in range(3)] == [0, 0, None]
    assert lim.held_total == 5


def test_keys_are_limited_apart_and_together() -> None:
    lim = LogLimiter(burst=2, rate=1.0, total_burst=5, total_rate=1.0)
    assert [lim.admit("a", 0.0) for _ in range(3)] == [0, 0, None]
    assert [lim.admit("b", 0.0) for _ in range(2)] == [0, 0]  # b's own burst
    # All keys together: five lines, then one a second whoever asks.
    assert lim.admit("c", 0.0) == 0
    assert lim.admit("d", 0.0) is None  # d's burst is full, the total's is spent
    assert lim.admit("d", 1.0) == 1


def test_forgotten_keys_tell_what_they_held_on_the_next_line() -> None:
    lim = LogLimiter(burst=1, rate=0.001, max_keys=2)
    assert [lim.admit("a", 0.0), lim.admit("a", 0.0), lim.admit("a", 0.0)] == [0, None, None]
    assert lim.admit("b", 0.0) == 0
    assert lim.admit("c", 0.0) == 2  # a, least recently used, forgotten: its 2 told here
    assert lim.admit("a", 0.0) == 0  # a is new again


def test_time_going_back_adds_nothing() -> None:
    lim = LogLimiter(burst=1, rate=1.0)
    assert lim.admit("a", 10.0) == 0
    assert lim.admit("a", 5.0) is None


def test_limits_must_be_positive_and_notes_read_as_words() -> None:
    with pytest.raises(ValueError):
        LogLimiter(burst=0)
    assert held_note(0) == ""
    assert held_note(7) == " (7 more like it not logged: rate-limited)"
