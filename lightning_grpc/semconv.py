"""Semantic conventions: the one place that names span attributes and spans, and reads and writes them.

Everything a runner, the proxy, OTLP senders or the trainer exchange through span attributes is
named here, written by the ``*_attributes`` functions and read back by the ``read_*`` functions,
so writing and reading cannot drift apart.

Attribution (which rollout attempt a span belongs to) uses :data:`ROLLOUT_ID` and
:data:`ATTEMPT_ID`, on the span, else on its resource (``OTEL_RESOURCE_ATTRIBUTES``), else in the
gRPC metadata of an OTLP export (:data:`ROLLOUT_ID_HEADER`, :data:`ATTEMPT_ID_HEADER`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "lightning"

# ------------------------------------------------------------------ attribution
ROLLOUT_ID = "lightning.rollout_id"
ATTEMPT_ID = "lightning.attempt_id"
#: Attempt metadata key: the agent's exception ({"type", "message", "traceback"}) of a FAILED attempt.
ATTEMPT_ERROR = "error"
SPAN_SEQUENCE_ID = "lightning.span_sequence_id"
ROLLOUT_ID_HEADER = "x-lightning-rollout-id"
ATTEMPT_ID_HEADER = "x-lightning-attempt-id"
#: Attribute names the reference system (Agent Lightning) uses for the same ids; read, never written.
LEGACY_ROLLOUT_ID = "agentlightning.rollout_id"
LEGACY_ATTEMPT_ID = "agentlightning.attempt_id"

# ------------------------------------------------------------------ span names
SPAN_REWARD = "lightning.reward"
SPAN_MESSAGE = "lightning.message"
SPAN_OBJECT = "lightning.object"
SPAN_EXCEPTION = "lightning.exception"
SPAN_ANNOTATION = "lightning.annotation"
SPAN_OPERATION = "lightning.operation"
#: The root span of one attempt: every span the agent makes is under it, in the rollout's trace.
SPAN_ROLLOUT = "lightning.rollout"
ATTEMPT_SEQUENCE_NUMBER = "lightning.attempt.sequence_number"
#: The span the proxy writes for each LLM call.
SPAN_LLM_CALL = "lightning.llm.call"

# ------------------------------------------------------------------ attribute names
REWARD_VALUE = "lightning.reward.value"  # prefix: lightning.reward.value.<dimension> = float
REWARD_PRIMARY = "lightning.reward.primary"  # the name of the primary dimension
MESSAGE_BODY = "lightning.message.body"
OBJECT_TYPE = "lightning.object.type"
OBJECT_JSON = "lightning.object.json"
OBJECT_LITERAL = "lightning.object.literal"
EXCEPTION_TYPE = "exception.type"  # OpenTelemetry's names
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
OPERATION_NAME = "lightning.operation.name"
OPERATION_INPUT = "lightning.operation.input"  # prefix
OPERATION_OUTPUT = "lightning.operation.output"  # prefix
LINK = "lightning.link"  # prefix: lightning.link.<i>.key / .value
TAG = "lightning.tag"  # prefix: lightning.tag.<i>

PRIMARY = "primary"

# Attributes the LLM proxy writes on SPAN_LLM_CALL (read by the trainer).
LLM_PROMPT_TOKEN_IDS = "lightning.llm.prompt_token_ids"
LLM_RESPONSE_TOKEN_IDS = "lightning.llm.response_token_ids"
LLM_RESPONSE_LOGPROBS = "lightning.llm.response_logprobs"
#: Response positions a grammar forced (the only token allowed): not the policy's choice, not trained.
#: An int list of indices into LLM_RESPONSE_TOKEN_IDS, present only when the call had a grammar.
LLM_RESPONSE_FORCED_POSITIONS = "lightning.llm.response_forced_positions"
LLM_MODEL = "lightning.llm.model"
LLM_BACKEND = "lightning.llm.backend"
LLM_POLICY_VERSION = "lightning.llm.policy_version"
LLM_REQUEST = "lightning.llm.request"  # JSON of the request body
LLM_RESPONSE = "lightning.llm.response"  # JSON of the response body
LLM_RESPONSE_ID = "gen_ai.response.id"  # OpenTelemetry GenAI name
LLM_FINISH_REASON = "lightning.llm.finish_reason"
LLM_STREAMED = "lightning.llm.streamed"
LLM_LATENCY_MS = "lightning.llm.latency_ms"
LLM_USAGE_PROMPT_TOKENS = "gen_ai.usage.input_tokens"
LLM_USAGE_COMPLETION_TOKENS = "gen_ai.usage.output_tokens"
LLM_ERROR = "lightning.llm.error"
#: The sampling parameters the engine used for the call, read from the request the proxy sent it (the chat
#: or completions request, whatever the dialect the agent spoke): the request's value, else the engine's
#: default where there is one (OpenAI's, which vLLM and the embedded engine share: temperature 1.0, top_p
#: 1.0); top_k, max_tokens (``max_completion_tokens`` before ``max_tokens``, as the engines read them) and
#: seed only when the request set them. Written by :func:`sampling_attributes`, read by
#: :func:`read_sampling`. Not OpenTelemetry's ``gen_ai.request.*``, which hold what the request set: these
#: name what the engine sampled with, defaults included (the learner computes log-probs at this temperature).
LLM_REQUEST_TEMPERATURE = "lightning.llm.request.temperature"
LLM_REQUEST_TOP_P = "lightning.llm.request.top_p"
LLM_REQUEST_TOP_K = "lightning.llm.request.top_k"
LLM_REQUEST_MAX_TOKENS = "lightning.llm.request.max_tokens"
LLM_REQUEST_SEED = "lightning.llm.request.seed"
#: The engine defaults recorded for a request that does not set temperature / top_p (OpenAI's).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
#: The API shape the agent spoke (one of :data:`LLM_DIALECTS`); LLM_REQUEST and LLM_RESPONSE are always
#: the chat-completions (or completions) request sent to the backend and its answer, whatever the dialect.
LLM_DIALECT = "lightning.llm.dialect"
#: JSON of the request as the agent sent it, when its dialect was translated to chat completions.
LLM_DIALECT_REQUEST = "lightning.llm.dialect_request"
DIALECT_CHAT_COMPLETIONS = "chat_completions"
DIALECT_COMPLETIONS = "completions"
DIALECT_RESPONSES = "responses"  # OpenAI's Responses API
DIALECT_ANTHROPIC_MESSAGES = "anthropic_messages"  # Anthropic's Messages API
LLM_DIALECTS = (DIALECT_CHAT_COMPLETIONS, DIALECT_COMPLETIONS, DIALECT_RESPONSES, DIALECT_ANTHROPIC_MESSAGES)

# The agent a span belongs to (the trainer's adapter reads it from the nearest ancestor of an LLM call).
AGENT_NAME = "lightning.agent.name"
#: The OpenAI Agents SDK's name for the same thing; read, never written.
OPENAI_AGENTS_AGENT_NAME = "agent.name"

#: OpenTelemetry's status code of a span that failed (``Span.status_code``).
STATUS_CODE_ERROR = 2

# ------------------------------------------------------------------ attribution helpers


def attribution(attributes: Mapping[str, Any]) -> tuple[str, str]:
    """(rollout_id, attempt_id) named by a set of attributes ("" when absent)."""
    rid = attributes.get(ROLLOUT_ID) or attributes.get(LEGACY_ROLLOUT_ID) or ""
    aid = attributes.get(ATTEMPT_ID) or attributes.get(LEGACY_ATTEMPT_ID) or ""
    return str(rid), str(aid)


# ------------------------------------------------------------------ rewards


def reward_attributes(reward: float | Mapping[str, float], primary: str | None = None) -> dict[str, Any]:
    """Attributes of a reward: one float per named dimension plus the name of the primary one.

    ``reward`` is a number (one dimension named "primary") or a mapping of dimension -> number;
    with several dimensions ``primary`` names the one training uses.
    """
    if isinstance(reward, Mapping):
        if not reward:
            raise ValueError("a reward needs at least one dimension")
        dims = {str(k): _finite(v, f"reward[{k!r}]") for k, v in reward.items()}
        if primary is None:
            if len(dims) != 1:
                raise ValueError("several reward dimensions need primary= to name the one to train on")
            primary = next(iter(dims))
        if primary not in dims:
            raise ValueError(f"primary {primary!r} is not one of the dimensions {sorted(dims)}")
    else:
        dims = {PRIMARY: _finite(reward, "reward")}
        primary = PRIMARY
    out: dict[str, Any] = {f"{REWARD_VALUE}.{name}": value for name, value in dims.items()}
    out[REWARD_PRIMARY] = primary
    return out


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, not {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite (got {number})")
    return number


def rollout_trace_id(rollout_id: str) -> int:
    """The trace id of a rollout's spans, the same for each of its attempts (128 bits, never 0)."""
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:16], "big") or 1


