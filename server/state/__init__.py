"""The daemon's state, between the sans-I/O core and the gRPC services.

depot.py          DepotState: assembles the parts; the API the services call
startup.py        how it starts: empty pool, warm restart, crash recovery
sessions.py       sessions, registrations, memory paths, fd claiming and sealing
registration.py   a registration: one rank's (or units') mapped KV memory
tickets.py        session tickets: a session its process owns from the open
calls_in_flight.py  Depot calls in flight per account and per uid
accounts.py       session ids by account (whom their shares charge)
registry.py       facet: sessions and registrations as the services see them
namespaces.py     who may name which namespace; the per-session quotas
key_calls.py      facet: Lookup, Pin, Unpin and Watch on a joined namespace's keys
jobs.py           the job runner: check once, reserve, plan once, copy, settle
inline.py         inline Put/Get
tiers.py          facet: the tiers below the pool, in order, and Prefetch
events.py         the event bus and the Watch streams' queues
traffic.py        job and block counters, transfer observers
admin_queries.py  facet: the operators' read-only queries
listing.py        the admin queries: namespaces, blocks a page at a time
admin_evict.py    Admin/Evict and Admin/Clear: the checks, bulk eviction in slices
stats.py          Admin/GetStats' figures
invariants.py     what must hold between two steps of the event loop
settings.py       the settings it reads: a protocol (ServeConfig has them), not the table
"""

from kvdepot.server.state.depot import DepotState
from kvdepot.server.state.events import Watcher
from kvdepot.server.state.registration import Registration
from kvdepot.server.state.sessions import Session

__all__ = [
    "DepotState",
    "Registration",
    "Session",
    "Watcher",
]
