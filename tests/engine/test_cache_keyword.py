"""The name under which the scheduler hands its KV cache to a model's forward pass."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_grpc.engine.scheduler import prefill, with_cache
from lightning_grpc.engine.server import load_model


class OlderCausalLM(torch.nn.Module):
    """A forward pass as transformers 4 wrote it: the cache is ``past_key_values``, there is no ``cache``."""

    def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> Any:
        return None


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    """The tiny model, loaded as the engine loads it."""
    return load_model(model_dir)


def test_the_cache_goes_under_the_name_the_forward_pass_takes(model: Any) -> None:
    cache = object()
    ((name, given),) = with_cache(model, cache).items()
    assert given is cache and name in inspect.signature(model.forward).parameters
    assert with_cache(OlderCausalLM(), cache) == {"past_key_values": cache}


def test_a_prefill_uses_no_deprecated_argument_of_the_installed_transformers(model: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.inference_mode():
            logits, cache, mask = prefill(model, [[5, 6, 7], [8, 9]], pad_id=0)
    assert logits.shape[0] == 2 and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert all(layer.keys.shape[0] == 2 and layer.keys.shape[2] == 3 for layer in cache.layers)
