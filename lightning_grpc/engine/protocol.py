"""The OpenAI-compatible request side of the engine: validation into plain dataclasses, and errors.

Nothing here imports torch: the server validates a request completely (400 with an OpenAI-style error
body, never a traceback) before anything reaches the scheduler. Unknown request fields are ignored,
as the OpenAI and vLLM servers do; fields that would change the output but are not implemented
(``min_p``, ``repetition_penalty``, ``echo``, ``suffix``) are refused with a 400 rather than ignored.
The vLLM extensions understood: ``return_token_ids``, ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``add_special_tokens`` (completions),
``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message`` (chat).
Chat's ``tools`` and ``tool_choice`` are validated by ``tools``; a forced choice becomes the sampling
parameters' ``grammar``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_grpc.engine import tools as t
from lightning_grpc.engine.errors import bad_request
from lightning_grpc.engine.tools import ToolChoice

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
SEED_MODULUS = 2**63


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops (``max_tokens`` is resolved per prompt)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens'.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: An llguidance (Lark) grammar the output must follow: a forced tool call (see ``tools``).
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class ParsedRequest:
    """What the two endpoints share once validated."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    max_tokens: int | None
    params: SamplingParams = field(repr=False)


@dataclass
class ChatRequest(ParsedRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: How tool calls are parsed from the output and whether one is forced (a ``tools.ToolChoice``).
    tool_choice: ToolChoice | None = None


@dataclass
class CompletionRequest(ParsedRequest):
    #: Each prompt is either text or token ids.
    prompts: list[str | list[int]] = field(default_factory=list)
    add_special_tokens: bool = True


# ---------------------------------------------------------------- endpoints
def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    messages = _messages(body.get("messages"))
    logprobs_on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top is not None and not logprobs_on:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if logprobs_on else None

    tools = t.validate_tools(body.get("tools"))
    tool_choice = t.parse_tool_choice(body.get("tool_choice"), tools)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    template_kwargs = {
        **kwargs,
        "add_generation_prompt": _bool(body, "add_generation_prompt", True),
        "continue_final_message": _bool(body, "continue_final_message", False),
    }
    if template_kwargs["add_generation_prompt"] and template_kwargs["continue_final_message"]:
        raise bad_request("add_generation_prompt and continue_final_message exclude each other")
    common = _common(body, logprobs)
    grammar = t.forced_grammar(tools or [], tool_choice)
    if grammar is not None:
        common["params"] = replace(common["params"], grammar=grammar)
    return ChatRequest(
        **common, messages=messages, tools=tools, template_kwargs=template_kwargs, tool_choice=tool_choice
    )


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    prompts = _prompts(body.get("prompt"))
    logprobs = _int(body, "logprobs", None, low=0, high=MAX_LOGPROBS)
    if _bool(body, "echo", False):
        raise bad_request("echo is not supported", "echo")
    if body.get("suffix") is not None:
        raise bad_request("suffix is not supported", "suffix")
    common = _common(body, logprobs)
    return CompletionRequest(
        **common, prompts=prompts, add_special_tokens=_bool(body, "add_special_tokens", True)
    )


def resolve_max_tokens(request: ParsedRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's sampling parameters with ``max_tokens`` fitted to this prompt (400 if it cannot be)."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(
            f"the prompt has {prompt_len} tokens: the model's context of {max_model_len} leaves no room"
        )
    wanted = request.max_tokens if request.max_tokens is not None else room
    if wanted > room:
        raise bad_request(
            f"max_tokens={wanted} with a {prompt_len}-token prompt exceeds the model's maximum "
            f"context length of {max_model_len}",
            "max_tokens",
        )
    return replace(request.params, max_tokens=wanted)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token in ids:
        if not 0 <= token < vocab_size:
            raise bad_request(f"token id {token} is outside the vocabulary [0, {vocab_size})", param)


# ---------------------------------------------------------------- shared fields
def _common(body: Mapping[str, Any], logprobs: int | None) -> dict[str, Any]:
    max_tokens = _int(body, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, low=1)
    temperature = _float(body, "temperature", 1.0, low=0.0, high=100.0)
    top_p = _float(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p <= 0.0:
        raise bad_request("top_p must be in (0, 1]", "top_p")
    top_k = _int(body, "top_k", 0, low=-1)
    for name in ("min_p", "repetition_penalty"):
        neutral = 0.0 if name == "min_p" else 1.0
        if body.get(name) not in (None, neutral):
            raise bad_request(f"{name} is not supported", name)
    seed = _int(body, "seed", None)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    stream = _bool(body, "stream", False)
    params = SamplingParams(
        max_tokens=0,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k or 0, 0),
        presence_penalty=_float(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        seed=None if seed is None else seed % SEED_MODULUS,
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_int_list(body.get("stop_token_ids"), "stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    return {
        "model": model,
        "n": _int(body, "n", 1, low=1, high=MAX_N),
        "stream": stream,
        "include_usage": stream and _bool(stream_options, "include_usage", False),
        "return_token_ids": _bool(body, "return_token_ids", False),
        "max_tokens": max_tokens,
        "params": params,
    }


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("each message must be an object with a string role", param)
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad_request("only text content parts are supported", f"{param}.content")
        elif content is not None and not isinstance(content, str):
            raise bad_request("content must be a string, a list of text parts, or null", f"{param}.content")
        out.append(dict(message))
    return out


def _prompts(value: Any) -> list[str | list[int]]:
    """``prompt``: text, token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request(
            "prompt must be a string, a list of token ids, or a non-empty list of those", "prompt"
        )
    if all(is_int(x) for x in value):
        return [list(value)]
    prompts: list[str | list[int]] = []
    for item in value:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(is_int(x) for x in item):
            prompts.append(list(item))
        else:
            raise bad_request("each prompt must be a string or a non-empty list of token ids", "prompt")
    return prompts


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return tuple(stops)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object of token id to bias", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not _is_number(bias) or not -100.0 <= float(bias) <= 100.0:
            raise bad_request("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def _int_list(value: Any, param: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(x) and x >= 0 for x in value):
        raise bad_request(f"{param} must be a list of token ids", param)
    return list(value)


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON true must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def _int(
    body: Mapping[str, Any],
    name: str,
    default: int | None,
    *,
    low: int | None = None,
    high: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise bad_request(f"{name} must be an integer", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise bad_request(f"{name}={value} is outside {bounds}", name)
    return int(value)


def _float(body: Mapping[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(f"{name} must be a number", name)
    if not low <= float(value) <= high:
        raise bad_request(f"{name}={value} is outside [{low}, {high}]", name)
    return float(value)
