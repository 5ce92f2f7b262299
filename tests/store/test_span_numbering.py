"""Span batches numbered by the store's rule, whichever way a batch is checked: random batches (resent
spans, a span twice in one batch, spans that name other attempts, client-numbered spans, a faulty span)
against a model of the rule, in memory and on SQLite, with the span-id index moving its ids into its arrays
every few spans."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc import convert
from lightning_grpc.errors import InvalidArgumentError, ResourceExhaustedError
from lightning_grpc.store import SpanSelection, open_store, span_ids
from lightning_grpc.types import RolloutSpec, Span


class Model:
    """The rule: per attempt, a span id keeps the number it was first stored with; a client's number is
    taken as given and the store numbers above every number taken; the store numbers the rest in order."""

    def __init__(self) -> None:
        self.numbers: dict[str, dict[str, int]] = {}
        self.next: dict[str, int] = {}

    def add(self, spans: list[tuple[str, str, int]]) -> tuple[list[int], int]:
        """(attempt id, span id, client number or 0) of each span -> each span's number, and the new ones."""
        for attempt, span_id, number in spans:
            if number and span_id not in self.numbers[attempt]:
                self.next[attempt] = max(self.next[attempt], number + 1)
        out, stored = [], 0
        for attempt, span_id, number in spans:
            known = self.numbers[attempt]
            if span_id not in known:
                if not number:
                    number, self.next[attempt] = self.next[attempt], self.next[attempt] + 1
                known[span_id] = number
                stored += 1
            out.append(known[span_id])
        return out, stored


def body(
    rollout_id: str, attempt_id: str, span_id: str, number: int, parent: str = "", **fields: Any
) -> bytes:
    span = Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=number,
        trace_id="ab" * 16,
        span_id=span_id,
        parent_span_id=parent,
        name="step",
    )
    for name, value in fields.items():
        setattr(span, name, value)
    return convert.span_to_pb(span).SerializeToString()


#: A span with one fault, and the field the refusal names.
FAULTS = [
    ({"span_id": "0123456789ABCDEF"}, "span_id"),
    ({"span_id": "0123456789abcde"}, "span_id"),
    ({"trace_id": "ab" * 15 + "a b"}, "trace_id"),
    ({"parent": "xyz"}, "parent_span_id"),
    ({"number": 2**62 + 1}, "sequence_id"),
    ({"attributes": {"big": "x" * 2048}}, ""),  # over the store's max_span_bytes
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_random_batches_are_numbered_as_the_rule_says(
    backend: str, seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(span_ids, "MOVE_AT", 8)  # ids move into the index's arrays every 8 new ones
    rng = random.Random(seed)
    store = await open_store(tmp_path / "s.db" if backend == "sqlite" else None, max_span_bytes=2000)
    model = Model()
    attempts: list[tuple[str, str]] = []
    for i in range(3):
        rollout = await store.start_rollout(RolloutSpec(input={"i": i}), "w")
        assert rollout.latest_attempt is not None
        attempts.append((rollout.rollout_id, rollout.latest_attempt.attempt_id))
        model.numbers[rollout.latest_attempt.attempt_id], model.next[rollout.latest_attempt.attempt_id] = (
            {},
            1,
        )
    pool = [f"{n:016x}" for n in range(1, 120)]  # few ids: resends and repeats are frequent
    new_ids = (f"{n:016x}" for n in range(1_000, 10_000))  # never in the pool
    client_numbers = iter(range(5_000, 10_000_000, 2_000))  # never reached by the store's own numbers
    try:
        for _ in range(60):
            rid, aid = rng.choice(attempts)
            shape = rng.choice(["request", "request", "request", "own", "mixed", "client", "twice", "faulty"])
            twice = [next(new_ids) for _ in range(4)]  # for "twice": new ids, each sent more than once
            spans: list[tuple[str, str, int]] = []
            bodies: list[bytes] = []
            for _ in range(rng.randint(1, 24)):
                span_rid, span_aid = rng.choice(attempts) if shape == "mixed" else (rid, aid)
                span_id = rng.choice(twice if shape == "twice" else pool)
                number = 0
                if shape == "client" and rng.random() < 0.5 and span_id not in model.numbers[span_aid]:
                    number = next(client_numbers)
                named = shape in ("own", "mixed")
                spans.append((span_aid, span_id, number))
                bodies.append(
                    body(
                        span_rid if named else "",
                        span_aid if named else "",
                        span_id,
                        number,
                        rng.choice(["", pool[0]]),
                    )
                )
            if shape == "faulty":
                at = rng.randrange(len(bodies))
                fault, field = rng.choice(FAULTS)
                bodies[at] = body("", "", **{"span_id": next(new_ids), "number": 0, **fault})
                with pytest.raises(InvalidArgumentError if field else ResourceExhaustedError) as refused:
                    store.submit_spans(convert.span_records(bodies), rid, aid)
                assert refused.value.metadata["field"] == f"spans[{at}].{field}".rstrip(".")
                continue
            submitted = store.submit_spans(convert.span_records(bodies), rid, aid)
            expected, stored = model.add(spans)
            assert submitted.result.sequence_ids == expected, (shape, spans)
            assert submitted.result.stored_count == stored
            assert submitted.result.duplicate_count == len(spans) - stored
            if submitted.durable is not None:
                await submitted.durable
        for rid, aid in attempts:
            page: Any = await store.list_spans(
                SpanSelection(rollout_id=rid, attempt_id=aid), page_size=10_000
            )
            listed = {s.span_id: s.sequence_id for s in page.items}
            assert listed == model.numbers[aid]
    finally:
        await store.close()
