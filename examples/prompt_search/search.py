"""The prompt search, against a running store and runners.

    python -m examples.prompt_search.search --store 127.0.0.1:4747

Publishes each candidate prompt template as its own resources set, enqueues every task against
each, waits for the runners to finish them, and prints a table of the candidates' mean rewards, the
rollouts that got no reward (counted as failed, never as 0), the winner, and the trace of the
winner's best rollout. Exits 0 when every rollout got a reward, 1 when some did not, 2 when the
store cannot be reached.

The search itself (:func:`~lightning_grpc.examples.prompt_search_demo.search`, on the
:class:`~lightning_grpc.algorithm.Algorithm` helper) is defined once, in
:mod:`lightning_grpc.examples.prompt_search_demo`, which ``make demo`` also runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from lightning_grpc.client import ClientConfig
from lightning_grpc.errors import LightningError
from lightning_grpc.examples.prompt_search_demo import search_and_report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--store",
        default=os.environ.get("LIGHTNING_GRPC_STORE", "127.0.0.1:4747"),
        metavar="HOST:PORT",
        help="the store server (default: $LIGHTNING_GRPC_STORE or 127.0.0.1:4747)",
    )
    parser.add_argument(
        "--token", default=os.environ.get("LIGHTNING_GRPC_TOKEN"), help="bearer token, if the store needs one"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the rollouts (default 60)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    store = ClientConfig(target=args.store, token=args.token or None)
    try:
        return 0 if asyncio.run(search_and_report(store, args.timeout)) else 1
    except LightningError as exc:  # the store is unreachable, refuses the token, ...
        print(f"error: {exc.reason}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
