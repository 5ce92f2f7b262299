"""lightning-grpc: agent reinforcement learning over a Protobuf + gRPC contract."""

from lightning_grpc.errors import LightningError
from lightning_grpc.types import (
    LLM,
    Attempt,
    AttemptStatus,
    JsonResource,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutSpec,
    RolloutStatus,
    Span,
    Worker,
    WorkerStatus,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Attempt",
    "AttemptStatus",
    "JsonResource",
    "LightningError",
    "PromptTemplate",
    "ProxyLLM",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutMode",
    "RolloutSpec",
    "RolloutStatus",
    "Span",
    "Worker",
    "WorkerStatus",
]
