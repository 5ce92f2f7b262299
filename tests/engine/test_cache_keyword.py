"""The name under which the scheduler hands its KV cache to a model's forward pass."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_grpc.engine.scheduler import prefill, with_cache


class OlderCausalLM(torch.nn.Module):
    """A forward pass as transformers 4 wrote it: the cache is ``past_key_values``, there is no ``cache``."""

    def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> Any:
        return None


def test_the_cache_goes_under_the_name_the_forward_pass_takes(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    cache = object()
    ((name, given),) = with_cache(model, cache).items()
    assert given is cache and name in inspect.signature(model.forward).parameters
    assert with_cache(OlderCausalLM(), cache) == {"past_key_values": cache}


def test_a_prefill_uses_no_deprecated_argument_of_the_installed_transformers(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.inference_mode():
            logits, cache, mask = prefill(model, [[5, 6, 7], [8, 9]], pad_id=0)
    assert logits.shape[0] == 2 and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert all(layer.keys.shape[0] == 2 and layer.keys.shape[2] == 3 for layer in cache.layers)
