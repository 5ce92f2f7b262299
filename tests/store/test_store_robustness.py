"""Robustness of the store: thousands of generated requests, many of them malformed, against a live server.

``test_generated_traffic_keeps_the_store_sound`` runs a Hypothesis state machine against one
``lightning-grpc serve`` process per backend (in-memory and SQLite) through the raw Protobuf
stubs. It mixes valid traffic (so rollouts really move through queue, attempts, retries, timeouts,
cancellation and deletion) with random and boundary field values: empty, huge and unicode ids,
negative and huge page sizes, garbage, foreign and tampered page tokens, unknown enum numbers,
negative and out-of-range durations, malformed span ids, oversize spans (the server runs with
``--max-span-size 4KiB``), unknown ids and illegal transitions. It checks that

- every refusal is one of the client-error codes, with a ``google.rpc.Status`` holding exactly one
  ``ErrorInfo`` of the domain "lightning-grpc.dev", a message without a traceback, and for
  INVALID_ARGUMENT a message naming the field; where the request decides the answer, it is the
  expected code;
- a refused request changes nothing, and an accepted one does what the contract says;
- the server stays healthy and alive; and afterwards every invariant of the store holds (and, for
  SQLite, still holds with identical contents after a restart on the same file).

The other tests pin, one by one, the boundary cases the state machine reaches in the store's records
(span sizes and sequence ids, durations, JSON values, page and resume tokens, huge ids), against an
in-process server of each backend. The boundary cases of the server's wire (undecodable bytes, waits
against deadlines) are in tests/server/test_server_robustness.py.
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import math
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import grpc
import pytest
from google.protobuf import struct_pb2, text_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from lightning_grpc.v1 import rollout_pb2, span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests import robustness_helpers
from tests.conftest import (
    ServerProcess,
    every_store_backend,  # noqa: F401  (runs on PostgreSQL too)
)
from tests.robustness_helpers import (
    ABORTED,
    ACTIVE_ATTEMPT,
    ATTEMPT_FAILED,
    ATTEMPT_PREPARING,
    ATTEMPT_RUNNING,
    ATTEMPT_SUCCEEDED,
    ATTEMPT_TIMEOUT,
    ATTEMPT_UNRESPONSIVE,
    BAD_ENUM_NUMBERS,
    CALL_TIMEOUT,
    CHANNEL_OPTIONS,
    CODE_NAMES,
    EXHAUSTED,
    EXISTS,
    HEX16,
    HEX32,
    ID_SYNTAX,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INVALID,
    MAX_DURATION_SECONDS,
    MAX_SPAN_BYTES,
    NOT_FOUND,
    OK,
    OUT_OF_RANGE,
    PRECONDITION,
    QUEUED_ROLLOUT,
    RETRYABLE_ATTEMPT,
    ROLLOUT_CANCELLED,
    ROLLOUT_FAILED,
    ROLLOUT_PREPARING,
    ROLLOUT_QUEUING,
    ROLLOUT_REQUEUING,
    ROLLOUT_RUNNING,
    ROLLOUT_STATUS_NAMES,
    ROLLOUT_SUCCEEDED,
    TERMINAL_ROLLOUT,
    TRACE_ID,
    error_shape,
    outcome,
    started_attempt,
)

# The in-process server of each backend, with the small span limit, and a raw stub to it.
server_config = robustness_helpers.server_config
stub = robustness_helpers.stub

MIN_GENERATED_REQUESTS = 2000


# ====================================================================== small helpers


def describe(message: Message) -> str:
    """One line of a request for failure messages, cut short (some ids are 20,000 characters)."""
    text = text_format.MessageToString(message, as_one_line=True, as_utf8=True)
    return text if len(text) <= 400 else f"{text[:400]}... ({len(text)} characters)"


def duration_seconds(seconds: int, nanos: int) -> float:
    return seconds + nanos / 1e9


def to_value(obj: Any, out: struct_pb2.Value) -> None:
    """A JSON-like Python object as a Value, non-finite numbers included (they are test input)."""
    if obj is None:
        out.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        out.bool_value = obj
    elif isinstance(obj, int | float):
        out.number_value = float(obj)
    elif isinstance(obj, str):
        out.string_value = obj
    elif isinstance(obj, list):
        out.list_value.SetInParent()
        for item in obj:
            to_value(item, out.list_value.values.add())
    else:
        out.struct_value.SetInParent()
        for key, item in obj.items():
            to_value(item, out.struct_value.fields[key])


def to_struct(obj: dict[str, Any], out: struct_pb2.Struct) -> None:
    out.SetInParent()
    for key, item in obj.items():
        to_value(item, out.fields[key])


def from_value(value: struct_pb2.Value) -> Any:
    """A Value as plain Python, numbers as floats, so that sent and stored values compare."""
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "struct_value":
        return {k: from_value(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [from_value(v) for v in value.list_value.values]
    return getattr(value, kind)


def is_finite_json(obj: Any) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, list):
        return all(is_finite_json(x) for x in obj)
    if isinstance(obj, dict):
        return all(is_finite_json(x) for x in obj.values())
    return True


def spec_is_finite(spec: pb.RolloutSpec) -> bool:
    metadata = {k: from_value(v) for k, v in spec.metadata.fields.items()}
    return is_finite_json(from_value(spec.input)) and is_finite_json(metadata)


def encode_token(payload: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")


def decode_token(token: str) -> Any:
    """Page tokens are opaque, but a client can see they are base64 JSON and tamper with them."""
    return json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))


def span_identity_bytes(span: span_pb2.Span) -> bytes:
    """A span's bytes without the ids the store fills in, to compare what was sent and stored."""
    copy = span_pb2.Span()
    copy.CopyFrom(span)
    copy.rollout_id = ""
    copy.attempt_id = ""
    copy.sequence_id = 0
    return copy.SerializeToString(deterministic=True)


def pad_span(span: span_pb2.Span, size: int) -> span_pb2.Span:
    """Make the span's serialized size exactly ``size`` bytes by growing its name."""
    span.name = ""
    base = span.ByteSize()
    length = max(0, size - base - 3)
    span.name = "n" * length
    while span.ByteSize() < size:
        span.name += "n"
    while span.ByteSize() > size and span.name:
        span.name = span.name[:-1]
    assert span.ByteSize() == size, (span.ByteSize(), size)
    return span


# ====================================================================== the client side of the fuzz


class Skipped(Exception):
    """The run already failed: the state machine only draws now, it sends nothing."""


@dataclass
class Reply:
    code: str
    response: Any = None
    reason: str = ""
    field: str = ""

    @property
    def ok(self) -> bool:
        return self.code == OK


@dataclass
class SpanModel:
    #: None when the span was acknowledged on the stream (which does not return sequence ids).
    sequence_id: int | None
    body: bytes


@dataclass
class AttemptModel:
    rollout_id: str
    spans: dict[str, SpanModel] = field(default_factory=dict)
    #: Every sequence id the store hands out from now on must be greater than this.
    floor: int = 0
    #: Sequence ids known to be used (client-numbered collisions are predictable only when complete).
    used: set[int] = field(default_factory=set)
    complete: bool = True
    #: (status, end_time) once seen ended: an ended attempt never changes again.
    ended: tuple[int, tuple[int, int]] | None = None


@dataclass
class RolloutModel:
    #: The creation request's bytes: resending the same bytes is an idempotent retry.
    spec: bytes
    group_id: str
    input: Any
    #: False when the input or metadata held a non-finite number (then it is not compared).
    finite: bool
    attempts: list[str] = field(default_factory=list)
    #: (status, end_time) once seen terminal: a terminal rollout never changes status again.
    terminal: tuple[int, tuple[int, int]] | None = None