def read_reward(attributes: Mapping[str, Any]) -> dict[str, float] | None:
    """The reward dimensions carried by a span's attributes, or None when it carries no reward.

    Reads :func:`reward_attributes`' encoding, a plain number under ``lightning.reward`` (one
    dimension, the primary one), and the reference system's encoding
    (``agentlightning.reward.<i>.name/value``, or a plain number under ``agentlightning.reward``).
    """
    for scalar_key in (SPAN_REWARD, "agentlightning.reward"):
        scalar = attributes.get(scalar_key)
        if isinstance(scalar, int | float) and not isinstance(scalar, bool) and math.isfinite(scalar):
            return {PRIMARY: float(scalar)}
    prefix = REWARD_VALUE + "."
    dims = {
        key[len(prefix) :]: float(value)
        for key, value in attributes.items()
        if key.startswith(prefix) and isinstance(value, int | float) and not isinstance(value, bool)
    }
    if dims:
        return dims
    legacy: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        if key.startswith("agentlightning.reward."):
            parts = key.split(".")
            if len(parts) == 4 and parts[2].isdigit():
                legacy.setdefault(int(parts[2]), {})[parts[3]] = value
    ordered = [legacy[i] for i in sorted(legacy) if "name" in legacy[i] and "value" in legacy[i]]
    if ordered:
        return {str(d["name"]): float(d["value"]) for d in ordered}
    return None


