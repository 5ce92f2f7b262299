"""The store core's limits and sizes, and its ids."""

from __future__ import annotations

import os

MAX_BATCH_ROLLOUTS = 10_000
MAX_BATCH_SPANS = 100_000
MAX_SPAN_SEQUENCE_RESERVATION = 1_000_000
MAX_WAIT_SECONDS = 3600.0
#: The shortest progress interval a watcher may ask for: one watcher must not get thousands of messages a second.
MIN_PROGRESS_INTERVAL = 0.1
DEFAULT_PROGRESS_INTERVAL = 5.0
MAX_ATTEMPTS_LIMIT = 1000
MAX_WAIT_IDS = 100_000
MAX_SEQUENCE_ID = 2**62
#: What the memory bound counts for a rollout, an attempt and a span besides their contents.
ROLLOUT_OVERHEAD_BYTES = 1024
ATTEMPT_OVERHEAD_BYTES = 320
SPAN_OVERHEAD_BYTES = 160
#: ``SpanSelection.attempt_id`` naming a rollout's latest attempt.
LATEST = "latest"


def new_id(prefix: str) -> str:
    """``prefix`` and 12 random hex digits (48 bits from the system's random source)."""
    return f"{prefix}-{os.urandom(6).hex()}"