class Harness:
    """One server process, the stubs to it, and the model of what was acknowledged."""

    def __init__(self, server: ServerProcess, backend: str) -> None:
        self.server = server
        self.backend = backend
        self.generated = 0
        self.checks = 0
        self.codes: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[str] = collections.deque(maxlen=30)
        self.failure: str | None = None
        self.fresh = 0
        self.created = 0
        self.rollouts: dict[str, RolloutModel] = {}
        self.deleted: set[str] = set()
        self.attempts: dict[str, AttemptModel] = {}
        self.resources: dict[str, tuple[int, bytes]] = {}
        self.workers: set[str] = set()
        self.dequeues: dict[str, list[str]] = {}
        self.page_tokens: list[str] = []
        self.resume_tokens: list[str] = []
        self.store_id = ""
        self.channel: grpc.Channel | None = None
        self.connect()

    # ------------------------------------------------------------ plumbing
    def connect(self) -> None:
        self.channel = grpc.insecure_channel(self.server.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.StoreServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def next_id(self, prefix: str) -> str:
        self.fresh += 1
        return f"{prefix}-{self.fresh}"

    def next_span_id(self) -> str:
        self.fresh += 1
        return f"{self.fresh:016x}"

    def log_tail(self) -> str:
        return "".join(self.server.lines[-25:])

    def context(self) -> str:
        recent = "\n  ".join(self.recent)
        return f"\nlast requests:\n  {recent}\nserver log tail:\n{self.log_tail()}"

    def call(
        self,
        method: str,
        request: Message,
        expect: Iterable[str] | None = None,
        *,
        field: str | None = None,
        reason: str | None = None,
        timeout: float | None = CALL_TIMEOUT,
        check: bool = False,
    ) -> Reply:
        """One unary call; a refusal is checked for shape and, when given, against ``expect``."""
        if self.failure is not None and not check:
            raise Skipped
        if check:
            self.checks += 1
        else:
            self.generated += 1
        context = f"{method}({describe(request)})"
        try:
            response = getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code().name  # type: ignore[attr-defined]
            self.recent.append(f"{context} -> {code}: {exc.details()}")  # type: ignore[attr-defined]
            try:
                code, info = error_shape(exc, context)
            except AssertionError as bad:
                raise AssertionError(f"{bad}{self.context()}") from None
            self.codes[code] += 1
            reply = Reply(code, None, info.reason, info.metadata.get("field", ""))
        else:
            self.recent.append(f"{context} -> OK")
            self.codes[OK] += 1
            reply = Reply(OK, response)
        self.expect(reply, context, expect, field=field, reason=reason)
        return reply

    def expect(
        self,
        reply: Reply,
        context: str,
        expect: Iterable[str] | None,
        *,
        field: str | None = None,
        reason: str | None = None,
    ) -> None:
        if expect is not None:
            wanted = set(expect)
            assert reply.code in wanted, (
                f"{context} answered {reply.code} ({reply.reason} {reply.field}), "
                f"expected one of {sorted(wanted)}{self.context()}"
            )
        if field is not None and reply.code == INVALID:
            assert reply.field == field, f"{context} named field {reply.field!r}, expected {field!r}"
        if reason is not None and not reply.ok and expect is not None and len(set(expect)) == 1:
            assert reply.reason == reason, f"{context} gave reason {reply.reason!r}, expected {reason!r}"

    def stream_refusal(self, exc: grpc.RpcError, context: str, expect: Iterable[str] | None) -> Reply:
        code = exc.code().name  # type: ignore[attr-defined]
        self.recent.append(f"{context} -> {code}: {exc.details()}")  # type: ignore[attr-defined]
        try:
            code, info = error_shape(exc, context)
        except AssertionError as bad:
            raise AssertionError(f"{bad}{self.context()}") from None
        self.codes[code] += 1
        reply = Reply(code, None, info.reason, info.metadata.get("field", ""))
        self.expect(reply, context, expect)
        return reply

    def check_health(self) -> None:
        assert self.server.proc is not None and self.server.proc.poll() is None, (
            f"the server process exited with {self.server.proc and self.server.proc.poll()}{self.context()}"
        )
        for service in ("", "lightning.v1.StoreService"):
            self.checks += 1
            answer = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, f"health of {service!r}: {answer}"

    # ------------------------------------------------------------ what responses must look like
    def observe_attempt(self, a: rollout_pb2.Attempt, owner: str) -> None:
        assert a.rollout_id == owner, f"attempt {a.attempt_id} of {a.rollout_id} listed under {owner}"
        assert a.attempt_id, f"attempt without id in {owner}"
        assert a.sequence_number >= 1, f"attempt {a.attempt_id} has sequence number {a.sequence_number}"
        assert a.status != 0, f"attempt {a.attempt_id} has no status"
        if a.status in ACTIVE_ATTEMPT:
            assert not a.HasField("end_time"), f"active attempt {a.attempt_id} has an end_time"
        else:
            assert a.HasField("end_time"), f"ended attempt {a.attempt_id} ({a.status}) has no end_time"
        assert a.HasField("start_time"), f"attempt {a.attempt_id} has no start_time"
        model = self.attempts.get(a.attempt_id)
        if model is None:
            if owner in self.rollouts:
                model = self.attempts[a.attempt_id] = AttemptModel(owner)
            else:
                return
        assert model.rollout_id == owner, f"attempt {a.attempt_id} moved from {model.rollout_id} to {owner}"
        end = (a.end_time.seconds, a.end_time.nanos)
        if model.ended is not None:
            assert (a.status, end) == model.ended, (
                f"ended attempt {a.attempt_id} changed: was {model.ended}, now {(a.status, end)}"
            )
        elif a.status not in ACTIVE_ATTEMPT:
            model.ended = (a.status, end)

    def observe_rollout(self, r: rollout_pb2.Rollout) -> None:
        """Every rollout any response carries is one consistent snapshot of the store."""
        rid = r.rollout_id
        assert rid, "rollout without id"
        name = ROLLOUT_STATUS_NAMES.get(r.status, str(r.status))
        assert r.status in ROLLOUT_STATUS_NAMES and r.status != 0, f"{rid} has status {r.status}"
        assert r.HasField("create_time"), f"{rid} has no create_time"
        if r.status in TERMINAL_ROLLOUT:
            assert r.HasField("end_time"), f"terminal rollout {rid} ({name}) has no end_time"
        else:
            assert not r.HasField("end_time"), f"unfinished rollout {rid} ({name}) has an end_time"
        has_latest = r.HasField("latest_attempt")
        latest = r.latest_attempt
        if r.status == ROLLOUT_QUEUING:
            assert not has_latest and r.attempt_count == 0, f"QUEUING rollout {rid} has an attempt"
        else:
            assert has_latest or r.status == ROLLOUT_CANCELLED, f"{rid} ({name}) has no latest attempt"
        if has_latest:
            assert r.attempt_count == latest.sequence_number, (
                f"{rid}: attempt_count {r.attempt_count} but the latest attempt is #{latest.sequence_number}"
            )
            assert r.HasField("start_time"), f"{rid} has attempts but no start_time"
            self.observe_attempt(latest, rid)
        else:
            assert r.attempt_count == 0, f"{rid} counts {r.attempt_count} attempts but shows none"
        expected_latest = {
            ROLLOUT_PREPARING: {ATTEMPT_PREPARING},
            ROLLOUT_RUNNING: {ATTEMPT_RUNNING},
            ROLLOUT_REQUEUING: RETRYABLE_ATTEMPT,
            ROLLOUT_SUCCEEDED: {ATTEMPT_SUCCEEDED},
            ROLLOUT_FAILED: RETRYABLE_ATTEMPT,
        }.get(r.status)
        if expected_latest is not None:
            assert latest.status in expected_latest, (
                f"{rid} is {name} but its latest attempt {latest.attempt_id} is {latest.status}"
            )
        if r.status == ROLLOUT_CANCELLED and has_latest:
            assert latest.status not in ACTIVE_ATTEMPT, f"cancelled {rid} has an active attempt"
        model = self.rollouts.get(rid)
        if model is None:
            return
        assert rid not in self.deleted, f"deleted rollout {rid} is back"
        end = (r.end_time.seconds, r.end_time.nanos)
        if model.terminal is not None:
            assert (r.status, end) == model.terminal, (
                f"terminal rollout {rid} changed: was {model.terminal}, now {(r.status, end)}"
            )
        elif r.status in TERMINAL_ROLLOUT:
            model.terminal = (r.status, end)
        assert r.group_id == model.group_id, f"{rid}: group_id {r.group_id!r} != {model.group_id!r}"
        if model.finite:
            assert from_value(r.input) == model.input, f"{rid}: input changed to {from_value(r.input)!r}"
        if has_latest and latest.attempt_id not in model.attempts:
            model.attempts.append(latest.attempt_id)

    # ------------------------------------------------------------ model queries
    def live_attempt(self, rollout_id: str, attempt_id: str) -> bool:
        model = self.attempts.get(attempt_id)
        return (
            model is not None
            and model.rollout_id == rollout_id
            and rollout_id in self.rollouts
            and rollout_id not in self.deleted
        )

    def forget(self, rollout_id: str) -> None:
        model = self.rollouts.pop(rollout_id, None)
        self.deleted.add(rollout_id)
        if model is not None:
            for aid in model.attempts:
                self.attempts.pop(aid, None)
        for aid in [aid for aid, a in self.attempts.items() if a.rollout_id == rollout_id]:
            del self.attempts[aid]

    def remember_token(self, token: str) -> None:
        if token and len(self.page_tokens) < 200:
            self.page_tokens.append(token)


# ====================================================================== strategies

WEIRD_IDS = [
    "",
    " ",
    "-",
    ".hidden",
    "a" * 128,
    "a" * 129,
    "x" * 20_000,
    "ünïcödé",
    "日本語のid",
    "emoji-🦄",
    "nul\x00byte",
    "tab\tid",
    "new\nline",
    "zero\u200bwidth",
    "../../etc/passwd",
    "'; DROP TABLE rollouts; --",
    "%s%n%x",
    "latest",
    "ro-missing",
    "at-missing",
    "ＦＵＬＬＷＩＤＴＨ",
]
weird_ids = st.one_of(st.sampled_from(WEIRD_IDS), st.text(max_size=16))
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_leaves,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=6,
)
NON_FINITE = [math.nan, math.inf, -math.inf]
BAD_ENUMS = st.sampled_from(BAD_ENUM_NUMBERS)
ORDERS = st.sampled_from([0, 1, 2, *BAD_ENUM_NUMBERS])  # an unknown sort order is harmless
short_texts = st.one_of(st.text(max_size=10), st.sampled_from(["", "ü\x00\u202e", "💥" * 20, "g" * 256]))
small_texts = st.one_of(short_texts, st.sampled_from(["x" * 300]))
GOOD_GROUPS = st.one_of(st.sampled_from(["", "", "group-a", "group-b"]), short_texts)
BAD_GROUPS = st.sampled_from(["g" * 257, "ü" * 1000])
GOOD_WORKERS = st.sampled_from(["", "worker-1", "worker-2", "worker-3", "worker-4"])
BAD_SPAN_IDS = st.one_of(
    st.sampled_from(["", "ABCDEF0123456789", "0123", "g" * 16, "0" * 17, "０" * 16, "é" * 16]),
    st.text(max_size=18),
)
BAD_NAMES = st.sampled_from(["", "n" * 257])
# (seconds, nanos) of RolloutConfig deadlines. Valid ones are tiny (they fire at once, so rollouts
# time out and retry) or long (they never fire during the test), so the store is quiet afterwards.
GOOD_DEADLINES = st.sampled_from(
    [
        (0, 1),
        (0, 1_000_000),
        (0, 20_000_000),
        (1, -999_999_999),
        (7200, 0),
        (86_400, 500),
        (10**9, 0),
        (315_576_000_000, 999_999_999),  # the largest google.protobuf.Duration
    ]
)
# Beyond the Duration range (2**62 s, int64-max s) is invalid input, like non-positive deadlines.
BAD_DEADLINES = st.sampled_from(
    [(0, 0), (-1, 0), (0, -1), (-1, 999_999_999), (-(2**63), 0), (2**62, 0), (INT64_MAX, 0)]
)
# Waits a request may carry without a deadline: tiny valid ones, and ones the contract refuses.
SHORT_WAITS = [(0, 0), (0, 1), (0, 5_000_000), (0, 20_000_000)]
BAD_WAITS = [(-1, 0), (0, -1), (3601, 0), (3600, 1), (INT64_MAX, 0), (-(2**63), 0), (10**12, 0)]
BAD_WAITS_ST = st.sampled_from(BAD_WAITS)
GOOD_PAGE_SIZES = st.sampled_from([0, 0, 1, 2, 3, 100, 1000, 1001, 10_000, 10_001, INT32_MAX])
BAD_PAGE_SIZES = st.sampled_from([-1, INT32_MIN])
GARBAGE_TOKENS = [
    "!",
    "====",
    "e30",
    encode_token({}),
    encode_token([]),
    encode_token(None),
    encode_token("p"),
    encode_token({"p": 1}),
    encode_token({"p": 1, "f": "0000000000000000"}),
    encode_token({"f": "0000000000000000"}),
    "ééé",
    "a" * 5000,
    base64.urlsafe_b64encode(b"\xff\xfe\x00garbage").decode(),
]
TAMPERED_POSITIONS: list[Any] = [
    -1,
    -3,
    -(2**63),
    2**63,
    10**30,
    1.5,
    "1",
    "",
    None,
    True,
    [],
    [1],
    [1, 1],
    [1, -1],
    [-1, -1],
    [2**63, 1],
    [1, 2**63],
    [10**30, 0],
    [1, 2, 3],
    [1.5, 1],
    {"p": 1},
]
RESUME_SUFFIXES = ["", "-1", "²", "¹²", "١٢", "00000", "1.5", " 1", "99999999999999999999999", "0x10", "Ⅻ"]


T = TypeVar("T")
INDEXES = st.integers(0, 2**20)


def pick(data: st.DataObject, pool: Sequence[T], label: str) -> T | None:
    """An element of a pool that grows and shrinks with the store, or None when it is empty.

    It always draws one integer of the same range: what a rule draws must depend only on what it
    drew before, never on the store, or Hypothesis calls the data generation flaky."""
    index = data.draw(INDEXES, label=label)
    return pool[index % len(pool)] if pool else None


def combine(*checks: Iterable[str]) -> set[str]:
    """The codes a request may get when each check may answer one of its codes ("OK": passes)
    and the store stops at the first failing check, in an order the test does not assume."""
    sets = [set(c) for c in checks]
    out = {code for c in sets for code in c if code != OK}
    if all(OK in c for c in sets):
        out.add(OK)
    return out


def one(code: str | None) -> set[str]:
    return {code} if code else {OK}


def status_filter_codes(statuses: Iterable[int], known: Iterable[int]) -> set[str]:
    """An unknown status number in a filter is INVALID_ARGUMENT; UNSPECIFIED (0) may match nothing."""
    values = set(statuses)
    if values - set(known) - {0}:
        return {INVALID}
    return {OK, INVALID} if 0 in values else {OK}


# ====================================================================== the state machine


def guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """Keep the first failure, with its context, instead of raising it; the test raises it after
    the run. Raising it here would make Hypothesis replay the example against a server whose state
    has moved on, and report a real bug as flaky. After a failure the rules still draw exactly as
    before (Hypothesis requires it) but send nothing: every call raises ``Skipped``."""

    @functools.wraps(fn)
    def wrapper(self: StoreFuzzer, **kwargs: Any) -> None:
        try:
            fn(self, **kwargs)
        except Exception:
            if self.h.failure is None:
                self.h.failure = f"step {fn.__name__} failed:\n{traceback.format_exc()}"

    return wrapper


