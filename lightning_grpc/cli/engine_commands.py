"""The model engine's commands.

lightning-grpc init-model PATH [--arch qwen2|llama] [--vocab-size N] [--seed S]
lightning-grpc engine --model PATH [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
                      [--max-batch-size N] [--policy-version V] [--api-key KEY]

``init-model`` builds a tiny random model with its tokenizer in Hugging Face format (nothing is
downloaded); ``engine`` serves any such directory over an OpenAI-compatible HTTP API. Torch and
transformers are imported only when one of these runs, so the other commands stay quick.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from lightning_grpc import environment, logs

log = logs.get_logger(__name__)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("init-model", help="build a tiny random model and tokenizer in Hugging Face format")
    p.add_argument("path", type=Path, help="directory to write (created if missing)")
    p.add_argument(
        "--arch", choices=["qwen2", "llama"], default="qwen2", help="the transformers architecture"
    )
    p.add_argument(
        "--vocab-size", type=_positive_int, default=2048, help="tokens of its byte-level BPE tokenizer"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--hidden-size", type=_positive_int, default=64, help="width of the model")
    p.add_argument("--layers", type=_positive_int, default=2, help="decoder layers")
    p.add_argument(
        "--heads",
        type=_positive_int,
        default=4,
        help="attention heads (each hidden-size / heads wide; vLLM on CPU needs 32 or more)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a model already in PATH (refused without it)"
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_init_model)

    p = sub.add_parser("engine", help="serve a model over an OpenAI-compatible HTTP API (vLLM's dialect)")
    p.add_argument("--model", required=True, help="a save_pretrained directory (or a locally cached id)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged at start)")
    p.add_argument("--served-model-name", help="the model name clients use (default: --model as given)")
    p.add_argument("--max-batch-size", type=_positive_int, default=64, help="sequences decoded together")
    p.add_argument(
        "--max-prefill-tokens", type=_positive_int, default=16384, help="padded prompt tokens per prefill"
    )
    p.add_argument("--policy-version", type=int, default=0, help="the version reported until a reload")
    p.add_argument(
        "--api-key",
        default=os.environ.get(environment.ENGINE_API_KEY),
        help=f"required on the inference routes (${environment.ENGINE_API_KEY}; default: open, for loopback)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get(environment.ENGINE_ADMIN_KEY),
        help=f"required on /admin/load_weights (${environment.ENGINE_ADMIN_KEY}; default: --api-key, "
        "else a new key written to --admin-key-file)",
    )
    p.add_argument(
        "--admin-key-file",
        type=Path,
        help="where a generated admin key is written, mode 0600 "
        "(default: lightning-grpc-engine-PORT.admin-key in the temp directory, removed at exit)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--threads",
        type=_positive_int,
        help="torch threads of the generation thread (default: 1 under 20M parameters, else torch's)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_engine)


def run_init_model(args: argparse.Namespace) -> int:
    logs.configure_logging(args.log_level)
    _offline()
    from lightning_grpc.engine.tiny import build_tiny_model

    if args.path.is_file() or (args.path.is_dir() and any(args.path.iterdir()) and not args.force):
        what = "a file" if args.path.is_file() else "a directory that is not empty"
        print(
            f"error: {args.path} is {what}; init-model writes a new model there only with --force "
            "(which replaces a model that may be in use)",
            file=sys.stderr,
        )
        return 2
    try:
        build_tiny_model(
            args.path,
            arch=args.arch,
            vocab_size=args.vocab_size,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
        )
    except (ValueError, OSError) as exc:
        log.error("event=init_model_failed path=%s error=%s", args.path, exc)
        return 1
    return 0


def run_engine(args: argparse.Namespace) -> int:
    logs.configure_logging(args.log_level)
    _offline()
    from lightning_grpc.engine.server import EngineConfig, serve_forever

    config = EngineConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        policy_version=args.policy_version,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        admin_key_file=args.admin_key_file,
        dtype=args.dtype,
        threads=args.threads,
    )
    try:
        asyncio.run(serve_forever(config))
    except (OSError, ValueError) as exc:  # a missing or unreadable model, a port in use
        log.error("event=engine_failed model=%s error=%s", args.model, exc)
        return 1
    return 0


def _offline() -> None:
    """Nothing is fetched from a model hub: set before transformers is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value
