"""The dashboard's HTTP server: a Connect gateway to the server's gRPC services, and the dashboard's files.

See :mod:`.connect` for the protocol and :mod:`.app` for the server that ``lightning-grpc serve`` starts.
"""

from .app import DEFAULT_PORT, DashboardConfig, RunningDashboard, build_app, companion, start_dashboard
from .connect import SERVICES, ConnectError, ConnectGateway, procedures

__all__ = [
    "DEFAULT_PORT",
    "SERVICES",
    "ConnectError",
    "ConnectGateway",
    "DashboardConfig",
    "RunningDashboard",
    "build_app",
    "companion",
    "procedures",
    "start_dashboard",
]