class StoreFuzzer(RuleBasedStateMachine):
    harness: ClassVar[Harness]

    def __init__(self) -> None:
        super().__init__()
        self.h = self.harness

    # ------------------------------------------------------------ drawing requests
    def draw_duration(
        self, data: st.DataObject, choices: Sequence[tuple[int, int]], out: Any, label: str
    ) -> tuple[int, int] | None:
        value = data.draw(st.none() | st.sampled_from(list(choices)), label=label)
        if value is not None:
            out.seconds, out.nanos = value
        return value

    def either(self, data: st.DataObject, sloppy: bool, good: Any, bad: Any, label: str) -> Any:
        """A good value; in a sloppy request, one time in three a bad one."""
        if sloppy and data.draw(st.integers(0, 2), label=f"bad {label}?") == 0:
            return data.draw(bad, label=f"bad {label}")
        return data.draw(good, label=label)

    def sloppy(self, data: st.DataObject) -> bool:
        """One request in three carries bad values; the others must be served."""
        return bool(data.draw(st.integers(0, 2), label="sloppy request?") == 0)

    def draw_spec(self, data: st.DataObject, sloppy: bool) -> tuple[pb.RolloutSpec, str | None, set[str]]:
        """A rollout spec, the code its own fields call for (None when valid), and the codes the
        server may choose between for values it may accept or refuse (beyond Duration's range)."""
        lenient = {OK}
        spec = pb.RolloutSpec()
        problem: str | None = None
        kind = data.draw(st.sampled_from(["fresh"] * 5 + ["generated", "existing", "weird"]), label="id kind")
        if kind == "fresh":
            spec.rollout_id = self.h.next_id("fz")
        elif kind == "existing":
            spec.rollout_id = pick(data, list(self.h.rollouts), "existing rollout") or ""
        elif kind == "weird":
            spec.rollout_id = data.draw(weird_ids, label="weird rollout id")
        if spec.rollout_id and not ID_SYNTAX.fullmatch(spec.rollout_id):
            problem = problem or INVALID
        value = data.draw(json_values, label="input")
        if sloppy and data.draw(st.integers(0, 3), label="non-finite input?") == 0:
            value = [value, data.draw(st.sampled_from(NON_FINITE))]
        to_value(value, spec.input)
        spec.group_id = self.either(data, sloppy, GOOD_GROUPS, BAD_GROUPS, "group_id")
        if len(spec.group_id) > 256:
            problem = problem or INVALID
        spec.mode = self.either(data, sloppy, st.sampled_from([0, 0, 1, 2, 3]), BAD_ENUMS, "mode")
        if spec.mode not in (0, 1, 2, 3):
            problem = problem or INVALID
        if data.draw(st.booleans(), label="has config"):
            config = spec.config
            for name in ("timeout", "unresponsive_timeout"):
                chosen = self.either(data, sloppy, st.none() | GOOD_DEADLINES, BAD_DEADLINES, name)
                if chosen is not None:
                    getattr(config, name).seconds, getattr(config, name).nanos = chosen
                    if duration_seconds(*chosen) <= 0:
                        problem = problem or INVALID
                    if chosen[0] > MAX_DURATION_SECONDS:
                        lenient = {OK, INVALID}
            config.max_attempts = self.either(
                data,
                sloppy,
                st.sampled_from([0, 1, 2, 3, 5, 1000]),
                st.sampled_from([1001, -1, INT32_MAX, INT32_MIN]),
                "max_attempts",
            )
            if not 0 <= config.max_attempts <= 1000:
                problem = problem or INVALID
            retry_on = self.either(
                data,
                sloppy,
                st.lists(st.sampled_from([4, 5, 6]), max_size=3),
                st.lists(st.sampled_from([0, 1, 3, 7, 99, -1, 4]), min_size=1, max_size=3),
                "retry_on",
            )
            config.retry_on.extend(retry_on)
            if any(s not in RETRYABLE_ATTEMPT for s in retry_on):
                problem = problem or INVALID
        metadata = data.draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3), label="metadata")
        if sloppy and data.draw(st.integers(0, 5), label="non-finite metadata?") == 0:
            metadata["bad"] = data.draw(st.sampled_from(NON_FINITE))
        if metadata:
            to_struct(metadata, spec.metadata)
        resources = self.either(
            data, sloppy, st.sampled_from(["", "", "", "known"]), st.just("missing"), "resources"
        )
        if resources == "known":
            spec.resources_id = pick(data, list(self.h.resources), "resources id") or ""
        elif resources == "missing":
            spec.resources_id = "rs-missing"
            problem = problem or NOT_FOUND
        return spec, problem, lenient

    def draw_worker(self, data: st.DataObject, sloppy: bool) -> tuple[str, bool]:
        worker = str(self.either(data, sloppy, GOOD_WORKERS, weird_ids, "worker_id"))
        return worker, worker == "" or bool(ID_SYNTAX.fullmatch(worker))

    def draw_rollout_ref(self, data: st.DataObject) -> tuple[str, str | None]:
        """A rollout id and the code its lookup must give (None: it exists)."""
        choice = data.draw(st.sampled_from(["live"] * 6 + ["deleted", "weird"]), label="rollout kind")
        if choice == "live":
            rid = pick(data, list(self.h.rollouts), "live rollout") or "ro-missing"
        elif choice == "deleted":
            rid = pick(data, sorted(self.h.deleted), "deleted rollout") or "ro-missing"
        else:
            rid = data.draw(weird_ids, label="weird rollout")
        return rid, self.lookup_problem(rid)

    def lookup_problem(self, rollout_id: str) -> str | None:
        if not rollout_id:
            return INVALID
        if rollout_id in self.h.rollouts:
            return None
        return NOT_FOUND

    def draw_attempt_ref(self, data: st.DataObject) -> tuple[str, str, str | None]:
        """A (rollout id, attempt id) pair and the code resolving it must give (None: it exists)."""
        choice = data.draw(
            st.sampled_from(["live"] * 8 + ["other rollout", "unknown", "empty", "weird"]),
            label="attempt kind",
        )
        if choice in ("live", "other rollout"):
            aid = pick(data, list(self.h.attempts), "attempt") or "at-missing"
            rid = self.h.attempts[aid].rollout_id if aid in self.h.attempts else "ro-missing"
            if choice == "other rollout":
                rid = pick(data, list(self.h.rollouts), "other rollout") or rid
            return rid, aid, self.attempt_problem(rid, aid)
        rid = pick(data, list(self.h.rollouts), "rollout") or "ro-missing"
        if choice == "empty":
            rid = data.draw(st.sampled_from([rid, ""]))
            return rid, "", self.attempt_problem(rid, "")
        aid = data.draw(weird_ids, label="weird attempt")
        if choice == "weird":
            rid = data.draw(weird_ids, label="weird rollout")
        return rid, aid, self.attempt_problem(rid, aid)

    def attempt_problem(self, rollout_id: str, attempt_id: str) -> str | None:
        problem = self.lookup_problem(rollout_id)
        if problem is not None:
            return problem
        if not attempt_id:
            return INVALID
        return None if self.h.live_attempt(rollout_id, attempt_id) else NOT_FOUND

    def draw_page(self, data: st.DataObject, request: Any, sloppy: bool) -> set[str]:
        """Fill page_size and page_token; return the codes they may call for."""
        request.page_size = self.either(data, sloppy, GOOD_PAGE_SIZES, BAD_PAGE_SIZES, "page_size")
        size = {INVALID} if request.page_size < 0 else {OK}
        choice = self.either(
            data, sloppy, st.just("none"), st.sampled_from(["garbage", "text", "foreign"]), "page_token"
        )
        token = {OK}
        if choice == "garbage":
            request.page_token = data.draw(st.sampled_from(GARBAGE_TOKENS), label="garbage token")
            token = {INVALID}
        elif choice == "text":
            request.page_token = data.draw(st.text(min_size=1, max_size=24), label="text token")
            token = {INVALID}
        elif choice == "foreign":  # usually a token of other filters; now and then a usable one
            request.page_token = pick(data, self.h.page_tokens, "foreign token") or ""
            token = {OK, INVALID} if request.page_token else {OK}
        return combine(size, token)

    # ------------------------------------------------------------ rollouts
    def register_created(self, spec: pb.RolloutSpec, rollout: rollout_pb2.Rollout) -> None:
        rid = rollout.rollout_id
        if rid in self.h.rollouts:
            return
        value = from_value(spec.input)
        metadata = {k: from_value(v) for k, v in spec.metadata.fields.items()}
        finite = is_finite_json(value) and is_finite_json(metadata)
        self.h.created += 1
        self.h.rollouts[rid] = RolloutModel(
            spec=spec.SerializeToString(deterministic=True),
            group_id=spec.group_id,
            input=value,
            finite=finite,
        )
        self.h.deleted.discard(rid)
        if finite:
            stored = {k: from_value(v) for k, v in rollout.metadata.fields.items()}
            assert stored == metadata, f"{rid}: metadata {stored!r} != {metadata!r}"
        assert rollout.mode == spec.mode, f"{rid}: mode {rollout.mode} != {spec.mode}"

    def check_nothing_created(self, specs: Iterable[pb.RolloutSpec]) -> None:
        """A refused creation leaves no rollout behind."""
        for spec in specs:
            if (
                spec.rollout_id
                and spec.rollout_id not in self.h.rollouts
                and ID_SYNTAX.fullmatch(spec.rollout_id)
            ):
                self.h.call(
                    "GetRollout",
                    pb.GetRolloutRequest(rollout_id=spec.rollout_id),
                    [NOT_FOUND],
                    reason="ROLLOUT_NOT_FOUND",
                )

    def conflict_codes(self, specs: Sequence[pb.RolloutSpec]) -> set[str]:
        """Codes an existing or repeated caller-chosen id may give (same bytes: none)."""
        codes: set[str] = set()
        seen: dict[str, bytes] = {}
        for spec in specs:
            body = spec.SerializeToString(deterministic=True)
            if not spec.rollout_id:
                continue
            model = self.h.rollouts.get(spec.rollout_id)
            if model is not None and model.spec != body:
                codes.add(EXISTS)
            if spec.rollout_id in seen and seen[spec.rollout_id] != body:
                codes.update({INVALID, EXISTS})
            seen[spec.rollout_id] = body
        return codes

    @initialize(data=st.data())
    @guarded
    def seed_work(self, data: st.DataObject) -> None:
        """Every example starts with fresh rollouts in the queue and one already started."""
        drawn = [self.draw_spec(data, sloppy=False) for _ in range(4)]
        for spec, _, _ in drawn:
            spec.rollout_id = self.h.next_id("fz")
        specs = [spec for spec, _, _ in drawn[:3]]
        expect = combine(*(lenient for _, _, lenient in drawn[:3]))
        reply = self.h.call("EnqueueRollouts", pb.EnqueueRolloutsRequest(rollouts=specs), expect)
        for spec, rollout in zip(specs, reply.response.rollouts if reply.ok else [], strict=False):
            self.register_created(spec, rollout)
            self.h.observe_rollout(rollout)
        spec, _, lenient = drawn[3]
        reply = self.h.call(
            "StartRollout", pb.StartRolloutRequest(rollout=spec, worker_id="worker-1"), lenient
        )
        if reply.ok:
            self.register_created(spec, reply.response.rollout)
            self.h.observe_rollout(reply.response.rollout)

    @rule(data=st.data())
    @guarded
    def enqueue_rollouts(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        count = self.either(data, sloppy, st.sampled_from([1, 1, 1, 2, 3]), st.just(0), "batch size")
        drawn = [self.draw_spec(data, sloppy) for _ in range(count)]
        specs = [spec for spec, _, _ in drawn]
        request = pb.EnqueueRolloutsRequest(rollouts=specs)
        # JSON has no NaN: refusing a non-finite number is fine (storing it and serving it back too).
        expect = combine(
            *(one(problem) for _, problem, _ in drawn),
            *(lenient for _, _, lenient in drawn),
            *({OK} if spec_is_finite(spec) else {OK, INVALID} for spec in specs),
        )
        if OK in expect:
            expect |= self.conflict_codes(specs)
        if not specs:
            expect = {OK}  # an empty batch queues nothing
        reply = self.h.call("EnqueueRollouts", request, expect)
        if not reply.ok:
            self.check_nothing_created(specs)
            return
        assert len(reply.response.rollouts) == len(specs), "EnqueueRollouts answered another count"
        for spec, rollout in zip(specs, reply.response.rollouts, strict=True):
            if spec.rollout_id:
                assert rollout.rollout_id == spec.rollout_id, "EnqueueRollouts changed a caller-chosen id"
            else:
                assert ID_SYNTAX.fullmatch(rollout.rollout_id), f"generated id {rollout.rollout_id!r}"
            fresh = rollout.rollout_id not in self.h.rollouts
            self.register_created(spec, rollout)
            self.h.observe_rollout(rollout)
            if fresh:
                assert rollout.status == ROLLOUT_QUEUING, f"new rollout {rollout.rollout_id} not QUEUING"

    @rule(data=st.data())
    @guarded
    def start_rollout(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        worker, worker_ok = self.draw_worker(data, sloppy)
        spec, problem, lenient = self.draw_spec(data, sloppy)
        request = pb.StartRolloutRequest(rollout=spec, worker_id=worker)
        expect = combine(
            {OK} if worker_ok else {INVALID},
            one(problem),
            lenient,
            {OK} if spec_is_finite(spec) else {OK, INVALID},
        )
        if OK in expect:
            expect |= self.conflict_codes([spec])
        reply = self.h.call("StartRollout", request, expect)
        if not reply.ok:
            self.check_nothing_created([spec])
            return
        rollout = reply.response.rollout
        fresh = rollout.rollout_id not in self.h.rollouts
        self.register_created(spec, rollout)
        self.h.observe_rollout(rollout)
        if fresh:
            assert rollout.attempt_count == 1, f"StartRollout made {rollout.attempt_count} attempts"
            assert rollout.latest_attempt.worker_id == worker, "StartRollout lost the worker id"
            if worker:
                self.h.workers.add(worker)

    @rule(data=st.data())
    @guarded
    def dequeue_rollouts(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        worker, worker_ok = self.draw_worker(data, sloppy)
        request = pb.DequeueRolloutsRequest(worker_id=worker)
        request.max_rollouts = self.either(
            data,
            sloppy,
            st.sampled_from([0, 1, 1, 1, 2, 5, 10_000]),
            st.sampled_from([10_001, -1, INT32_MAX, INT32_MIN]),
            "max_rollouts",
        )
        wait = self.either(data, sloppy, st.none() | st.sampled_from(SHORT_WAITS), BAD_WAITS_ST, "wait")
        bad_wait = wait is not None and wait not in SHORT_WAITS
        if wait is not None:
            request.wait_timeout.seconds, request.wait_timeout.nanos = wait
        reuse = self.either(
            data, sloppy, st.sampled_from(["none", "fresh", "fresh", "reuse"]), st.just("long"), "request id"
        )
        if reuse == "fresh":
            request.request_id = self.h.next_id("dq")
        elif reuse == "reuse":
            request.request_id = pick(data, list(self.h.dequeues), "reused request id") or ""
        elif reuse == "long":
            request.request_id = "r" * 129
        problem = None
        if (
            not worker_ok
            or not 0 <= request.max_rollouts <= 10_000
            or bad_wait
            or len(request.request_id) > 128
        ):
            problem = INVALID
        # Refused waits are sent without a deadline: with one, the server may shorten them first.
        reply = self.h.call(
            "DequeueRollouts",
            request,
            {problem} if problem else {OK},
            timeout=None if bad_wait else CALL_TIMEOUT,
        )
        if not reply.ok:
            return
        claimed = [r.rollout_id for r in reply.response.rollouts]
        assert len(set(claimed)) == len(claimed), f"DequeueRollouts claimed a rollout twice: {claimed}"
        for rollout in reply.response.rollouts:
            self.h.observe_rollout(rollout)
        earlier = self.h.dequeues.get(request.request_id)
        if earlier is not None:  # a retry answers what the first call claimed, whatever happened since
            alive = [rid for rid in earlier if rid not in self.h.deleted]
            assert claimed == alive, f"a retried dequeue returned {claimed}, first {earlier}"
            return
        assert len(claimed) <= max(1, request.max_rollouts), "DequeueRollouts claimed too many"
        for rollout in reply.response.rollouts:
            attempt = rollout.latest_attempt
            assert attempt.worker_id == worker, "the new attempt lost its worker id"
            # A tiny deadline may already have ended it (the watchdog runs before the reply).
            assert attempt.status in (ATTEMPT_PREPARING, ATTEMPT_TIMEOUT, ATTEMPT_UNRESPONSIVE), attempt
        if worker:
            self.h.workers.add(worker)
        if request.request_id and claimed:
            self.h.dequeues[request.request_id] = claimed

    def get_rollout(self, rollout_id: str, expect: Iterable[str] | None = None) -> rollout_pb2.Rollout | None:
        reply = self.h.call("GetRollout", pb.GetRolloutRequest(rollout_id=rollout_id), expect)
        if reply.ok:
            self.h.observe_rollout(reply.response.rollout)
            return reply.response.rollout  # type: ignore[no-any-return]
        return None

    @rule(data=st.data())
    @guarded
    def start_attempt(self, data: st.DataObject) -> None:
        worker, worker_ok = self.draw_worker(data, self.sloppy(data))
        rid, problem = self.draw_rollout_ref(data)
        before = self.get_rollout(rid, {problem} if problem else {OK})
        if not worker_ok:
            expect = {INVALID}
        elif problem is not None:
            expect = {problem}
        else:
            assert before is not None
            if before.status in TERMINAL_ROLLOUT:
                expect = {PRECONDITION}
            elif before.status in QUEUED_ROLLOUT:
                expect = {OK}
            else:  # its attempt is active, or just ended by the watchdog
                expect = {OK, PRECONDITION}
        reply = self.h.call("StartAttempt", pb.StartAttemptRequest(rollout_id=rid, worker_id=worker), expect)
        if reply.ok:
            assert before is not None
            rollout = reply.response.rollout
            self.h.observe_rollout(rollout)
            assert rollout.attempt_count == before.attempt_count + 1, "StartAttempt did not add one attempt"
            assert rollout.latest_attempt.worker_id == worker

    @rule(data=st.data())
    @guarded
    def complete_attempt(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        rid, aid, problem = self.draw_attempt_ref(data)
        status = self.either(
            data,
            sloppy,
            st.sampled_from([3, 4]),
            st.sampled_from([0, 1, 2, 5, 6, 7, *BAD_ENUM_NUMBERS]),
            "status",
        )
        request = pb.CompleteAttemptRequest(rollout_id=rid, attempt_id=aid, status=status)
        request.message = data.draw(small_texts, label="message")
        metadata = None
        if data.draw(st.booleans(), label="metadata?"):
            metadata = data.draw(st.dictionaries(st.text(max_size=5), json_values, max_size=2))
            if sloppy and data.draw(st.integers(0, 3), label="non-finite?") == 0:
                metadata["bad"] = math.nan
            to_struct(metadata, request.metadata)
        report_again = data.draw(st.booleans(), label="report again?")
        again = data.draw(st.sampled_from([status, 7 - status]), label="second outcome")
        valid_status = status in (ATTEMPT_SUCCEEDED, ATTEMPT_FAILED)
        state = {OK}
        if problem is None and valid_status:
            ended = self.h.attempts[aid].ended
            if ended is None:
                state = {OK, PRECONDITION}  # the watchdog may have ended it
            elif ended[0] != status:
                state = {PRECONDITION}
        finite = metadata is None or is_finite_json(metadata)
        expect = combine(
            one(problem), {OK} if valid_status else {INVALID}, state, {OK} if finite else {OK, INVALID}
        )
        bad_status = problem is None and not valid_status and finite
        reply = self.h.call("CompleteAttempt", request, expect, field="status" if bad_status else None)
        if not reply.ok:
            if problem is None and status in (ATTEMPT_SUCCEEDED, ATTEMPT_FAILED):
                self.check_attempt_not_ended_as(rid, aid, status)
            return
        attempt, rollout = reply.response.attempt, reply.response.rollout
        assert attempt.attempt_id == aid and attempt.status == status, f"CompleteAttempt answered {attempt}"
        self.h.observe_attempt(attempt, rid)
        self.h.observe_rollout(rollout)
        if rollout.latest_attempt.attempt_id == aid:
            allowed = (
                {ROLLOUT_SUCCEEDED}
                if status == ATTEMPT_SUCCEEDED
                else {
                    ROLLOUT_FAILED,
                    ROLLOUT_REQUEUING,
                    ROLLOUT_CANCELLED,
                }
            )
            assert rollout.status in allowed, (
                f"{rid} is {rollout.status} after its latest attempt ended {status}"
            )
        if report_again:
            repeat = pb.CompleteAttemptRequest(rollout_id=rid, attempt_id=aid, status=again)  # type: ignore[arg-type]
            second = self.h.call(
                "CompleteAttempt",
                repeat,
                {OK} if again == status else {PRECONDITION},
                reason="ATTEMPT_ALREADY_ENDED",
            )
            if second.ok:
                assert second.response.attempt.end_time == attempt.end_time, (
                    "a repeated report moved end_time"
                )
                self.h.observe_rollout(second.response.rollout)

    def check_attempt_not_ended_as(self, rid: str, aid: str, status: int) -> None:
        """A refused report must not have ended the attempt with the refused outcome."""
        model = self.h.attempts.get(aid)
        if model is None or model.ended is not None:
            return
        for attempt in self.list_all_attempts(rid, check=False):
            if attempt.attempt_id == aid:
                assert attempt.status != status, (
                    f"CompleteAttempt({aid}, {status}) was refused, yet the attempt ended as {status}"
                )

    @rule(data=st.data())
    @guarded
    def heartbeat_attempt(self, data: st.DataObject) -> None:
        rid, aid, problem = self.draw_attempt_ref(data)
        reply = self.h.call(
            "HeartbeatAttempt",
            pb.HeartbeatAttemptRequest(rollout_id=rid, attempt_id=aid),
            {problem} if problem else {OK},
        )
        if reply.ok:
            resp = reply.response
            self.h.observe_attempt(resp.attempt, rid)
            assert resp.attempt.attempt_id == aid
            assert resp.cancelled == (resp.rollout_status == ROLLOUT_CANCELLED)
            if resp.attempt.status not in ACTIVE_ATTEMPT or resp.cancelled:
                assert resp.should_stop, f"an ended or cancelled attempt was not told to stop: {resp}"

    @rule(data=st.data())
    @guarded
    def cancel_rollout(self, data: st.DataObject) -> None:
        rid, problem = self.draw_rollout_ref(data)
        reason = data.draw(small_texts, label="reason")
        before = self.get_rollout(rid, {problem} if problem else {OK})
        if problem is not None:
            expect = {problem}
        else:
            assert before is not None
            if before.status == ROLLOUT_CANCELLED:
                expect = {OK}
            elif before.status in TERMINAL_ROLLOUT:
                expect = {PRECONDITION}
            else:
                expect = {OK, PRECONDITION}  # the watchdog may finish it first
        reply = self.h.call(
            "CancelRollout",
            pb.CancelRolloutRequest(rollout_id=rid, reason=reason),
            expect,
            reason="ROLLOUT_FINISHED" if expect == {PRECONDITION} else None,
        )
        if reply.ok:
            assert before is not None
            rollout = reply.response.rollout
            self.h.observe_rollout(rollout)
            assert rollout.status == ROLLOUT_CANCELLED, f"CancelRollout left {rid} {rollout.status}"
            if before.status == ROLLOUT_CANCELLED:
                assert rollout.end_time == before.end_time, "cancelling again moved end_time"
                assert rollout.status_message == before.status_message, "cancelling again changed the message"

    @rule(data=st.data())
    @guarded
    def update_rollout(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        rid, problem = self.draw_rollout_ref(data)
        request = pb.UpdateRolloutRequest(rollout_id=rid)
        updatable = ["group_id", "metadata", "mode", "config", "input", "resources_id"]
        paths = self.either(
            data,
            sloppy,
            st.lists(st.sampled_from(updatable), max_size=3, unique=True),
            st.lists(
                st.sampled_from([*updatable, "status", "rollout_id", "bogus", ""]), min_size=1, max_size=3
            ),
            "update_mask",
        )
        request.update_mask.paths.extend(paths)
        problems: list[str] = []
        if any(p not in updatable for p in paths):
            problems.append(INVALID)
        request.group_id = self.either(data, sloppy, GOOD_GROUPS, BAD_GROUPS, "group_id")
        request.mode = self.either(data, sloppy, st.sampled_from([0, 1, 2, 3]), BAD_ENUMS, "mode")
        if data.draw(st.booleans(), label="config?"):
            timeout = self.either(data, sloppy, st.none() | GOOD_DEADLINES, BAD_DEADLINES, "timeout")
            if timeout is not None:
                request.config.timeout.seconds, request.config.timeout.nanos = timeout
            request.config.max_attempts = self.either(
                data, sloppy, st.sampled_from([0, 2, 5]), st.sampled_from([-1, 1001]), "max_attempts"
            )
        effective = paths or [
            f.name for f, _ in request.ListFields() if f.name not in ("rollout_id", "update_mask")
        ]
        if "group_id" in effective and len(request.group_id) > 256:
            problems.append(INVALID)
        if "mode" in effective and request.mode not in (0, 1, 2, 3):
            problems.append(INVALID)
        if "config" in effective:
            config = request.config
            if (
                config.HasField("timeout")
                and duration_seconds(config.timeout.seconds, config.timeout.nanos) <= 0
            ):
                problems.append(INVALID)
            if not 0 <= config.max_attempts <= 1000:
                problems.append(INVALID)
            lenient = {OK, INVALID} if config.timeout.seconds > MAX_DURATION_SECONDS else {OK}
        else:
            lenient = {OK}
        if problem is not None:
            problems.append(problem)
        if "input" in paths:
            to_value(data.draw(json_values, label="new input"), request.input)
        reply = self.h.call("UpdateRollout", request, combine(*({p} for p in problems), lenient))
        if reply.ok:
            rollout = reply.response.rollout
            model = self.h.rollouts[rid]
            if "group_id" in effective:
                model.group_id = request.group_id
            if "input" in effective:
                model.input = from_value(request.input)
            self.h.observe_rollout(rollout)

    @rule(data=st.data())
    @guarded
    def read_rollout(self, data: st.DataObject) -> None:
        rid, problem = self.draw_rollout_ref(data)
        method = data.draw(
            st.sampled_from(["GetRollout", "GetLatestAttempt", "ListAttempts"]), label="method"
        )
        expect = {problem} if problem else {OK}
        if method == "GetRollout":
            self.get_rollout(rid, expect)
        elif method == "GetLatestAttempt":
            reply = self.h.call("GetLatestAttempt", pb.GetLatestAttemptRequest(rollout_id=rid), expect)
            if reply.ok and reply.response.HasField("attempt"):
                self.h.observe_attempt(reply.response.attempt, rid)
        else:
            request = pb.ListAttemptsRequest(rollout_id=rid)
            request.order = data.draw(ORDERS, label="order")
            paging = self.draw_page(data, request, self.sloppy(data))
            reply = self.h.call("ListAttempts", request, combine(one(problem), paging))
            if reply.ok:
                for attempt in reply.response.attempts:
                    self.h.observe_attempt(attempt, rid)
                self.h.remember_token(reply.response.next_page_token)

    # ------------------------------------------------------------ listing rollouts
    @rule(data=st.data())
    @guarded
    def list_rollouts(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        request = pb.ListRolloutsRequest()
        statuses = self.either(
            data,
            sloppy,
            st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7]), max_size=3),
            st.lists(st.sampled_from([0, *BAD_ENUM_NUMBERS, 1]), min_size=1, max_size=3),
            "statuses",
        )
        request.statuses.extend(statuses)
        if data.draw(st.booleans(), label="by ids?"):
            live = list(self.h.rollouts) or ["ro-missing"]
            for item in data.draw(st.lists(INDEXES | weird_ids, max_size=4), label="ids"):
                request.rollout_ids.append(live[item % len(live)] if isinstance(item, int) else item)
        request.rollout_id_contains = data.draw(st.sampled_from(["", "", "fz-1", "-", "ü"]), label="contains")
        request.mode = self.either(data, sloppy, st.sampled_from([0, 0, 0, 1, 2, 3]), BAD_ENUMS, "mode")
        request.group_id = data.draw(
            st.sampled_from(["", "", "group-a", "group-b", "nope"]), label="group_id"
        )
        request.order_by = self.either(
            data,
            sloppy,
            st.sampled_from(["", "create_time", "start_time", "end_time", "rollout_id", "status"]),
            st.sampled_from(["nope", "CREATE_TIME", "create_time ", "rowid"]),
            "order_by",
        )
        request.order = data.draw(ORDERS, label="order")
        expect = combine(
            status_filter_codes(statuses, ROLLOUT_STATUS_NAMES),
            {OK}
            if request.order_by in ("", "create_time", "start_time", "end_time", "rollout_id", "status")
            else {INVALID},
            {OK} if request.mode in (0, 1, 2, 3) else {INVALID},
            self.draw_page(data, request, sloppy),
        )
        reply = self.h.call("ListRollouts", request, expect)
        if not reply.ok:
            return
        resp = reply.response
        size = request.page_size or 100
        assert len(resp.rollouts) <= min(size, 1000), f"a page of {len(resp.rollouts)} for page_size {size}"
        assert resp.total_size >= len(resp.rollouts)
        assert bool(resp.next_page_token) == (len(resp.rollouts) < resp.total_size), (
            f"next_page_token {resp.next_page_token!r} with {len(resp.rollouts)} of {resp.total_size}"
        )
        for rollout in resp.rollouts:
            self.h.observe_rollout(rollout)
            assert not statuses or rollout.status in statuses
            assert not request.rollout_ids or rollout.rollout_id in request.rollout_ids
            assert request.rollout_id_contains in rollout.rollout_id
            assert not request.mode or rollout.mode == request.mode
            assert not request.group_id or rollout.group_id == request.group_id
        ids = [r.rollout_id for r in resp.rollouts]
        assert len(set(ids)) == len(ids), f"ListRollouts listed a rollout twice: {ids}"
        self.h.remember_token(resp.next_page_token)

    @rule(data=st.data())
    @guarded
    def walk_rollout_pages(self, data: st.DataObject) -> None:
        """Paging by a stable order visits every rollout exactly once."""
        order_by = data.draw(st.sampled_from(["", "create_time", "rollout_id"]), label="order_by")
        order = data.draw(st.sampled_from([0, 1, 2]), label="order")
        size = data.draw(st.sampled_from([7, 50, 400]), label="page_size")
        seen: list[str] = []
        token = ""
        total = -1
        while True:
            request = pb.ListRolloutsRequest(order_by=order_by, order=order, page_size=size, page_token=token)  # type: ignore[arg-type]
            resp = self.h.call("ListRollouts", request, {OK}).response
            total = resp.total_size if total < 0 else total
            assert resp.total_size == total, "total_size changed while paging"
            seen.extend(r.rollout_id for r in resp.rollouts)
            token = resp.next_page_token
            if not token:
                break
        assert len(seen) == len(set(seen)) == total, (
            f"paging saw {len(seen)} ({len(set(seen))} distinct) of {total}"
        )
        assert set(self.h.rollouts) <= set(seen), (
            f"rollouts missing: {sorted(set(self.h.rollouts) - set(seen))[:5]}"
        )
        assert not set(seen) & self.h.deleted, "a deleted rollout is still listed"

    @rule(data=st.data())
    @guarded
    def tampered_page_token(self, data: st.DataObject) -> None:
        """A real page token with its position changed is refused or served, never a crash."""
        method = data.draw(
            st.sampled_from(["ListRollouts", "ListAttempts", "ListSpans", "ListResources", "ListWorkers"]),
            label="method",
        )
        position = data.draw(st.sampled_from(TAMPERED_POSITIONS) | json_values, label="position")
        request: Any
        if method == "ListRollouts":
            request = pb.ListRolloutsRequest(page_size=1)
        elif method == "ListAttempts":
            candidates = [rid for rid, m in self.h.rollouts.items() if len(m.attempts) >= 2]
            chosen = pick(data, candidates, "rollout")
            if chosen is None:
                return
            request = pb.ListAttemptsRequest(rollout_id=chosen, page_size=1)
        elif method == "ListSpans":
            candidates = sorted(
                {
                    a.rollout_id
                    for a in self.h.attempts.values()
                    if len(a.spans) >= 2 and a.rollout_id in self.h.rollouts
                }
            )
            chosen = pick(data, candidates, "rollout")
            if chosen is None:
                return
            request = pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id=chosen), page_size=1)
        elif method == "ListResources":
            request = pb.ListResourcesRequest(page_size=1)
        else:
            request = pb.ListWorkersRequest(page_size=1)
        first = self.h.call(method, request, {OK})
        token = first.response.next_page_token
        if not token:
            return
        payload = decode_token(token)
        if isinstance(payload, dict):
            payload["p"] = position
        request.page_token = encode_token(payload)
        reply = self.h.call(method, request, {OK, INVALID}, field="page_token")
        if reply.ok:
            items = {
                "ListRollouts": "rollouts",
                "ListAttempts": "attempts",
                "ListSpans": "spans",
                "ListResources": "resources",
                "ListWorkers": "workers",
            }[method]
            assert len(getattr(reply.response, items)) <= 1, (
                f"{method} ignored page_size with a tampered token"
            )

    # ------------------------------------------------------------ spans
    def draw_span(self, data: st.DataObject, attempt_id: str, sloppy: bool) -> span_pb2.Span:
        """A span; in a sloppy batch, one of its fields may be bad (oversize most often)."""
        span = span_pb2.Span()
        model = self.h.attempts.get(attempt_id)
        fault = (
            data.draw(
                st.sampled_from(["none", "span_id", "trace_id", "parent", "sequence_id", "size", "size"])
            )
            if sloppy
            else "none"
        )
        if fault == "span_id":
            span.span_id = data.draw(BAD_SPAN_IDS, label="bad span id")
        elif data.draw(st.integers(0, 4), label="resend a span id?") == 0:
            sent = list(model.spans) if model else []
            span.span_id = pick(data, sent, "sent span id") or self.h.next_span_id()
        else:
            span.span_id = self.h.next_span_id()
        span.trace_id = TRACE_ID
        if fault == "trace_id":
            span.trace_id = data.draw(st.sampled_from(["", TRACE_ID.upper(), TRACE_ID[:-1], "é" * 32]))
        span.parent_span_id = data.draw(st.sampled_from(["", "", "00f067aa0ba902b7"]), label="parent")
        if fault == "parent":
            span.parent_span_id = data.draw(BAD_SPAN_IDS.filter(bool), label="bad parent")
        span.kind = data.draw(st.sampled_from([0, 1, 2, 3, 4, 5, *BAD_ENUM_NUMBERS]), label="kind")
        span.start_time_unix_nano = data.draw(st.sampled_from([0, 1, 2**64 - 1, 1_700_000_000_000_000_000]))
        span.sequence_id = data.draw(
            st.sampled_from([0] * 24 + [1, 2, 5, 9, 13, 21, 2**62, INT64_MAX]), label="sequence_id"
        )
        if fault == "sequence_id":
            span.sequence_id = data.draw(st.sampled_from([-1, -(2**63)]), label="bad sequence id")
        if data.draw(st.booleans(), label="attributes?"):
            span.attributes["x"].double_value = data.draw(st.sampled_from([0.5, math.nan, math.inf, -0.0]))
            span.attributes["tokens"].int_array_value.values.extend([1, -(2**63), INT64_MAX])
            span.attributes["nested"].kvlist_value.values.add(key="k").value.bytes_value = b"\x00\xff"
        if fault == "size":
            pad_span(span, MAX_SPAN_BYTES + data.draw(st.sampled_from([1, 999]), label="over by"))
        elif data.draw(st.integers(0, 9), label="exactly at the limit?") == 0:
            pad_span(span, MAX_SPAN_BYTES)
        else:
            span.name = data.draw(small_texts, label="name")
        return span

    def span_batch(
        self, data: st.DataObject, client_numbered: bool = True
    ) -> tuple[str, str, list[span_pb2.Span], str | None, set[str]]:
        """A batch of spans with its defaults, the code the batch calls for, and the codes the store may
        choose for what it may refuse (a client-chosen sequence id that may collide, or that leaves no
        room below 2**63 for the ids the store assigns)."""
        sloppy = self.sloppy(data)
        rid, aid, _ = self.draw_attempt_ref(data)
        count = data.draw(st.sampled_from([0, 1, 1, 2, 3, 4]), label="spans")
        spans = [self.draw_span(data, aid, sloppy) for _ in range(count)]
        if not client_numbered:  # the store numbers them all
            for span in spans:
                span.sequence_id = min(span.sequence_id, 0)
        on_span = data.draw(st.sampled_from(["request", "request", "span", "mixed"]), label="ids on")
        request_rid, request_aid = rid, aid
        for i, span in enumerate(spans):
            if on_span == "span" or (on_span == "mixed" and i % 2):
                span.rollout_id, span.attempt_id = rid, aid
        if on_span == "span":
            request_rid, request_aid = data.draw(
                st.sampled_from([("", ""), (rid, aid), ("ro-other", "at-other")])
            )
        # What the store must answer: the first problem, span by span, in its order of checks.
        problem: str | None = None
        lenient: set[str] = set()
        batch_ids: set[str] = set()
        batch_seqs: set[int] = set()
        store_numbered = any(not s.sequence_id for s in spans)
        for span in spans:
            span_rid = span.rollout_id or request_rid
            span_aid = span.attempt_id or request_aid
            found = INVALID if not span_rid or not span_aid else self.attempt_problem(span_rid, span_aid)
            if found is None and not HEX16.fullmatch(span.span_id):
                found = INVALID
            if found is None and not HEX32.fullmatch(span.trace_id):
                found = INVALID
            if found is None and span.parent_span_id and not HEX16.fullmatch(span.parent_span_id):
                found = INVALID
            if found is None and span.sequence_id < 0:
                found = INVALID
            if found is None and span.ByteSize() > MAX_SPAN_BYTES:
                found = EXHAUSTED
            problem = problem or found
            model = self.h.attempts.get(span_aid) if self.h.live_attempt(span_rid, span_aid) else None
            if model is None:
                continue
            # The store may check these before or after the problems above.
            if span.sequence_id >= 2**62 or (store_numbered and model.floor >= 2**62):
                lenient |= {INVALID, OUT_OF_RANGE, EXHAUSTED}
            if span.sequence_id > 0 and span.span_id not in model.spans and span.span_id not in batch_ids:
                if (
                    not model.complete
                    or span.sequence_id in model.used
                    or span.sequence_id in batch_seqs
                    or (store_numbered and span.sequence_id > model.floor)
                ):
                    lenient.add(INVALID)  # refusing it is fine; a reused sequence id is not
                batch_seqs.add(span.sequence_id)
            batch_ids.add(span.span_id)
        return request_rid, request_aid, spans, problem, lenient

    def record_spans(
        self, spans: Sequence[span_pb2.Span], aid: str, sequence_ids: Sequence[int] | None
    ) -> tuple[int, int]:
        """Check an acknowledged batch against the model and record it; return (stored, duplicate)."""
        stored = duplicate = 0
        in_batch: dict[tuple[str, str], int | None] = {}
        for i, span in enumerate(spans):
            model = self.h.attempts[span.attempt_id or aid]
            seq = None if sequence_ids is None else sequence_ids[i]
            key = (span.attempt_id or aid, span.span_id)
            known = model.spans.get(span.span_id)
            if known is not None or key in in_batch:
                duplicate += 1
                previous = known.sequence_id if known is not None else in_batch[key]
                if seq is not None and previous is not None:
                    assert seq == previous, f"span {span.span_id} resent: sequence id {seq}, first {previous}"
                continue
            stored += 1
            in_batch[key] = seq
            if seq is not None:
                assert seq > 0, f"span {span.span_id} got sequence id {seq}"
                assert seq not in model.used, (
                    f"span {span.span_id} got sequence id {seq}, already used in attempt {key[0]}"
                )
                if span.sequence_id:
                    assert seq == span.sequence_id, (
                        f"client-numbered span got {seq}, asked {span.sequence_id}"
                    )
                else:
                    assert seq > model.floor, f"store-numbered span got {seq}, not above {model.floor}"
                model.used.add(seq)
                model.floor = max(model.floor, seq)
            else:
                model.complete = False
            model.spans[span.span_id] = SpanModel(seq, span_identity_bytes(span))
        return stored, duplicate

    @rule(data=st.data())
    @guarded
    def add_spans(self, data: st.DataObject) -> None:
        rid, aid, spans, problem, lenient = self.span_batch(data)
        request = pb.AddSpansRequest(rollout_id=rid, attempt_id=aid, spans=spans)
        expect = one(problem) | lenient
        reply = self.h.call(
            "AddSpans", request, expect, reason="SPAN_TOO_LARGE" if problem == EXHAUSTED else None
        )
        if not reply.ok:
            return
        resp = reply.response
        assert len(resp.sequence_ids) == len(spans), "AddSpans answered another number of sequence ids"
        stored, duplicate = self.record_spans(spans, aid, list(resp.sequence_ids))
        assert (resp.stored_count, resp.duplicate_count) == (stored, duplicate), (
            f"AddSpans counted {resp.stored_count}+{resp.duplicate_count}, expected {stored}+{duplicate}"
        )

    @rule(data=st.data())
    @guarded
    def add_spans_stream(self, data: st.DataObject) -> None:
        # Acknowledgements on the stream do not say which sequence ids were used: the store numbers
        # every span here, so that what a batch may collide with stays known.
        count = data.draw(st.integers(1, 3), label="batches")
        batches = [self.span_batch(data, client_numbered=False) for _ in range(count)]
        if any(lenient for *_, lenient in batches):
            return
        requests = [
            pb.AddSpansStreamRequest(batch_id=100 + i, rollout_id=rid, attempt_id=aid, spans=spans)
            for i, (rid, aid, spans, _, _) in enumerate(batches)
        ]
        context = f"AddSpansStream({len(requests)} batches)"
        if self.h.failure is not None:
            return
        self.h.generated += 1
        try:
            acks = list(self.h.stub.AddSpansStream(iter(requests), timeout=CALL_TIMEOUT))
        except grpc.RpcError as exc:
            self.h.stream_refusal(exc, context, [])  # the stream itself must end OK
            return
        self.h.recent.append(f"{context} -> OK, {len(acks)} acks")
        assert [a.batch_id for a in acks] == [r.batch_id for r in requests], "acks out of order or missing"
        for ack, (_, aid, spans, problem, _) in zip(acks, batches, strict=True):
            if ack.HasField("error"):
                self.h.codes[CODE_NAMES.get(ack.error.code, str(ack.error.code))] += 1
            if problem is not None:
                assert ack.HasField("error"), f"batch with a {problem} problem was acknowledged: {ack}"
                assert grpc.StatusCode[problem].value[0] == ack.error.code, (
                    f"batch error {ack.error}, not {problem}"
                )
                assert ack.error.reason and "Traceback" not in ack.error.message, f"batch error {ack.error}"
                assert ack.stored_count == 0, "a refused batch stored spans"
                continue
            assert not ack.HasField("error"), f"valid batch refused: {ack.error}"
            stored, duplicate = self.record_spans(spans, aid, None)
            assert (ack.stored_count, ack.duplicate_count) == (stored, duplicate), (
                f"stream ack counted {ack.stored_count}+{ack.duplicate_count}, expected {stored}+{duplicate}"
            )

    def draw_selector(self, data: st.DataObject) -> tuple[pb.SpanSelector, str | None]:
        rid, problem = self.draw_rollout_ref(data)
        selector = pb.SpanSelector(rollout_id=rid)
        which = data.draw(st.sampled_from(["", "", "latest", "attempt", "attempt", "weird"]), label="attempt")
        if which == "latest":
            selector.attempt_id = "latest"
        elif which == "attempt":
            attempts = self.h.rollouts[rid].attempts if problem is None else []
            selector.attempt_id = pick(data, attempts, "attempt") or ""
        elif which == "weird":
            selector.attempt_id = data.draw(weird_ids, label="weird attempt")
            if problem is None and selector.attempt_id and selector.attempt_id != "latest":
                problem = self.attempt_problem(rid, selector.attempt_id)
        selector.trace_id = data.draw(st.sampled_from(["", "", TRACE_ID, "x"]), label="trace_id")
        selector.name_contains = data.draw(st.sampled_from(["", "", "n", "ü"]))
        return selector, problem

    @rule(data=st.data())
    @guarded
    def list_spans(self, data: st.DataObject) -> None:
        selector, problem = self.draw_selector(data)
        request = pb.ListSpansRequest(selector=selector)
        paging = self.draw_page(data, request, self.sloppy(data))
        reply = self.h.call("ListSpans", request, combine(one(problem), paging))
        if reply.ok:
            spans = reply.response.spans
            assert len(spans) <= min(request.page_size or 1000, 10_000)
            keys = [(s.attempt_id, s.span_id) for s in spans]
            assert len(set(keys)) == len(keys), "ListSpans listed a span twice"
            for span in spans:
                assert span.rollout_id == selector.rollout_id and span.sequence_id > 0, f"odd span {span}"
            self.h.remember_token(reply.response.next_page_token)

    @rule(data=st.data())
    @guarded
    def tail_spans(self, data: st.DataObject) -> None:
        selector, problem = self.draw_selector(data)
        context = f"TailSpans({describe(selector)})"
        if self.h.failure is not None:
            return
        self.h.generated += 1
        try:
            batches = list(
                self.h.stub.TailSpans(pb.TailSpansRequest(selector=selector), timeout=CALL_TIMEOUT)
            )
        except grpc.RpcError as exc:
            self.h.stream_refusal(exc, context, {problem} if problem else [])
            return
        self.h.recent.append(f"{context} -> OK")
        assert problem is None, f"{context} streamed, expected {problem}"
        for batch in batches:
            for span in batch.spans:
                assert span.rollout_id == selector.rollout_id and span.sequence_id > 0

    @rule(data=st.data())
    @guarded
    def reserve_sequence_ids(self, data: st.DataObject) -> None:
        rid, aid, problem = self.draw_attempt_ref(data)
        count = data.draw(
            st.sampled_from([0, 1, 5, 1_000_000, 1_000_001, -1, INT32_MAX, INT32_MIN]), label="count"
        )
        if problem is None and not 0 <= count <= 1_000_000:
            problem = INVALID
        if (
            problem is None
            and aid in self.h.attempts
            and self.h.attempts[aid].floor + 1 + max(1, count) > 2**62
        ):
            problem = EXHAUSTED  # a client numbered a span 2**62: the attempt's ids are used up
        request = pb.GetNextSpanSequenceIdRequest(rollout_id=rid, attempt_id=aid, count=count)
        reply = self.h.call("GetNextSpanSequenceId", request, {problem} if problem else {OK})
        if reply.ok:
            model = self.h.attempts[aid]
            first = reply.response.sequence_id
            assert first > model.floor, f"reserved ids start at {first}, not above {model.floor}"
            model.floor = first + max(1, count) - 1

    # ------------------------------------------------------------ resources and workers
    def draw_resources(self, data: st.DataObject, into: Any, sloppy: bool) -> str | None:
        problems: dict[str, str | None] = {}
        for _ in range(data.draw(st.integers(0, 3), label="resources")):
            name = self.either(
                data,
                sloppy,
                st.sampled_from(["llm", "prompt", "data"]) | short_texts.filter(bool),
                BAD_NAMES,
                "name",
            )
            kind = self.either(
                data,
                sloppy,
                st.sampled_from(["llm", "prompt", "json"]),
                st.sampled_from(["bad engine", "no endpoint", "unset"]),
                "kind",
            )
            resource = into[name]
            resource.Clear()
            problem = None
            if kind == "llm":
                resource.llm.endpoint = "http://127.0.0.1:8000/v1"
                resource.llm.model = data.draw(small_texts, label="model")
            elif kind == "prompt":
                resource.prompt_template.template = data.draw(small_texts, label="template")
                resource.prompt_template.engine = data.draw(st.sampled_from(["", "f-string", "jinja"]))
            elif kind == "json":
                to_value(data.draw(json_values, label="json"), resource.json)
            elif kind == "bad engine":
                resource.prompt_template.engine = data.draw(st.sampled_from(["mustache", "JINJA", "ü"]))
                problem = INVALID
            elif kind == "no endpoint":
                resource.llm.model = "m"
                problem = INVALID
            else:
                problem = INVALID
            if not name or len(name) > 256:
                problem = INVALID
            problems[name] = problem
        return next((p for p in problems.values() if p), None)

    @rule(data=st.data())
    @guarded
    def add_resources(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        request = pb.AddResourcesRequest()
        problem = self.draw_resources(data, request.resources, sloppy)
        choice = self.either(
            data, sloppy, st.sampled_from(["fresh", "fresh", "generated", "existing"]), st.just("weird"), "id"
        )
        if choice == "fresh":
            request.resources_id = self.h.next_id("rs")
        elif choice == "existing":
            request.resources_id = pick(data, list(self.h.resources), "existing resources") or ""
        elif choice == "weird":
            request.resources_id = data.draw(weird_ids, label="weird resources id")
        if request.resources_id and not ID_SYNTAX.fullmatch(request.resources_id):
            problem = problem or INVALID
        body = bytes(request.SerializeToString(deterministic=True))
        if problem is not None:
            expect = {problem}
        elif request.resources_id in self.h.resources:
            version, first = self.h.resources[request.resources_id]
            expect = {OK, EXISTS} if version == 1 and first != body else ({OK} if version == 1 else {EXISTS})
        else:
            expect = {OK}
        reply = self.h.call("AddResources", request, expect)
        if reply.ok:
            update = reply.response.resources
            assert update.version >= 1 and (
                not request.resources_id or update.resources_id == request.resources_id
            )
            self.h.resources.setdefault(update.resources_id, (update.version, body))

    @rule(data=st.data())
    @guarded
    def update_resources(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        request = pb.UpdateResourcesRequest()
        problem = self.draw_resources(data, request.resources, sloppy)
        known_first = data.draw(st.integers(0, 5), label="known id?") > 0
        known_id = pick(data, list(self.h.resources), "resources")
        weird = data.draw(weird_ids, label="weird resources id")
        request.resources_id = known_id if known_first and known_id else weird
        known = self.h.resources.get(request.resources_id)
        lookup = INVALID if not request.resources_id else (NOT_FOUND if known is None else None)
        version = known[0] if known else 1
        request.expected_version = self.either(
            data,
            sloppy,
            st.sampled_from([0, 0, version, version, version + 1]),
            st.sampled_from([version - 1, -1, INT64_MAX, -(2**63)]),
            "expected_version",
        )
        expected = request.expected_version
        expect = combine(
            one(problem),
            one(lookup),
            {INVALID} if expected < 0 else ({OK} if expected in (0, version) or lookup else {ABORTED}),
        )
        reply = self.h.call(
            "UpdateResources",
            request,
            expect,
            reason="RESOURCES_VERSION_MISMATCH" if expect == {ABORTED} else None,
        )
        if reply.ok:
            assert known is not None
            assert reply.response.resources.version == version + 1, "UpdateResources did not add one version"
            self.h.resources[request.resources_id] = (version + 1, known[1])

    @rule(data=st.data())
    @guarded
    def read_resources(self, data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(["GetResources", "GetLatestResources", "ListResources"]))
        if method == "GetResources":
            known_first = data.draw(st.booleans(), label="known id?")
            known_id = pick(data, list(self.h.resources), "resources")
            weird = data.draw(weird_ids, label="weird resources id")
            rid = known_id if known_first and known_id else weird
            problem = INVALID if not rid else (None if rid in self.h.resources else NOT_FOUND)
            reply = self.h.call(
                "GetResources", pb.GetResourcesRequest(resources_id=rid), {problem} if problem else {OK}
            )
            if reply.ok:
                assert reply.response.resources.version == self.h.resources[rid][0]
        elif method == "GetLatestResources":
            reply = self.h.call("GetLatestResources", pb.GetLatestResourcesRequest(), {OK})
            assert reply.response.HasField("resources") == bool(self.h.resources)
        else:
            request = pb.ListResourcesRequest(
                resources_id_contains=data.draw(st.sampled_from(["", "rs", "ü"]))
            )
            request.order = data.draw(ORDERS, label="order")
            reply = self.h.call("ListResources", request, self.draw_page(data, request, self.sloppy(data)))
            if reply.ok:
                self.h.remember_token(reply.response.next_page_token)

    @rule(data=st.data())
    @guarded
    def heartbeat_worker(self, data: st.DataObject) -> None:
        sloppy = self.sloppy(data)
        fresh = data.draw(st.booleans(), label="fresh worker?")
        worker = self.h.next_id("wk") if fresh else self.draw_worker(data, sloppy)[0]
        request = pb.HeartbeatWorkerRequest(worker_id=worker)
        stats = None
        if data.draw(st.booleans(), label="stats?"):
            stats = data.draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
            if sloppy and data.draw(st.integers(0, 3), label="non-finite?") == 0:
                stats["gpu"] = math.inf
            to_struct(stats, request.heartbeat_stats)
        if not worker or not ID_SYNTAX.fullmatch(worker):
            expect = {INVALID}
        else:
            expect = {OK} if stats is None or is_finite_json(stats) else {OK, INVALID}
        reply = self.h.call(
            "HeartbeatWorker",
            request,
            expect,
            field="worker_id" if not worker and (stats is None or is_finite_json(stats)) else None,
        )
        if reply.ok:
            assert reply.response.worker.worker_id == worker
            if stats is not None:
                got = {k: from_value(v) for k, v in reply.response.worker.heartbeat_stats.fields.items()}
                sent = {k: from_value(v) for k, v in request.heartbeat_stats.fields.items()}
                assert got == sent, f"heartbeat stats {got!r} != {sent!r}"
            self.h.workers.add(worker)
        elif fresh and expect != {INVALID}:
            self.h.call("GetWorker", pb.GetWorkerRequest(worker_id=worker), {NOT_FOUND})

    @rule(data=st.data())
    @guarded
    def read_workers(self, data: st.DataObject) -> None:
        if data.draw(st.booleans(), label="get?"):
            known_first = data.draw(st.booleans(), label="known worker?")
            known = pick(data, sorted(self.h.workers), "worker")
            weird = data.draw(weird_ids, label="weird worker")
            worker = known if known_first and known else weird
            expect = {INVALID} if not worker else ({OK} if worker in self.h.workers else {OK, NOT_FOUND})
            self.h.call("GetWorker", pb.GetWorkerRequest(worker_id=worker), expect)
            return
        sloppy = self.sloppy(data)
        request = pb.ListWorkersRequest(
            worker_id_contains=data.draw(st.sampled_from(["", "worker", "wk-", "ü"]), label="contains")
        )
        statuses = self.either(
            data,
            sloppy,
            st.lists(st.sampled_from([1, 2, 3]), max_size=2),
            st.lists(st.sampled_from([0, *BAD_ENUM_NUMBERS]), min_size=1, max_size=2),
            "statuses",
        )
        request.statuses.extend(statuses)
        expect = combine(status_filter_codes(statuses, {1, 2, 3}), self.draw_page(data, request, sloppy))
        reply = self.h.call("ListWorkers", request, expect)
        if reply.ok:
            for worker_pb in reply.response.workers:
                assert not statuses or worker_pb.status in statuses
            self.h.remember_token(reply.response.next_page_token)

    # ------------------------------------------------------------ waiting and watching
    @rule(data=st.data())
    @guarded
    def wait_for_rollouts(self, data: st.DataObject) -> None:
        refs = [self.draw_rollout_ref(data) for _ in range(data.draw(st.integers(0, 3), label="ids"))]
        request = pb.WaitForRolloutsRequest(rollout_ids=[rid for rid, _ in refs])
        bad_wait = data.draw(st.integers(0, 5)) == 0
        if bad_wait:
            request.timeout.seconds, request.timeout.nanos = data.draw(st.sampled_from(BAD_WAITS))
        else:
            self.draw_duration(data, SHORT_WAITS, request.timeout, "timeout")
        expect = combine(*(one(p) for _, p in refs), {INVALID} if bad_wait else {OK})
        reply = self.h.call("WaitForRollouts", request, expect, timeout=None if bad_wait else CALL_TIMEOUT)
        if reply.ok:
            finished = [r.rollout_id for r in reply.response.rollouts]
            wanted = list(dict.fromkeys(request.rollout_ids))
            assert finished == [rid for rid in wanted if rid in finished], (
                "WaitForRollouts broke request order"
            )
            for rollout in reply.response.rollouts:
                self.h.observe_rollout(rollout)
                assert rollout.status in TERMINAL_ROLLOUT, f"WaitForRollouts returned unfinished {rollout}"

    @rule(data=st.data())
    @guarded
    def watch_rollouts(self, data: st.DataObject) -> None:
        request = pb.WatchRolloutsRequest()
        choice = data.draw(st.sampled_from(["now", "now", "real", "tampered", "garbage"]), label="token")
        token = {OK}
        if choice == "real":
            request.resume_token = pick(data, self.h.resume_tokens, "real token") or ""
            token = {OK, OUT_OF_RANGE}
        elif choice == "tampered":
            suffix = data.draw(st.sampled_from(RESUME_SUFFIXES) | st.text(max_size=6), label="revision")
            request.resume_token = f"{self.h.store_id or 'unknown'}.{suffix}"
            token = {OK, INVALID, OUT_OF_RANGE}
        elif choice == "garbage":
            request.resume_token = data.draw(weird_ids | st.sampled_from(["x.1", ".1", "1", "a.b.c"]))
            token = {INVALID, OUT_OF_RANGE} if request.resume_token else {OK}
        statuses = data.draw(st.lists(st.sampled_from([1, 5, 7, 0, 99]), max_size=2), label="statuses")
        request.statuses.extend(statuses)  # type: ignore[arg-type]
        # (the shortest intervals the store takes; shorter ones are refused, see tests/server/test_hardening.py)
        interval = data.draw(
            st.sampled_from([None, (1, 0), (0, 100_000_000), (3601, 0), (-1, 0)]), label="interval"
        )
        if interval is not None:
            request.progress_interval.seconds, request.progress_interval.nanos = interval
        expect = combine(
            token,
            status_filter_codes(statuses, ROLLOUT_STATUS_NAMES),
            {INVALID} if interval is not None and not 0 <= duration_seconds(*interval) <= 3600 else {OK},
        )
        context = f"WatchRollouts({describe(request)})"
        if self.h.failure is not None:
            return
        self.h.generated += 1
        call = self.h.stub.WatchRollouts(request, timeout=CALL_TIMEOUT)
        try:
            first = next(call)
        except grpc.RpcError as exc:
            self.h.stream_refusal(exc, context, expect)
            return
        except StopIteration:
            raise AssertionError(f"{context} ended without a first message") from None
        finally:
            call.cancel()
        self.h.recent.append(f"{context} -> OK")
        assert OK in expect, f"{context} streamed, expected {sorted(expect)}{self.h.context()}"
        store_id, _, revision = first.resume_token.rpartition(".")
        assert store_id and revision.isdigit(), f"odd resume token {first.resume_token!r}"
        self.h.store_id = store_id
        if len(self.h.resume_tokens) < 50:
            self.h.resume_tokens.append(first.resume_token)

    # ------------------------------------------------------------ deleting and counting
    @rule(data=st.data())
    @guarded
    def delete_rollouts(self, data: st.DataObject) -> None:
        refs = [self.draw_rollout_ref(data) for _ in range(data.draw(st.integers(0, 3), label="ids"))]
        request = pb.DeleteRolloutsRequest(rollout_ids=[rid for rid, _ in refs])
        when = data.draw(st.sampled_from(["none"] * 6 + ["past", "recent"]), label="finished_before")
        cutoff = 0.0
        if when == "past":
            request.finished_before.seconds = data.draw(st.sampled_from([-62_135_596_800, -1, 0, 1_000]))
        elif when == "recent":  # what finished more than a few seconds ago
            cutoff = time.time() - 4.0
            request.finished_before.seconds = int(cutoff)
            request.finished_before.nanos = int((cutoff - int(cutoff)) * 1e9)
            cutoff = request.finished_before.seconds + request.finished_before.nanos / 1e9
        possible: set[str] = set()
        definite: str | None = None
        for rid, problem in {rid: p for rid, p in refs}.items():
            if problem is not None:
                definite = problem
                break
            if self.h.rollouts[rid].terminal is None:
                possible.add(PRECONDITION)  # unfinished, unless the watchdog finished it
        expect = possible | one(definite)
        if not refs and when == "none":
            expect = {INVALID}
        reply = self.h.call("DeleteRollouts", request, expect)
        if not reply.ok:
            return
        for rid in request.rollout_ids:
            self.h.forget(rid)
        assert reply.response.deleted_rollouts >= len(set(request.rollout_ids))
        if when == "recent":
            self.resync_after_bulk_delete(cutoff)

    def resync_after_bulk_delete(self, cutoff: float) -> None:
        """After deleting what finished before ``cutoff``, only later or unfinished rollouts are left."""
        remaining = {r.rollout_id: r for r in self.list_all_rollouts(check=False)}
        for rid in list(self.h.rollouts):
            if rid not in remaining:
                self.h.forget(rid)
        for rollout in remaining.values():
            ended = rollout.end_time.seconds + rollout.end_time.nanos / 1e9
            assert rollout.status not in TERMINAL_ROLLOUT or ended >= cutoff - 1e-6, (
                f"{rollout.rollout_id} finished at {ended}, before {cutoff}, and survived the delete"
            )

    @rule()
    @guarded
    def statistics(self) -> None:
        stats = self.h.call("GetStatistics", pb.GetStatisticsRequest(), {OK}).response
        assert stats.backend == self.h.backend
        assert sum(stats.rollouts_by_status.values()) == stats.total_rollouts
        assert stats.total_rollouts >= len(self.h.rollouts)
        assert 0 <= stats.queue_length <= stats.total_rollouts
        assert stats.total_spans >= sum(len(a.spans) for a in self.h.attempts.values())

    @rule(data=st.data())
    @guarded
    def check_rollouts(self, data: st.DataObject) -> None:
        indexes = data.draw(st.lists(INDEXES, min_size=1, max_size=3), label="rollouts")
        live = list(self.h.rollouts)
        chosen = {live[i % len(live)] for i in indexes} if live else set()
        for rid in sorted(chosen):
            check_one_rollout(self.h, self.get_rollout(rid, {OK}), check=False)

    def list_all_rollouts(self, *, check: bool) -> list[rollout_pb2.Rollout]:
        return list_all_rollouts(self.h, check=check)

    def list_all_attempts(self, rollout_id: str, *, check: bool) -> list[rollout_pb2.Attempt]:
        return list_all_attempts(self.h, rollout_id, check=check)

    def teardown(self) -> None:
        if self.h.failure is None:
            try:
                self.h.check_health()
            except Exception as exc:
                self.h.failure = f"unhealthy after an example: {exc}{self.h.context()}"


# ====================================================================== store-wide invariants


def list_all_rollouts(h: Harness, *, check: bool = True) -> list[rollout_pb2.Rollout]:
    out: list[rollout_pb2.Rollout] = []
    token = ""
    while True:
        request = pb.ListRolloutsRequest(page_size=500, page_token=token)
        resp = h.call("ListRollouts", request, {OK}, check=check).response
        out.extend(resp.rollouts)
        token = resp.next_page_token
        if not token:
            return out


def list_all_attempts(h: Harness, rollout_id: str, *, check: bool = True) -> list[rollout_pb2.Attempt]:
    out: list[rollout_pb2.Attempt] = []
    token = ""
    while True:
        request = pb.ListAttemptsRequest(rollout_id=rollout_id, page_size=1000, page_token=token)
        resp = h.call("ListAttempts", request, {OK}, check=check).response
        out.extend(resp.attempts)
        token = resp.next_page_token
        if not token:
            return out


def list_all_spans(h: Harness, rollout_id: str, *, check: bool = True) -> list[span_pb2.Span]:
    out: list[span_pb2.Span] = []
    token = ""
    while True:
        request = pb.ListSpansRequest(
            selector=pb.SpanSelector(rollout_id=rollout_id), page_size=10_000, page_token=token
        )
        resp = h.call("ListSpans", request, {OK}, check=check).response
        out.extend(resp.spans)
        token = resp.next_page_token
        if not token:
            return out


def check_one_rollout(
    h: Harness, rollout: rollout_pb2.Rollout | None, *, check: bool = True
) -> tuple[list[rollout_pb2.Attempt], list[span_pb2.Span]]:
    """Attempts and spans of one rollout against each other, its snapshot and the model."""
    assert rollout is not None
    rid = rollout.rollout_id
    h.observe_rollout(rollout)
    attempts = list_all_attempts(h, rid, check=check)
    for attempt in attempts:
        h.observe_attempt(attempt, rid)
    numbers = [a.sequence_number for a in attempts]
    assert numbers == list(range(1, len(attempts) + 1)), f"{rid}: attempt numbers {numbers}"
    assert len(attempts) >= rollout.attempt_count, (
        f"{rid}: {len(attempts)} attempts, counted {rollout.attempt_count}"
    )
    active = [a for a in attempts if a.status in ACTIVE_ATTEMPT]
    assert len(active) <= 1, f"{rid} has {len(active)} active attempts"
    if active:
        assert active[0].attempt_id == attempts[-1].attempt_id, f"{rid}: the active attempt is not the latest"
    if rollout.HasField("latest_attempt"):
        ids = [a.attempt_id for a in attempts]
        assert rollout.latest_attempt.attempt_id in ids, f"{rid}: latest attempt not listed"
    spans = list_all_spans(h, rid, check=check)
    attempt_ids = {a.attempt_id for a in attempts}
    per_attempt: dict[str, list[span_pb2.Span]] = collections.defaultdict(list)
    for span in spans:
        assert span.rollout_id == rid, f"span {span.span_id} of {span.rollout_id} listed under {rid}"
        assert span.attempt_id in attempt_ids, f"span {span.span_id} of unknown attempt {span.attempt_id}"
        per_attempt[span.attempt_id].append(span)
    for aid, group in per_attempt.items():
        seqs = [s.sequence_id for s in group]
        assert all(s > 0 for s in seqs), f"attempt {aid}: sequence ids {seqs} not all positive"
        assert len(set(seqs)) == len(seqs), f"attempt {aid}: duplicate sequence ids {sorted(seqs)}"
        assert seqs == sorted(seqs), f"attempt {aid}: spans not in sequence order"
        span_ids = [s.span_id for s in group]
        assert len(set(span_ids)) == len(span_ids), f"attempt {aid}: a span id stored twice"
    if rid in h.rollouts:
        for aid in attempt_ids:
            model = h.attempts.get(aid)
            stored = {s.span_id: s for s in per_attempt.get(aid, [])}
            expected = model.spans if model is not None else {}
            assert set(stored) == set(expected), (
                f"attempt {aid}: stored spans differ from acknowledged ones: "
                f"extra {sorted(set(stored) - set(expected))[:5]}, missing {sorted(set(expected) - set(stored))[:5]}"
            )
            for span_id, span in stored.items():
                known = expected[span_id]
                if known.sequence_id is not None:
                    assert span.sequence_id == known.sequence_id, (
                        f"span {span_id} moved to {span.sequence_id}"
                    )
                assert span_identity_bytes(span) == known.body, f"span {span_id} came back changed"
    return attempts, spans


def check_store(h: Harness) -> dict[str, Any]:
    """Every invariant of the quiet store; returns a snapshot of it to compare across a restart."""
    time.sleep(0.3)  # the last tiny deadlines fire; longer ones are hours away
    before = h.call("GetStatistics", pb.GetStatisticsRequest(), {OK}, check=True).response
    rollouts = list_all_rollouts(h)
    ids = [r.rollout_id for r in rollouts]
    assert len(set(ids)) == len(ids), "ListRollouts listed a rollout twice"
    missing = set(h.rollouts) - set(ids)
    assert not missing, f"acknowledged rollouts missing: {sorted(missing)[:5]}"
    unknown = set(ids) - set(h.rollouts)
    assert not unknown, f"rollouts that no acknowledged request created: {sorted(unknown)[:5]}"
    assert not set(ids) & h.deleted, "a deleted rollout exists again"
    snapshot: dict[str, Any] = {"rollouts": {}, "attempts": {}, "spans": {}}
    total_attempts = total_spans = 0
    for rollout in rollouts:
        attempts, spans = check_one_rollout(h, rollout)
        if rollout.status in QUEUED_ROLLOUT:
            assert all(a.status not in ACTIVE_ATTEMPT for a in attempts), (
                f"queued {rollout.rollout_id} is running"
            )
        total_attempts += len(attempts)
        total_spans += len(spans)
        snapshot["rollouts"][rollout.rollout_id] = rollout.SerializeToString(deterministic=True)
        snapshot["attempts"][rollout.rollout_id] = [a.SerializeToString(deterministic=True) for a in attempts]
        snapshot["spans"][rollout.rollout_id] = sorted(s.SerializeToString(deterministic=True) for s in spans)
    after = h.call("GetStatistics", pb.GetStatisticsRequest(), {OK}, check=True).response
    for stats in (before, after):
        stats.ClearField("uptime")
    assert before == after, f"the store changed while it should be quiet:\n{before}\n{after}"
    by_status = collections.Counter(ROLLOUT_STATUS_NAMES[r.status] for r in rollouts)
    assert dict(after.rollouts_by_status) == dict(by_status), f"{after.rollouts_by_status} != {by_status}"
    assert after.total_rollouts == len(rollouts)
    assert after.total_attempts == total_attempts, (
        f"total_attempts {after.total_attempts} != {total_attempts}"
    )
    assert after.total_spans == total_spans, f"total_spans {after.total_spans} != {total_spans}"
    queued = sum(1 for r in rollouts if r.status in QUEUED_ROLLOUT)
    assert after.queue_length == queued, f"queue_length {after.queue_length} != {queued} queued rollouts"
    snapshot["statistics"] = after.SerializeToString(deterministic=True)
    workers = h.call("ListWorkers", pb.ListWorkersRequest(page_size=1000), {OK}, check=True).response
    snapshot["workers"] = sorted(w.SerializeToString(deterministic=True) for w in workers.workers)
    resources = h.call("ListResources", pb.ListResourcesRequest(page_size=1000), {OK}, check=True).response
    snapshot["resources"] = sorted(r.SerializeToString(deterministic=True) for r in resources.resources)
    h.check_health()
    return snapshot


# ====================================================================== the fuzz test

FUZZ_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
    print_blob=False,
)


def start_fuzz_server(server_process: type[ServerProcess], backend: str, db: Path) -> ServerProcess:
    where = ["--memory"] if backend == "memory" else ["--db", str(db)]
    args = ["--port", "0", *where, "--max-span-size", "4KiB", "--grace", "2", "--log-level", "INFO"]
    return server_process(*args).start()


@pytest.mark.timeout(170)
@pytest.mark.parametrize("store_backend", ["memory", "sqlite"])
def test_generated_traffic_keeps_the_store_sound(
    store_backend: str, tmp_path: Path, server_process: type[ServerProcess]
) -> None:
    db = tmp_path / "fuzz.db"
    harness = Harness(start_fuzz_server(server_process, store_backend, db), store_backend)
    machine = type("StoreFuzzer", (StoreFuzzer,), {"harness": harness})
    try:
        run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)
        if harness.failure is not None:
            pytest.fail(harness.failure, pytrace=False)
        assert harness.generated >= MIN_GENERATED_REQUESTS, f"only {harness.generated} generated requests"
        refused = sum(n for code, n in harness.codes.items() if code != OK)
        assert refused >= harness.generated // 8, f"too little bad input reached the server: {harness.codes}"
        assert harness.codes[OK] >= harness.generated // 4, f"too little valid traffic: {harness.codes}"
        reached = {code for code, n in harness.codes.items() if n}
        # The store answered with most of what it can say, illegal transitions and oversize spans included.
        assert {OK, NOT_FOUND, INVALID, PRECONDITION, EXHAUSTED} <= reached and len(reached) >= 6, (
            harness.codes
        )
        assert harness.created >= 50, f"the fuzz created only {harness.created} rollouts"
        snapshot = check_store(harness)
        if store_backend == "sqlite":
            assert harness.server.terminate() == 0, f"unclean exit:\n{harness.log_tail()}"
            harness.close()
            harness.server = start_fuzz_server(server_process, store_backend, db)
            harness.connect()
            reopened = check_store(harness)
            for part in ("rollouts", "attempts", "spans", "workers", "resources"):
                assert reopened[part] == snapshot[part], f"{part} differ after a restart on the same file"
    finally:
        harness.close()


# ====================================================================== boundary cases, one by one


def plain_span(span_id: str, sequence_id: int = 0) -> span_pb2.Span:
    return span_pb2.Span(
        span_id=span_id, trace_id="4bf92f3577b34da6a3ce929d0e0e4736", name="s", sequence_id=sequence_id
    )


async def test_span_size_limit_is_exact(stub: Any) -> None:
    aid = await started_attempt(stub, "ro-size")
    at_limit = pad_span(plain_span("00000000000000a1"), MAX_SPAN_BYTES)
    over = pad_span(plain_span("00000000000000a2"), MAX_SPAN_BYTES + 1)
    code, _ = await outcome(
        stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-size", attempt_id=aid, spans=[at_limit]))
    )
    assert code == OK
    request = pb.AddSpansRequest(
        rollout_id="ro-size", attempt_id=aid, spans=[plain_span("00000000000000a3"), over]
    )
    code, info = await outcome(stub.AddSpans(request))
    assert (code, info.reason) == (EXHAUSTED, "SPAN_TOO_LARGE")
    listed = await stub.ListSpans(pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-size")))
    assert [s.span_id for s in listed.spans] == ["00000000000000a1"], "a refused batch stored part of itself"


async def test_largest_duration_is_refused_or_served_back(stub: Any) -> None:
    """A config deadline of int64-max seconds: refuse it, or store and serve it; never poison reads."""
    spec = pb.RolloutSpec(rollout_id="ro-forever")
    spec.config.timeout.seconds = INT64_MAX
    created, _ = await outcome(stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[spec])))
    later, _ = await outcome(stub.GetRollout(pb.GetRolloutRequest(rollout_id="ro-forever")))
    listed, _ = await outcome(stub.ListRollouts(pb.ListRolloutsRequest()))
    assert (created, later, listed) in ((OK, OK, OK), (INVALID, NOT_FOUND, OK)), (
        f"EnqueueRollouts {created}, then GetRollout {later} and ListRollouts {listed}"
    )


