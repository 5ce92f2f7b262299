"""Python clients of the lightning-grpc services, and the one channel factory they share.

:class:`ProxyClient` is loaded on first use: it returns the proxy's own objects, and the proxy
package imports this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .channel import call_metadata, make_channel
from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .store import AddSpansResult, AttemptHeartbeat, StoreClient, WatchEvent
from .sync import SyncStoreClient, SyncTrainerClient
from .trainer import RolloutTripletReport, SubmittedGroup, TrainerClient, TrainingBatch

if TYPE_CHECKING:
    from .proxy import ProxyClient


def __getattr__(name: str) -> Any:
    if name == "ProxyClient":
        from .proxy import ProxyClient

        return ProxyClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AddSpansResult",
    "AttemptHeartbeat",
    "ClientConfig",
    "ProxyClient",
    "RetryConfig",
    "RolloutTripletReport",
    "StoreClient",
    "SubmittedGroup",
    "SyncStoreClient",
    "SyncTrainerClient",
    "TlsConfig",
    "TrainerClient",
    "TrainingBatch",
    "WatchEvent",
    "call_metadata",
    "from_rpc_error",
    "make_channel",
]
