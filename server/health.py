"""grpc.health.v1.Health for the daemon: grpcio's servicer, with Watch streams that end
at shutdown.

grpcio's aio HealthServicer sends NOT_SERVING to watchers on graceful shutdown but
keeps their streams open; the server's stop then waits its whole grace period for
them, so a single `grpcurl ... Health/Watch` (or a load balancer's watch) slowed
every shutdown by that much. Here a Watch stream delivers NOT_SERVING and then
ends with OK, and the daemon stops as soon as its real work is done.
"""

from __future__ import annotations

import asyncio

from grpc import aio
from grpc_health.v1 import health, health_pb2

# health_pb2's ServingStatus, an int enum (grpc_health has no stubs: an int to mypy).
_Status = int
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health.aio.HealthServicer):
    """Check as grpcio implements it; Watch reimplemented on a status mirror so it can
    end after the final NOT_SERVING (grpcio keeps its state private)."""

    def __init__(self) -> None:
        super().__init__()
        self._status: dict[str, _Status] = {"": SERVING}
        self._changed = asyncio.Condition()
        self._closing = False

    async def set(self, service: str, status: _Status) -> None:
        """Sets a service's status (ignored once shutdown began, like grpcio's)."""
        await super().set(service, status)
        if self._closing:
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; open Watch streams send it, then end."""
        await super().enter_graceful_shutdown()
        async with self._changed:
            self._closing = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._changed.notify_all()

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: aio.ServicerContext
    ) -> None:
        """Streams the service's status whenever it changes; ends after shutdown's."""
        last: _Status | None = None
        while True:
            # The lock is not held while writing: a slow reader must not block set() or
            # shutdown (grpcio's Watch writes under it).
            async with self._changed:
                await self._changed.wait_for(
                    # mypy infers no lambda with a bound default
                    lambda last=last: (
                        self._closing  # type: ignore[misc]
                        or self._current(request.service) != last
                    )
                )
                status, closing = self._current(request.service), self._closing
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if closing:
                return

    def _current(self, service: str) -> _Status:
        return self._status.get(service, SERVICE_UNKNOWN)
