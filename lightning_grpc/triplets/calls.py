"""One LLM-call span read into what training needs: ids, choices, scope (agent, reward) and outcome."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_grpc import semconv

from .tokens import EMPTY_IDS, logprobs_from, token_ids_from
from .tree import Node

# A choice index of 1 or more in a response body: only such bodies are parsed for their other choices.
_LATER_CHOICE = re.compile(r'"index"\s*:\s*[1-9]')


@dataclass(eq=False)
class Choice:
    """One choice of a call's response (choice 0 is the one the proxy recorded in the span's attributes)."""

    index: int
    response_ids: np.ndarray | None
    logprobs: np.ndarray | None
    finish_reason: str
    #: int32, sorted and unique: the response positions a grammar forced (see ``forced_positions_from``).
    forced_positions: np.ndarray = field(default_factory=lambda: EMPTY_IDS)


@dataclass(eq=False)
class Call:
    """An LLM-call span as read, with its index among all the rollout's LLM calls in call order."""

    node: Node
    index: int
    prompt_ids: np.ndarray | None
    choice0: Choice
    error: str | None
    response_id: str
    model: str
    policy_version: int
    streamed: bool
    agent_name: str
    in_reward_scope: bool
    #: The sampling temperature and top_p the span records (None: not recorded).
    temperature: float | None = None
    top_p: float | None = None

    @property
    def span_id(self) -> str:
        return self.node.span_id


def read_call(node: Node, index: int) -> Call:
    attributes = node.attributes
    span = node.span
    response_ids = token_ids_from(attributes.get(semconv.LLM_RESPONSE_TOKEN_IDS))
    logprobs = None
    forced = EMPTY_IDS
    if response_ids is not None:
        logprobs = logprobs_from(attributes.get(semconv.LLM_RESPONSE_LOGPROBS), len(response_ids))
        forced = forced_positions_from(
            attributes.get(semconv.LLM_RESPONSE_FORCED_POSITIONS), len(response_ids)
        )
    finish_reason = str(attributes.get(semconv.LLM_FINISH_REASON) or "")
    version = attributes.get(semconv.LLM_POLICY_VERSION)
    temperature, top_p = semconv.read_sampling(attributes)
    return Call(
        node=node,
        index=index,
        prompt_ids=token_ids_from(attributes.get(semconv.LLM_PROMPT_TOKEN_IDS)),
        choice0=Choice(0, response_ids, logprobs, finish_reason, forced),
        error=semconv.read_llm_error(
            attributes,
            span.status_code if span is not None else 0,
            span.status_message if span is not None else "",
        ),
        response_id=str(attributes.get(semconv.LLM_RESPONSE_ID) or ""),
        model=str(attributes.get(semconv.LLM_MODEL) or ""),
        policy_version=version if isinstance(version, int) and not isinstance(version, bool) else -1,
        streamed=attributes.get(semconv.LLM_STREAMED) is True,
        agent_name=agent_above(node),
        in_reward_scope=is_under_reward_scope(node),
        temperature=temperature,
        top_p=top_p,
    )


def forced_positions_from(value: Any, length: int) -> np.ndarray:
    """The forced positions as sorted unique int32 indices below ``length``. A missing or malformed value
    gives none (a bad attribute must not fail the call: it then trains every token, as before), and
    positions past the response are dropped."""
    positions = token_ids_from(value)
    if positions is None or not positions.size:
        return EMPTY_IDS
    return np.unique(positions[positions < length])


def agent_above(node: Node) -> str:
    """The agent name of the nearest ancestor that names one, or ""."""
    for ancestor in node.ancestors():
        name = semconv.read_agent_name(ancestor.name, ancestor.attributes)
        if name is not None:
            return name
    return ""


def is_under_reward_scope(node: Node) -> bool:
    return any(semconv.is_reward_scope(ancestor.name, ancestor.attributes) for ancestor in node.ancestors())


def other_choices(attributes: Mapping[str, Any]) -> list[Choice]:
    """The choices after choice 0 of an ``n > 1`` call, from its recorded response, in index order."""
    body = attributes.get(semconv.LLM_RESPONSE)
    if isinstance(body, str):
        if not _LATER_CHOICE.search(body):
            return []
        try:
            body = json.loads(body)
        except ValueError:
            return []
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return []
    found: dict[int, Choice] = {}
    for choice in body["choices"]:
        if not isinstance(choice, dict):
            continue
        index = choice.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 1 or index in found:
            continue
        ids = token_ids_from(choice.get("token_ids"))
        logprobs = logprobs_from(choice_logprobs(choice), len(ids)) if ids is not None else None
        forced = (
            forced_positions_from(choice.get("forced_token_positions"), len(ids))
            if ids is not None
            else EMPTY_IDS
        )
        found[index] = Choice(index, ids, logprobs, str(choice.get("finish_reason") or ""), forced)
    return [found[index] for index in sorted(found)]


def choice_logprobs(choice: Mapping[str, Any]) -> list[Any] | None:
    """Log-probs of a choice: chat ``logprobs.content[].logprob``, completions ``logprobs.token_logprobs``."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if isinstance(content, list):
        return [item.get("logprob") if isinstance(item, dict) else None for item in content]
    values = logprobs.get("token_logprobs")
    return values if isinstance(values, list) else None
