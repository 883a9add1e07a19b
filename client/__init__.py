"""kvdepot client library: sessions, registration, transfers, watch, pins.

Needs only grpcio and protobuf (torch only for `SharedKVBuffer.tensor()`), so it
imports in a plain vLLM environment. The vLLM connector is `kvdepot.client.vllm`.
"""

from kvdepot.client.depot_client import DepotClient, DepotUnavailable, session_stub
from kvdepot.client.shm import SharedKVBuffer
from kvdepot.client.transfer_stream import TransferStream
from kvdepot.client.watch import Watch

__all__ = [
    "DepotClient",
    "DepotUnavailable",
    "SharedKVBuffer",
    "TransferStream",
    "Watch",
    "session_stub",
]