def read_primary_reward(attributes: Mapping[str, Any]) -> float | None:
    """The primary reward value of a span, or None."""
    dims = read_reward(attributes)
    if not dims:
        return None
    primary = attributes.get(REWARD_PRIMARY)
    if isinstance(primary, str) and primary in dims:
        return dims[primary]
    if PRIMARY in dims:
        return dims[PRIMARY]
    return next(iter(dims.values()))  # the reference's encoding: the first dimension is primary


def read_reward_dimension(attributes: Mapping[str, Any], dimension: str | None = None) -> float | None:
    """The value of one named reward dimension of a span (None: the primary one), or None."""
    if dimension is None:
        return read_primary_reward(attributes)
    return (read_reward(attributes) or {}).get(dimension)


def is_reward_scope(name: str, attributes: Mapping[str, Any]) -> bool:
    """Whether a span is a reward scope: it carries a reward, or it is the reward span or operation.

    LLM calls made inside a reward scope (LLM-as-judge) grade the agent; they are not the agent's.
    """
    if name == SPAN_REWARD:
        return True
    if name == SPAN_OPERATION and attributes.get(OPERATION_NAME) == SPAN_REWARD:
        return True
    return read_reward(attributes) is not None


# ------------------------------------------------------------------ agents and LLM calls


def read_agent_name(name: str, attributes: Mapping[str, Any]) -> str | None:
    """The agent a span names: :data:`AGENT_NAME`, else the OpenAI Agents SDK's ``agent.name``, else the
    name of an operation span (a reward operation names no agent); None when the span names none."""
    for key in (AGENT_NAME, OPENAI_AGENTS_AGENT_NAME):
        value = attributes.get(key)
        if isinstance(value, str) and value:
            return value
    if name == SPAN_OPERATION:
        operation_name = attributes.get(OPERATION_NAME)
        if isinstance(operation_name, str) and operation_name and operation_name != SPAN_REWARD:
            return operation_name
    return None


def read_llm_error(
    attributes: Mapping[str, Any], status_code: int = 0, status_message: str = ""
) -> str | None:
    """Why an LLM call failed (:data:`LLM_ERROR`, else the span's error status), or None when it did not."""
    error = attributes.get(LLM_ERROR)
    if error:
        return str(error)
    if status_code == STATUS_CODE_ERROR:
        return status_message or "span status ERROR"
    return None


