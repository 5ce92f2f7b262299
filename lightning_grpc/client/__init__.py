"""Python clients of the lightning-grpc services, and the one channel factory they share."""

from __future__ import annotations

from .channel import call_metadata, make_channel
from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .proxy import ProxyClient
from .store import AddSpansResult, AttemptHeartbeat, StoreClient, WatchEvent
from .sync import SyncStoreClient, SyncTrainerClient
from .trainer import RolloutTripletReport, SubmittedGroup, TrainerClient, TrainingBatch

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