async def test_non_finite_json_numbers_are_refused_without_side_effects(stub: Any) -> None:
    """JSON has no NaN or infinity: a request carrying one is refused and changes nothing (or is
    stored and served back). Either way every later read keeps working."""
    failures: list[str] = []

    def expect_pair(what: str, write: str, read: str) -> None:
        if (write, read) not in ((OK, OK), (INVALID, NOT_FOUND)):
            failures.append(f"{what}: the write answered {write}, then the read {read}")

    for where, value in (("input", [1, math.nan]), ("metadata", {"x": math.inf})):
        spec = pb.RolloutSpec(rollout_id=f"ro-nan-{where}")
        if where == "input":
            to_value(value, spec.input)
        else:
            to_struct(value, spec.metadata)  # type: ignore[arg-type]
        write, _ = await outcome(stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[spec])))
        read, _ = await outcome(stub.GetRollout(pb.GetRolloutRequest(rollout_id=spec.rollout_id)))
        expect_pair(f"EnqueueRollouts with a non-finite {where}", write, read)

    aid = await started_attempt(stub, "ro-nan-complete")
    report = pb.CompleteAttemptRequest(rollout_id="ro-nan-complete", attempt_id=aid, status=ATTEMPT_SUCCEEDED)  # type: ignore[arg-type]
    to_struct({"score": math.nan}, report.metadata)
    write, _ = await outcome(stub.CompleteAttempt(report))
    read, rollout = await outcome(stub.GetRollout(pb.GetRolloutRequest(rollout_id="ro-nan-complete")))
    if read != OK:
        failures.append(
            f"CompleteAttempt with NaN metadata answered {write}; GetRollout then fails with {read}"
        )
    elif write != OK and rollout.rollout.status == ROLLOUT_SUCCEEDED:
        failures.append(f"CompleteAttempt with NaN metadata answered {write}, yet the rollout SUCCEEDED")

    heartbeat = pb.HeartbeatWorkerRequest(worker_id="wk-nan")
    to_struct({"gpu": math.nan}, heartbeat.heartbeat_stats)
    write, _ = await outcome(stub.HeartbeatWorker(heartbeat))
    read, _ = await outcome(stub.GetWorker(pb.GetWorkerRequest(worker_id="wk-nan")))
    expect_pair("HeartbeatWorker with NaN stats", write, read)

    resources = pb.AddResourcesRequest(resources_id="rs-nan")
    to_value({"lr": math.inf}, resources.resources["cfg"].json)
    write, _ = await outcome(stub.AddResources(resources))
    read, _ = await outcome(stub.GetResources(pb.GetResourcesRequest(resources_id="rs-nan")))
    expect_pair("AddResources with an infinite JSON value", write, read)

    for method, request in [
        ("ListRollouts", pb.ListRolloutsRequest()),
        ("ListWorkers", pb.ListWorkersRequest()),
        ("ListResources", pb.ListResourcesRequest()),
        ("GetLatestResources", pb.GetLatestResourcesRequest()),
    ]:
        code, _ = await outcome(getattr(stub, method)(request))
        if code != OK:
            failures.append(f"{method} (a plain read) now fails with {code}")
    assert not failures, "\n".join(failures)


