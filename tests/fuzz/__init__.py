"""Hypothesis against a live daemon (docs/architecture.md §8.2: bad input never kills
the daemon, never corrupts another client's data, never leaks a slot).

Every RPC and stream gets random and malformed input: out-of-range sizes, negative
and huge ids, wrong page sizes, duplicate, empty and foreign-group keys, unknown
namespaces, mismatched world sizes, jobs that do not add up, wrong and closed fds
and protocol abuse on the fd socket, undecodable bytes, streams and sessions cut
half-way. After every example:
- each call ended with a documented status (tests.support.faults.DOCUMENTED_CODES),
  and each TransferResult with a documented error_code: never UNKNOWN or INTERNAL;
- the daemon is alive and its invariants hold: it runs with
  KVDEPOT_CHECK_INVARIANTS=1, which checks allocator against index, slots in one
  place only, pins and reservations held only by live sessions, after every
  mutation; Admin/GetStats answers INTERNAL once one broke.
At the end of each test every session is closed and the daemon must hold nothing:
no pins, no reservations, no registrations, no extra fds, used bytes equal to the
ready blocks, and a guardian client's pinned blocks load byte-identical.

Marked `slow`. Short by default (fixed examples: `derandomize`); the long run (20x the
examples, random each run), see tests/README.md:
    KVDEPOT_LONG=1 .venv/bin/python -m pytest -m slow tests/fuzz -s

The rig is tests/support/fuzz_rig.py (its fixture in tests/fuzz/conftest.py), the shared
strategies tests/support/fuzz_strategies.py.
"""
