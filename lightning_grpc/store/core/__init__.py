"""The store core: every state transition of rollouts, attempts, spans, resources and workers.

It knows nothing of gRPC. All state changes happen in plain (non-async) code on the event loop,
so each operation is atomic; what it changed is collected in a :class:`Txn`, handed to the
backend in one piece, and the caller is answered only once the backend says it is durable.

Rules (see DESIGN section 3):
- A SUCCEEDED/FAILED/CANCELLED rollout never changes status again.
- A rollout has at most one active attempt, and it is the latest; only the latest attempt moves
  the rollout; an ended attempt never changes again.
- Deadlines fire from a timer (the watchdog task), whether or not anyone calls the store.
- Spans and attempt heartbeats both keep an attempt alive.

Layout. :class:`Store` is one object whose methods are written in sections, one module each. The
lower layers are stacked, each using only those beneath it; the sections stand side by side on
top of them, and none calls another:

- ``limits.py``       limits, sizes and :func:`new_id`
- ``validation.py``   the pure checks (``check_id``, ``check_config``, ``check_json``, ...)
- ``base.py``         the shared state (``StoreBase.__init__``), committing a :class:`Txn`, lookups
- ``memory.py``       the memory bound of an in-memory store; taking rollouts out of the state
- ``transitions.py``  the state machine: change log, queue, deadlines, attempts begun/touched/ended
- ``staging.py``      a batch of spans checked, numbered and put into a commit
- sections:  ``rollouts.py`` (and the queue), ``attempts.py``, ``spans.py``, ``resources.py``,
  ``workers.py``, ``waiting.py`` (wait and watch, resume tokens), ``watchdog.py`` (the timers),
  ``housekeeping.py`` (statistics, deletion), ``inprocess.py`` (what the trainer core uses)
- ``store.py``        :class:`Store` composed of the sections: start, shutdown, close, and
  :meth:`Store.complete_and_dequeue`, the one operation that takes two sections
"""

from __future__ import annotations

from lightning_grpc.types import AddSpansResult, AttemptHeartbeat, WatchEvent

from .base import DequeueRequest, SpanSelection
from .limits import (
    ATTEMPT_OVERHEAD_BYTES,
    LATEST,
    MAX_ATTEMPTS_LIMIT,
    MAX_BATCH_ROLLOUTS,
    MAX_BATCH_SPANS,
    MAX_SEQUENCE_ID,
    MAX_SPAN_SEQUENCE_RESERVATION,
    MAX_WAIT_IDS,
    MAX_WAIT_SECONDS,
    ROLLOUT_OVERHEAD_BYTES,
    SPAN_OVERHEAD_BYTES,
    new_id,
)
from .spans import SubmittedSpans
from .store import Store
from .validation import check_json, check_timeout

#: The name the store used for :class:`~lightning_grpc.types.AttemptHeartbeat` before it moved there.
HeartbeatResult = AttemptHeartbeat

__all__ = [
    "ATTEMPT_OVERHEAD_BYTES",
    "LATEST",
    "MAX_ATTEMPTS_LIMIT",
    "MAX_BATCH_ROLLOUTS",
    "MAX_BATCH_SPANS",
    "MAX_SEQUENCE_ID",
    "MAX_SPAN_SEQUENCE_RESERVATION",
    "MAX_WAIT_IDS",
    "MAX_WAIT_SECONDS",
    "ROLLOUT_OVERHEAD_BYTES",
    "SPAN_OVERHEAD_BYTES",
    "AddSpansResult",
    "AttemptHeartbeat",
    "DequeueRequest",
    "HeartbeatResult",
    "SpanSelection",
    "Store",
    "SubmittedSpans",
    "WatchEvent",
    "check_json",
    "check_timeout",
    "new_id",
]