async def first_token(stub: Any, method: str, request: Any) -> str:
    response = await getattr(stub, method)(request)
    token = str(response.next_page_token)
    assert token, f"{method} gave no next page"
    return token


async def test_tampered_page_tokens_are_refused(stub: Any) -> None:
    """A page token whose position was edited is INVALID_ARGUMENT, or still serves a sane page."""
    spec = pb.RolloutSpec(rollout_id="ro-pages")
    spec.config.max_attempts = 5
    spec.config.retry_on.append(ATTEMPT_FAILED)  # type: ignore[arg-type]
    await stub.EnqueueRollouts(
        pb.EnqueueRolloutsRequest(rollouts=[spec, pb.RolloutSpec(rollout_id="ro-other")])
    )
    for i in range(3):
        rollout = (await stub.StartAttempt(pb.StartAttemptRequest(rollout_id="ro-pages"))).rollout
        aid = rollout.latest_attempt.attempt_id
        done = pb.CompleteAttemptRequest(rollout_id="ro-pages", attempt_id=aid, status=ATTEMPT_FAILED)  # type: ignore[arg-type]
        await stub.CompleteAttempt(done)
        await stub.HeartbeatWorker(pb.HeartbeatWorkerRequest(worker_id=f"wk-{i}"))
        await stub.AddResources(pb.AddResourcesRequest(resources_id=f"rs-{i}"))
    spans = [plain_span(f"{i:016x}") for i in range(1, 4)]
    await stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-pages", attempt_id=aid, spans=spans))
    requests = {
        "ListRollouts": pb.ListRolloutsRequest(page_size=1),
        "ListAttempts": pb.ListAttemptsRequest(rollout_id="ro-pages", page_size=1),
        "ListSpans": pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-pages"), page_size=1),
        "ListResources": pb.ListResourcesRequest(page_size=1),
        "ListWorkers": pb.ListWorkersRequest(page_size=1),
    }
    failures = []
    for method, request in requests.items():
        payload = decode_token(await first_token(stub, method, request))
        for position in ["x", 1.5, [1], {"a": 1}, -2, [10**30, 0], [1, 2**63], [-(2**63), 1], [None], []]:
            payload["p"] = position
            request.page_token = encode_token(payload)
            code, _ = await outcome(getattr(stub, method)(request))
            if code not in (OK, INVALID):
                failures.append(f"{method} with position {position!r}: {code}")
    assert not failures, "\n".join(failures)


