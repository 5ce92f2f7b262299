"""Credentials for least privilege, minted from the admin token (no server needed: they are signed, not stored).

lightning-grpc credential runner --worker-id gpu-node-7            # never expires (until the token changes)
lightning-grpc credential runner --worker-id gpu-node-7 --ttl 7d

The runner credential lets a runner dequeue and report for that worker id and nothing else; give it to
``lightning-grpc runner --token``. Attempt credentials are minted by the Store itself, one per attempt.
"""

from __future__ import annotations

import argparse
import os
import sys

from lightning_grpc import environment
from lightning_grpc.access import Credentials

from .queue_commands import parse_duration


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("credential", help="mint a runner credential from the admin token")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    r = kinds.add_parser("runner", help="a credential bound to one worker id (dequeue and report only)")
    r.add_argument("--worker-id", required=True, help="the worker id the runner must use")
    r.add_argument(
        "--ttl",
        type=parse_duration,
        default=None,
        help="how long it is valid: seconds, or 30m, 12h, 7d (default: until the admin token changes)",
    )
    r.add_argument(
        "--token",
        default=os.environ.get(environment.TOKEN),
        help=f"the store's admin token (default: ${environment.TOKEN})",
    )
    r.set_defaults(func=run_runner_credential)


def run_runner_credential(args: argparse.Namespace) -> int:
    if not args.token:
        print(f"error: the admin token is needed: --token or ${environment.TOKEN}", file=sys.stderr)
        return 2
    if not args.worker_id.strip():
        print("error: --worker-id must not be empty", file=sys.stderr)
        return 2
    print(Credentials(args.token).runner(args.worker_id, args.ttl))
    return 0
