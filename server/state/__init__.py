"""The daemon's state, between the sans-I/O core and the gRPC services.

depot.py       DepotState: assembles the parts; the API the services call
startup.py     how it starts: empty pool, warm restart, crash recovery
sessions.py    sessions, registrations, memory paths, fd claiming and sealing
jobs.py        the job runner: check once, reserve, plan once, copy, settle
inline.py      inline Put/Get
events.py      the event bus and the Watch streams' queues
traffic.py     job and block counters, transfer observers
listing.py     the admin queries: namespaces, blocks a page at a time
stats.py       Admin/GetStats' figures
invariants.py  what must hold between two steps of the event loop
settings.py    the settings it reads: a protocol (ServeConfig has them), not the table
"""

from kvdepot.server.state.depot import DepotState
from kvdepot.server.state.events import Watcher
from kvdepot.server.state.sessions import Registration, Session

__all__ = [
    "DepotState",
    "Registration",
    "Session",
    "Watcher",
]