async def test_store_and_client_numbered_spans_never_share_a_sequence_id(stub: Any) -> None:
    aid = await started_attempt(stub, "ro-seq")
    first = [plain_span(f"{i:016x}") for i in range(1, 7)]
    await stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-seq", attempt_id=aid, spans=first))
    # The store's next id is 7; this batch asks it for one and also numbers a span 7 itself.
    mixed = [plain_span("00000000000000f0"), plain_span("00000000000000f1", sequence_id=7)]
    code, answer = await outcome(
        stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-seq", attempt_id=aid, spans=mixed))
    )
    assert code in (OK, INVALID), f"AddSpans answered {code}"
    if code == OK:
        assert len(set(answer.sequence_ids)) == 2, f"two spans got sequence ids {list(answer.sequence_ids)}"
    code, listed = await outcome(
        stub.ListSpans(pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-seq")))
    )
    assert code == OK, f"ListSpans answered {code}"
    seqs = [s.sequence_id for s in listed.spans]
    assert len(seqs) == len(set(seqs)), f"duplicate sequence ids in one attempt: {seqs}"
    code, _ = await outcome(stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec()])))
    assert code == OK, f"the store stopped accepting writes: {code}"


async def test_largest_sequence_id_does_not_break_the_store(stub: Any) -> None:
    """A client may number a span 2**63-1; the store may refuse it, but must not break on it."""
    aid = await started_attempt(stub, "ro-max")
    failures = []
    request = pb.AddSpansRequest(rollout_id="ro-max", attempt_id=aid, spans=[plain_span("a" * 16, INT64_MAX)])
    code, _ = await outcome(stub.AddSpans(request))
    if code not in (OK, INVALID, OUT_OF_RANGE, EXHAUSTED):
        failures.append(f"AddSpans with sequence id 2**63-1: {code}")
    after = pb.AddSpansRequest(rollout_id="ro-max", attempt_id=aid, spans=[plain_span("b" * 16)])
    code, _ = await outcome(stub.AddSpans(after))
    if code not in (OK, OUT_OF_RANGE, EXHAUSTED):
        failures.append(f"the next store-numbered span: {code}")
    code, listed = await outcome(
        stub.ListSpans(pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-max")))
    )
    if code != OK or any(s.sequence_id <= 0 for s in listed.spans):
        failures.append(f"ListSpans: {code} {[s.sequence_id for s in listed.spans] if code == OK else ''}")
    reserve = pb.GetNextSpanSequenceIdRequest(rollout_id="ro-max", attempt_id=aid)
    code, _ = await outcome(stub.GetNextSpanSequenceId(reserve))
    if code not in (OK, OUT_OF_RANGE, EXHAUSTED):
        failures.append(f"GetNextSpanSequenceId: {code}")
    code, _ = await outcome(stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec()])))
    if code != OK:
        failures.append(f"an unrelated EnqueueRollouts afterwards: {code}")
    assert not failures, "\n".join(failures)


