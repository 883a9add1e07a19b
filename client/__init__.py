"""kvdepot client library: sessions, registration, transfers, watch, pins.

Needs only grpcio and protobuf (torch only for `SharedKVBuffer.tensor()`), so it
imports in a plain vLLM environment. The vLLM connector is `kvdepot.client.vllm`.
"""

from kvdepot.client.depot_client import DepotClient, DepotUnavailable, TransferStream, Watch
from kvdepot.client.shm import SharedKVBuffer

__all__ = ["DepotClient", "DepotUnavailable", "SharedKVBuffer", "TransferStream", "Watch"]
