"""The Trainer: whole-group training batches from finished rollouts (core, no gRPC).

The loops that learn from the batches are in :mod:`lightning_grpc.training`.
"""

from .batches import BatchRollout, BuiltBatch, RowInfo
from .core import GroupSample, RunInterruption, TrainerCore, TrainerStatus, TrainingEvent
from .groups import Group
from .options import Aggregation, BatchOptions, FailurePolicy, Layout, PromptOverflow, RewardMatch
from .tensors import Ragged, concat, pad

__all__ = [
    "Aggregation",
    "BatchOptions",
    "BatchRollout",
    "BuiltBatch",
    "FailurePolicy",
    "Group",
    "GroupSample",
    "Layout",
    "PromptOverflow",
    "Ragged",
    "RewardMatch",
    "RowInfo",
    "RunInterruption",
    "TrainerCore",
    "TrainerStatus",
    "TrainingEvent",
    "concat",
    "pad",
]
