"""The Python clients of the lightning-grpc services: the public API.

- :class:`StoreClient` / :class:`SyncStoreClient`: rollouts, attempts, spans, resources, workers;
- :class:`RunnerSession` (``StoreClient.runner_session()``): a runner's claims, heartbeats and reports over one
  stream;
- :class:`TrainerClient` / :class:`SyncTrainerClient`: GRPO groups, training batches, steps;
- :class:`ProxyClient`: the LLM proxy's backends, pause and drain;
- :class:`ClientConfig`, :class:`RetryConfig`, :class:`TlsConfig`: how to reach a server.

Every method raises a subclass of :class:`lightning_grpc.errors.LightningError` on failure; the
methods the contract marks safe to repeat are retried on UNAVAILABLE. The channel factory and error
mapping the clients share (:mod:`.channel`, :mod:`.errors`) are implementation details, and so is
:mod:`.local`, the in-process store the server hands the proxy.
"""

from __future__ import annotations

from .config import ClientConfig, RetryConfig, TlsConfig
from .proxy import ProxyClient
from .session import RunnerSession
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
    "RunnerSession",
    "StoreClient",
    "SubmittedGroup",
    "SyncStoreClient",
    "SyncTrainerClient",
    "TlsConfig",
    "TrainerClient",
    "TrainingBatch",
    "WatchEvent",
]