def sampling_attributes(request: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`LLM_REQUEST_TEMPERATURE` family of attributes of a chat or completions request body.

    temperature and top_p: the request's number (or numeric string, which vLLM takes), else (absent or null)
    the engine's default 1.0; top_k, max_tokens and seed: the request's integer, else nothing. A value the
    engine would refuse (not a finite number) is not recorded.
    """
    out: dict[str, Any] = {}
    for key, name, default in (
        (LLM_REQUEST_TEMPERATURE, "temperature", DEFAULT_TEMPERATURE),
        (LLM_REQUEST_TOP_P, "top_p", DEFAULT_TOP_P),
    ):
        value = request.get(name)
        if value is None:
            out[key] = default
            continue
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                continue
        if _is_number(value):
            out[key] = float(value)
    max_tokens = request.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = request.get("max_tokens")
    for key, value in (
        (LLM_REQUEST_TOP_K, request.get("top_k")),
        (LLM_REQUEST_MAX_TOKENS, max_tokens),
        (LLM_REQUEST_SEED, request.get("seed")),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    return out


def read_sampling(attributes: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(temperature, top_p) an LLM-call span records; None for one it does not record (a span written
    before these attributes existed, or by another writer)."""
    found: list[float | None] = []
    for key in (LLM_REQUEST_TEMPERATURE, LLM_REQUEST_TOP_P):
        value: Any = attributes.get(key)
        found.append(float(value) if _is_number(value) else None)
    return found[0], found[1]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------ objects, messages, links, tags


def object_attributes(obj: Any) -> dict[str, Any]:
    if isinstance(obj, bool | int | float | str):
        return {OBJECT_TYPE: type(obj).__name__, OBJECT_LITERAL: obj}
    if isinstance(obj, bytes | bytearray):
        return {OBJECT_TYPE: "bytes", OBJECT_LITERAL: base64.b64encode(bytes(obj)).decode()}
    try:
        text = json.dumps(obj, default=_jsonable)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot record {type(obj).__name__} as JSON: {exc}") from None
    return {OBJECT_TYPE: _qualified(type(obj)), OBJECT_JSON: text}


def read_object(attributes: Mapping[str, Any]) -> Any:
    kind = attributes.get(OBJECT_TYPE)
    if kind is None:
        return None
    if OBJECT_JSON in attributes:
        return json.loads(attributes[OBJECT_JSON])
    literal = attributes.get(OBJECT_LITERAL)
    if kind == "bytes":
        return base64.b64decode(literal or "")
    return literal


def _qualified(cls: type) -> str:
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def message_attributes(text: str) -> dict[str, Any]:
    return {MESSAGE_BODY: str(text)}


def tag_attributes(tags: Iterable[str]) -> dict[str, Any]:
    return {f"{TAG}.{i}": str(tag) for i, tag in enumerate(tags)}


def read_tags(attributes: Mapping[str, Any]) -> list[str]:
    found = [
        (int(k[len(TAG) + 1 :]), v)
        for k, v in attributes.items()
        if k.startswith(TAG + ".") and k[len(TAG) + 1 :].isdigit()
    ]
    return [str(v) for _, v in sorted(found)]


def link_attributes(links: Mapping[str, str]) -> dict[str, Any]:
    """Links to other spans by attribute value, e.g. ``{"gen_ai.response.id": "chatcmpl-1"}``."""
    out: dict[str, Any] = {}
    for i, (key, value) in enumerate(links.items()):
        out[f"{LINK}.{i}.key"] = str(key)
        out[f"{LINK}.{i}.value"] = str(value)
    return out


def read_links(attributes: Mapping[str, Any]) -> dict[str, str]:
    found: dict[int, dict[str, str]] = {}
    for key, value in attributes.items():
        if key.startswith(LINK + "."):
            parts = key.split(".")
            if len(parts) == 4 and parts[2].isdigit() and parts[3] in ("key", "value"):
                found.setdefault(int(parts[2]), {})[parts[3]] = str(value)
    return {d["key"]: d["value"] for _, d in sorted(found.items()) if "key" in d and "value" in d}


def flatten(prefix: str, value: Any) -> dict[str, Any]:
    """Nested data as dotted attributes; lists of one primitive type stay lists."""
    out: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if not value:
            out[prefix] = "{}"
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}", v))
    elif isinstance(value, list | tuple):
        kinds = {type(v) for v in value}
        if value and len(kinds) == 1 and kinds <= {str, int, float, bool}:
            out[prefix] = list(value)
        else:
            for i, v in enumerate(value):
                out.update(flatten(f"{prefix}.{i}", v))
    elif value is None or isinstance(value, str | int | float | bool):
        out[prefix] = "null" if value is None else value
    else:
        out[prefix] = json.dumps(value, default=str)
    return out
