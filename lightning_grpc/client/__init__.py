"""Python clients of the lightning-grpc services."""

from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .store import AddSpansResult, AttemptHeartbeat, StoreClient, WatchEvent
from .sync import SyncStoreClient

__all__ = [
    "AddSpansResult",
    "AttemptHeartbeat",
    "ClientConfig",
    "RetryConfig",
    "StoreClient",
    "SyncStoreClient",
    "TlsConfig",
    "WatchEvent",
    "from_rpc_error",
]
