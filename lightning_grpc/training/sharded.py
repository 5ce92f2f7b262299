"""Checkpoints of a learner's ranks as torch.distributed.checkpoint writes them (one directory of shards,
re-cut for any number of ranks on load), and the random states each rank keeps beside them.

Used by the one-process learner (:mod:`.learner`, which reads such a checkpoint whole) and by its ranks
(:mod:`.distributed`); it knows neither, only what they hold (:class:`HasState`).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from lightning_grpc._extras import extra_imports

with extra_imports("train"):
    import numpy as np
    import torch

SHARDED_DIR = "sharded"
RANK_STATE = "rank-{rank}.pt"


class HasState(Protocol):
    """A learner, as far as its checkpoint goes."""

    step: int

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def reference(self) -> torch.nn.Module | None: ...


def random_states() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_random_states(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def sharded_state(learner: HasState) -> dict[str, Any]:
    """The model's and optimiser's (and reference's) state dicts as torch.distributed.checkpoint keeps
    them: by parameter name, each rank's shards (DTensors) or, in one process, the whole tensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model, optimizer = get_state_dict(learner.model, learner.optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer}
    if learner.reference is not None:
        state["reference"] = get_model_state_dict(learner.reference)
    return state


def load_sharded_checkpoint(learner: HasState, path: Path, rank: int) -> dict[str, Any]:
    """A checkpoint of ranks into ``learner``: a rank of any number of ranks (each reads its part of every
    shard) or the one-process learner (the whole); the step, the random states of ``rank`` (a rank that
    did not exist then keeps its seed's) and the loop's ``extra``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    state = sharded_state(learner)
    with warnings.catch_warnings():  # in one process DCP warns that it loads in one process: as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=str(path / SHARDED_DIR), no_dist=not _distributed())
    set_state_dict(
        learner.model,
        learner.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    if learner.reference is not None and "reference" in state:
        set_model_state_dict(learner.reference, state["reference"])
    own = path / RANK_STATE.format(rank=rank)
    saved = torch.load(own if own.exists() else path / RANK_STATE.format(rank=0), weights_only=False)
    learner.step = int(saved["step"])
    if own.exists():
        restore_random_states(saved["rng"])
    return dict(saved["extra"])


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
