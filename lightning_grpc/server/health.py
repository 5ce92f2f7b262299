"""gRPC health checking with all three RPCs of ``grpc.health.v1.Health``: Check, Watch and List.

grpcio-health-checking's aio servicer (1.85.1, its latest release) implements Check and Watch only; its
List is the generated placeholder, which raises NotImplementedError: answered UNIMPLEMENTED, with a
traceback in the server log on every call. Like Check, List is open to anyone (``access.OPEN_PREFIXES``):
it names the services and their statuses, nothing more.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer as _LibraryHealthServicer

__all__ = ["HealthServicer"]

#: The List messages (types-grpcio-health-checking's stubs do not declare them yet).
_LIST_RESPONSE: Any = health_pb2.HealthListResponse  # type: ignore[attr-defined]


class HealthServicer(_LibraryHealthServicer):
    """The library's aio health servicer, plus List."""

    async def List(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Every service whose status was set (the server as a whole is ``""``), with its status now.

        A snapshot of the library's own status table, which only the server writes (a Check or Watch of
        an unknown name adds nothing to it), so it stays a few entries long: the proto's
        RESOURCE_EXHAUSTED for too many services never applies.
        """
        table: dict[str, int] = self._server_status  # type: ignore[attr-defined]
        return _LIST_RESPONSE(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in table.items()}
        )
