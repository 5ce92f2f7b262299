"""Weight sync per training step: the learner's weights into the engine that serves them, vLLM against the
embedded engine, for the 558k-parameter model and a ~20M-parameter one, in the same run.

    python bench/weight_sync.py [--steps 5] [--sizes 558k,20m] [--engines embedded,vllm] [--out result.json]

For each model size a model is built with ``lightning-grpc init-model`` (qwen2; hidden 128 x 2 layers, and
hidden 512 x 16 layers) and served by each engine as a training run serves it (``training/engines.py``:
the embedded engine as a child process; vLLM bound to its private socket behind its gate). Each step then
does what a run's weight sync does: the weights change (an optimiser-like nudge of every parameter), are
written as a ``save_pretrained`` directory (``export``, as ``Learner.export_weights``), and the engine
serves them (``load``: the embedded engine's ``/admin/load_weights``; vLLM's pause, ``reload_weights``
through ``/collective_rpc``, ``/update_weight_version`` and resume). After the last step a greedy answer
(its ids and log-probs) is compared with the first step's, to show the engine really serves the new weights. Reported: medians of
export, load and their sum per engine and size, and load vLLM ÷ embedded.

vLLM needs its environment (``make vllm-env``); without it the vLLM column is left out, saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"558k": ("128", "2"), "20m": ("512", "16")}


def build_model(path: Path, size: str) -> int:
    hidden, layers = SIZES[size]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_grpc.cli.main",
            "init-model",
            str(path),
            "--hidden-size",
            hidden,
            "--layers",
            layers,
            "--seed",
            "0",
        ],
        check=True,
        capture_output=True,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make(kind: str) -> Any:
    from lightning_grpc.training.engines import EmbeddedEngine, VllmEngine

    if kind == "vllm":
        return VllmEngine(served_name="policy", max_model_len=256, kv_cache_gib=1.0)
    return EmbeddedEngine(served_name="policy")


async def greedy(url: str) -> tuple[list[int], list[float]]:
    """A greedy answer's token ids and their log-probs."""
    import aiohttp

    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Enter the first digit."}],
        "max_tokens": 8,
        "temperature": 0.0,
        "return_token_ids": True,
        "logprobs": True,
    }
    async with aiohttp.ClientSession() as http, http.post(f"{url}/v1/chat/completions", json=body) as resp:
        answer = await resp.json()
    choice = answer["choices"][0]
    logprobs = [round(float(t["logprob"]), 4) for t in (choice.get("logprobs") or {}).get("content") or []]
    return list(choice.get("token_ids") or []), logprobs


async def measure(kind: str, model_dir: Path, steps: int, work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    engine = make(kind)
    started = time.perf_counter()
    url = await asyncio.to_thread(engine.start, model_dir, 0)
    start_s = time.perf_counter() - started
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        first = await greedy(url)
        export_s, load_s = [], []
        generator = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.05 * (p.std() + 1e-3))
            t0 = time.perf_counter()
            out = work / f"{kind}-step-{step}"
            model.save_pretrained(out, safe_serialization=True)
            t1 = time.perf_counter()
            await engine.pause()
            version = await engine.load_weights(out, step)
            await engine.resume()
            t2 = time.perf_counter()
            assert version == step, (kind, version, step)
            export_s.append(t1 - t0)
            load_s.append(t2 - t1)
        last = await greedy(url)
    finally:
        await asyncio.to_thread(engine.stop)
    return {
        "start_seconds": start_s,
        "export_ms": 1000 * statistics.median(export_s),
        "load_ms": 1000 * statistics.median(load_s),
        "sync_ms": 1000 * statistics.median(e + load for e, load in zip(export_s, load_s, strict=True)),
        "steps": steps,
        "output_changed": first != last,
    }


def vllm_available() -> str:
    """Why vLLM cannot be measured here ("" when it can)."""
    from lightning_grpc.training.engines import vllm_python

    python = vllm_python()
    done = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    return "" if done.returncode == 0 else f"{python} cannot import vllm (make vllm-env builds it)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sizes", default="558k,20m")
    parser.add_argument("--engines", default="embedded,vllm")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engines = args.engines.split(",")
    result: dict[str, Any] = {"sizes": {}, "skipped": {}}
    if "vllm" in engines and (why := vllm_available()):
        result["skipped"]["vllm"] = why
        engines.remove("vllm")
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        work = Path(tmp)
        for size in args.sizes.split(","):
            model_dir = work / f"model-{size}"
            params = build_model(model_dir, size)
            row: dict[str, Any] = {"parameters": params}
            for kind in engines:
                row[kind] = asyncio.run(measure(kind, model_dir, args.steps, work))
                print(f"{size} ({params:,} parameters) {kind}: {json.dumps(row[kind])}", flush=True)
            if "vllm" in row and "embedded" in row:
                row["load_vllm_over_embedded"] = row["vllm"]["load_ms"] / row["embedded"]["load_ms"]
            result["sizes"][size] = row
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
