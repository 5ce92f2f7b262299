"""Python clients of the lightning-grpc services."""

from .config import ClientConfig, RetryConfig, TlsConfig
from .errors import from_rpc_error
from .store import AddSpansResult, AttemptHeartbeat, StoreClient, WatchEvent
from .sync import SyncStoreClient, SyncTrainerClient
from .trainer import RolloutTripletReport, SubmittedGroup, TrainerClient, TrainingBatch

__all__ = [
    "AddSpansResult",
    "AttemptHeartbeat",
    "ClientConfig",
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
    "from_rpc_error",
]