async def test_tampered_resume_tokens_are_refused(stub: Any) -> None:
    call = stub.WatchRollouts(pb.WatchRolloutsRequest())
    first = await call.read()
    call.cancel()
    store_id = first.resume_token.rpartition(".")[0]
    failures = []
    for revision in ["²", "¹⁰", "Ⅻ", "٣", "-1", "1.5", " 1", "99999999999999999999999"]:
        watch = stub.WatchRollouts(pb.WatchRolloutsRequest(resume_token=f"{store_id}.{revision}"))
        code, _ = await outcome(watch.read())
        watch.cancel()
        if code not in (INVALID, OUT_OF_RANGE):
            failures.append(f"resume token revision {revision!r}: {code}")
    assert not failures, "\n".join(failures)


async def test_refusals_of_huge_ids_keep_their_error_details(stub: Any) -> None:
    """A 20,000-character id is refused with a normal NOT_FOUND and its ErrorInfo: the refusal must
    not echo the id so far that the trailers outgrow what gRPC clients accept (8 KiB by default)."""
    huge = "x" * 20_000
    await started_attempt(stub, "ro-huge")
    requests = {
        "GetRollout": pb.GetRolloutRequest(rollout_id=huge),
        "GetWorker": pb.GetWorkerRequest(worker_id=huge),
        "GetResources": pb.GetResourcesRequest(resources_id=huge),
        "HeartbeatAttempt": pb.HeartbeatAttemptRequest(rollout_id="ro-huge", attempt_id=huge),
        "ListSpans": pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id=huge)),
    }
    failures = []
    for method, request in requests.items():
        code, _ = await outcome(getattr(stub, method)(request))
        if code != NOT_FOUND:
            failures.append(f"{method}: {code}")
    assert not failures, "\n".join(failures)


async def test_span_times_beyond_2_63_nanoseconds_are_kept(stub: Any) -> None:
    """Span times are fixed64: every value up to 2**64 - 1 is valid and must come back unchanged."""
    aid = await started_attempt(stub, "ro-late")
    span = plain_span("00000000000000c1")
    span.start_time_unix_nano, span.end_time_unix_nano = 2**63, 2**64 - 1
    code, _ = await outcome(
        stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-late", attempt_id=aid, spans=[span]))
    )
    assert code == OK, f"AddSpans of a span ending at 2**64-1 ns answered {code}"
    listed = await stub.ListSpans(pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-late")))
    assert [(s.start_time_unix_nano, s.end_time_unix_nano) for s in listed.spans] == [(2**63, 2**64 - 1)]
    code, _ = await outcome(stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec()])))
    assert code == OK, f"the store stopped accepting writes: {code}"
