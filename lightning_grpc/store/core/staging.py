"""Staging spans into a commit: validated as a whole batch, numbered, counted."""

from __future__ import annotations

import re
from collections.abc import Iterable

from lightning_grpc.errors import InvalidArgumentError, Reason, ResourceExhaustedError
from lightning_grpc.types import AddSpansResult

from ..span_ids import SpanIdIndex
from ..state import AttemptState, RolloutState, SpanRecord, Txn
from .limits import MAX_BATCH_SPANS, MAX_SEQUENCE_ID, SPAN_OVERHEAD_BYTES
from .transitions import Transitions

_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")

#: A span's rollout and attempt, as the store holds them.
Target = tuple[RolloutState, AttemptState]


class SpanStaging(Transitions):
    """The span-id indexes of attempts, and :meth:`_stage_spans`, used by add_spans and complete_attempt."""

    def _span_index(self, rs: RolloutState, ast: AttemptState) -> SpanIdIndex:
        ids = ast.span_ids
        if ids is None:
            ids = ast.span_ids = SpanIdIndex(
                self.backend.load_span_ids(rs.rollout.rollout_id, ast.attempt.sequence_number)
            )
            self._indexed_spans += len(ids)
        return ids

    def _trim_span_indexes(self) -> None:
        """Drop span-id indexes of ended attempts, least recently used first, above the capacity.

        Runs only right after everything submitted is durable, so a dropped index reloads complete.
        """
        if self._indexed_spans <= self.span_index_capacity:
            return
        loaded = sorted(
            (a for a in self._attempts.values() if a.span_ids and not a.attempt.status.is_active),
            key=lambda a: a.index_used_at,
        )
        for ast in loaded:
            if self._indexed_spans <= self.span_index_capacity * 0.8:
                break
            self._indexed_spans -= len(ast.span_ids or ())
            ast.span_ids = None
            ast.used_sequence_ids = None

    def _stage_spans(
        self, records: list[SpanRecord], rollout_id: str, attempt_id: str, tx: Txn
    ) -> AddSpansResult:
        """Validate spans (refusing the whole batch on any fault), then add them to ``tx``.

        Nothing changes before every check passed, so a refusal leaves nothing behind.
        """
        if len(records) > MAX_BATCH_SPANS:
            raise InvalidArgumentError(
                "spans", f"must hold at most {MAX_BATCH_SPANS} spans (got {len(records)})"
            )
        now = self.clock()
        one = self._batch_of_one_attempt(records, rollout_id, attempt_id)
        if one is not None:  # the common batch, checked and numbered a column at a time
            target, batch_bytes = one
            self._ensure_memory(batch_bytes)
            result, stored_bytes = self._number_for_one_attempt(records, target, tx)
            attempts: Iterable[Target] = (target,)
        else:
            targets, batch_bytes = self._check_spans(records, rollout_id, attempt_id)
            self._check_client_numbers(records, targets)
            self._ensure_memory(batch_bytes)
            _reserve_client_numbers(records, targets)
            result, stored_bytes = self._number_and_store(records, targets, tx)
            attempts = {t[1].attempt.attempt_id: t for t in targets}.values()
        for rs, ast in attempts:
            ast.index_used_at = now
            self._touch(rs, ast, now, tx)
            tx.attempts[ast.attempt.attempt_id] = ast
            tx.span_rollouts.add(rs.rollout.rollout_id)
        self._indexed_spans += result.stored_count
        self._total_spans += result.stored_count
        self._memory_bytes += stored_bytes
        return result

    def _batch_of_one_attempt(
        self, records: list[SpanRecord], rollout_id: str, attempt_id: str
    ) -> tuple[Target, int] | None:
        """The attempt and the bytes of a batch whose spans all go to one attempt that exists, carry no
        sequence ids of their own and pass every check of :meth:`_check_spans`, checked a column at a time
        (the request's ids are filled in); None for any other batch, which :meth:`_check_spans` then checks
        span by span, naming the first fault."""
        pairs = {(r.rollout_id or rollout_id, r.attempt_id or attempt_id) for r in records}
        if len(pairs) != 1:
            return None
        ((rid, aid),) = pairs
        ast = self._attempts.get(aid)
        rs = self._rollouts.get(rid)
        if rs is None or ast is None or ast.attempt.rollout_id != rid:
            return None
        if any([r.sequence_id for r in records]):
            return None
        parents = [r.parent_span_id for r in records if r.parent_span_id]
        if not (
            _all_hex([r.span_id for r in records], 16)
            and _all_hex([r.trace_id for r in records], 32)
            and _all_hex(parents, 16)
        ):
            return None
        sizes = [len(r.body) for r in records]
        if max(sizes) > self.max_span_bytes:
            return None
        for r in records:
            r.rollout_id, r.attempt_id = rid, aid
        return (rs, ast), sum(sizes) + SPAN_OVERHEAD_BYTES * len(sizes)

    def _number_for_one_attempt(
        self, records: list[SpanRecord], target: Target, tx: Txn
    ) -> tuple[AddSpansResult, int]:
        """:meth:`_number_and_store` of a batch that :meth:`_batch_of_one_attempt` took."""
        rs, ast = target
        ids = self._span_index(rs, ast)
        first = ast.next_sequence_id
        numbers, fresh = ids.number([r.span_id for r in records], first)
        new = records if len(fresh) == len(records) else [records[i] for i in fresh]
        attempt_no = ast.attempt.sequence_number
        for seq, rec in enumerate(new, first):
            rec.sequence_id, rec.attempt_no = seq, attempt_no
        ast.next_sequence_id = first + len(new)
        if ast.used_sequence_ids is not None:
            ast.used_sequence_ids.update(range(first, first + len(new)))
        ids.compact()
        tx.spans.extend(new)
        ast.span_count += len(new)
        stored_bytes = sum([len(r.body) for r in new]) + SPAN_OVERHEAD_BYTES * len(new)
        rs.bytes += stored_bytes
        result = AddSpansResult(
            sequence_ids=numbers, stored_count=len(new), duplicate_count=len(records) - len(new)
        )
        return result, stored_bytes

    def _check_spans(
        self, records: list[SpanRecord], rollout_id: str, attempt_id: str
    ) -> tuple[list[Target], int]:
        """Each span's attempt (the request's ids fill in missing ones) and the bytes the batch adds."""
        targets: list[Target] = []
        cache_key: tuple[str, str] = ("", "")
        cache_val: Target | None = None
        batch_bytes = 0
        hex16, hex32 = _HEX16.fullmatch, _HEX32.fullmatch
        for i, rec in enumerate(records):
            rid = rec.rollout_id = rec.rollout_id or rollout_id
            aid = rec.attempt_id = rec.attempt_id or attempt_id
            if (rid, aid) != cache_key or cache_val is None:
                if not rid:
                    raise InvalidArgumentError(
                        f"spans[{i}].rollout_id", "is required (on the span or the request)"
                    )
                if not aid:
                    raise InvalidArgumentError(
                        f"spans[{i}].attempt_id", "is required (on the span or the request)"
                    )
                cache_val = self._attempt(rid, aid)
                cache_key = (rid, aid)
            targets.append(cache_val)
            if not hex16(rec.span_id):
                raise InvalidArgumentError(f"spans[{i}].span_id", "must be 16 lowercase hex characters")
            if not hex32(rec.trace_id):
                raise InvalidArgumentError(f"spans[{i}].trace_id", "must be 32 lowercase hex characters")
            if rec.parent_span_id and not hex16(rec.parent_span_id):
                raise InvalidArgumentError(
                    f"spans[{i}].parent_span_id", "must be empty or 16 lowercase hex characters"
                )
            if rec.sequence_id < 0 or rec.sequence_id > MAX_SEQUENCE_ID:
                raise InvalidArgumentError(
                    f"spans[{i}].sequence_id", f"must be between 0 and {MAX_SEQUENCE_ID}"
                )
            size = len(rec.body)
            if size > self.max_span_bytes:
                raise ResourceExhaustedError(
                    f"spans[{i}] is {size} bytes; the limit is {self.max_span_bytes}",
                    reason=Reason.SPAN_TOO_LARGE,
                    field=f"spans[{i}]",
                )
            batch_bytes += size + SPAN_OVERHEAD_BYTES
        return targets, batch_bytes

    def _check_client_numbers(self, records: list[SpanRecord], targets: list[Target]) -> None:
        """New client-numbered spans use numbers unused in their attempt (a resent span keeps its own)."""
        claimed: dict[str, set[int]] = {}
        batch_ids: dict[str, set[str]] = {}
        for i, rec in enumerate(records):
            if rec.sequence_id:
                rs, ast = targets[i]
                ids = self._span_index(rs, ast)
                if rec.span_id in ids or rec.span_id in batch_ids.get(rec.attempt_id, ()):
                    continue
                if ast.used_sequence_ids is None:
                    ast.used_sequence_ids = set(ids.values())
                mine = claimed.setdefault(rec.attempt_id, set())
                if rec.sequence_id in ast.used_sequence_ids or rec.sequence_id in mine:
                    raise InvalidArgumentError(
                        f"spans[{i}].sequence_id",
                        f"{rec.sequence_id} is already used in attempt {rec.attempt_id}",
                    )
                mine.add(rec.sequence_id)
                batch_ids.setdefault(rec.attempt_id, set()).add(rec.span_id)

    def _stored_numbers(
        self, records: list[SpanRecord], targets: list[Target], attempts: dict[str, Target]
    ) -> list[int | None] | None:
        """Each record's sequence id when its span id was stored before this batch, else None, with one lookup
        per attempt whose ids moved into the index's arrays; None when no attempt's did (then every stored id
        is found with SpanIdIndex.added)."""
        if not any(self._span_index(rs, ast).moved for rs, ast in attempts.values()):
            return None
        known: list[int | None] = [None] * len(records)
        for attempt_id, (rs, ast) in attempts.items():
            at = [i for i, t in enumerate(targets) if t[1].attempt.attempt_id == attempt_id]
            found = self._span_index(rs, ast).lookup([records[i].span_id for i in at])
            for i, number in zip(at, found, strict=True):
                known[i] = number
        return known

    def _number_and_store(
        self, records: list[SpanRecord], targets: list[Target], tx: Txn
    ) -> tuple[AddSpansResult, int]:
        """Give each new span its sequence id and put it into ``tx``; a span id already stored is a
        duplicate answered with its number. Returns the result and the bytes stored."""
        sequence_ids = [0] * len(records)
        stored = duplicates = 0
        stored_bytes = 0
        attempts = {t[1].attempt.attempt_id: t for t in targets}
        known = self._stored_numbers(records, targets, attempts)
        for i, rec in enumerate(records):
            rs, ast = targets[i]
            ids = ast.span_ids if ast.span_ids is not None else self._span_index(rs, ast)
            seq = None if known is None else known[i]
            if seq is None:
                seq = ids.added(rec.span_id)  # not moved yet, or earlier in this batch
            if seq is not None:
                sequence_ids[i] = seq
                duplicates += 1
                continue
            if rec.sequence_id:  # its number was reserved by _reserve_client_numbers
                seq = rec.sequence_id
            else:
                seq = ast.next_sequence_id
                ast.next_sequence_id = seq + 1
            if ast.used_sequence_ids is not None:
                ast.used_sequence_ids.add(seq)
            ids[rec.span_id] = seq
            rec.sequence_id = seq
            rec.attempt_no = ast.attempt.sequence_number
            sequence_ids[i] = seq
            tx.spans.append(rec)
            ast.span_count += 1
            stored += 1
            size = len(rec.body) + SPAN_OVERHEAD_BYTES
            rs.bytes += size
            stored_bytes += size
        for _, ast in attempts.values():
            if ast.span_ids is not None:
                ast.span_ids.compact()
        result = AddSpansResult(sequence_ids=sequence_ids, stored_count=stored, duplicate_count=duplicates)
        return result, stored_bytes


def _reserve_client_numbers(records: list[SpanRecord], targets: list[Target]) -> None:
    """Client-numbered spans claim their numbers first, so that automatic numbers go above them."""
    for i, rec in enumerate(records):
        if rec.sequence_id:
            ast = targets[i][1]
            if rec.sequence_id >= ast.next_sequence_id:
                ast.next_sequence_id = rec.sequence_id + 1


def _all_hex(ids: list[str], width: int) -> bool:
    """Whether every id is ``width`` lowercase hex characters (one pass over them all: bytes.fromhex takes
    hex digits of either case and skips whitespace, so the length and the case are checked too)."""
    if not ids:
        return True
    if set(map(len, ids)) != {width}:
        return False
    joined = "".join(ids)
    try:
        decoded = bytes.fromhex(joined)
    except ValueError:
        return False
    return len(decoded) * 2 == len(joined) and joined.lower() == joined
