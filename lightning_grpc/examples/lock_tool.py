"""The combination lock played with a tool: the agent calls ``press(digit)`` and the tool answers as the lock.

The agents of ``examples/frameworks/`` (the OpenAI Agents SDK, LangGraph, the Anthropic SDK) play the
lock of :mod:`lightning_grpc.examples.combination_lock` -- code 3 then 7, the "moving on" variant, two
presses, reward = right digits / 2 -- but press its keys through a tool call instead of writing a digit::

    user       A two-digit combination lock keeps the barn door shut. Enter the first digit.
    assistant  press({"digit": 3})
    tool       Click. Enter the second digit.
    assistant  press({"digit": 5})                -> the episode ends: reward 0.5

Why a tool and why this schema: a framework agent acts through tools, and the tiny random model never
writes a tool call by itself. Each agent forces the call with its framework's own tool-choice setting and
the engine writes it by constrained decoding, so the one choice the model makes is the digit; the schema
allows exactly the ten digits (an ``enum``), so that choice is one token out of ten and the GRPO signal
lands on it.

What lives here is what the three agents share: the tool's name, description and JSON schema
(:data:`PRESS_PARAMETERS`, for the SDKs that take a schema), the :data:`Digit` type (for those that read a
function's signature), the per-episode keypad (:class:`Keypad`, whose :meth:`Keypad.press` the tool
calls) and the sampling the forced call needs (:func:`tool_sampling`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_grpc.examples.combination_lock import Episode, sampling_for

#: The tool's name: every agent forces this tool.
PRESS = "press"
PRESS_DESCRIPTION = (
    "Press one digit (0-9) on the lock's keypad. The lock answers 'Click.' when the digit was right, "
    "'Wrong.' when it was not, and asks for the next digit."
)
DIGITS = tuple(range(10))
#: The digit argument as a type, for frameworks that build the schema from a signature: an enum of 0..9.
Digit = Literal[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
#: The tool's parameters as JSON schema (the same enum), for frameworks that take a schema.
PRESS_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "digit": {"type": "integer", "enum": list(DIGITS), "description": "The digit to press."},
    },
    "required": ["digit"],
    "additionalProperties": False,
}

#: Longest response of one call. The forced call with the tiny model's tokenizer,
#: ``<tool_call>\\n{"name": "press", "arguments": {"digit": 3}}\\n</tool_call>`` and ``<|im_end|>``, is 38
#: tokens (the engine's constrained decoder writes it in the canonical tokenization: measured 38 every
#: time); 10 more are slack.
TOOL_MAX_TOKENS = 48


@dataclass
class Keypad:
    """One episode's keypad: :meth:`press` is what the agent's ``press`` tool does.

    A framework calls the tool by itself, so the episode's state lives here, where both the tool and the
    agent's stop condition (:attr:`done`) see it.
    """

    episode: Episode

    @classmethod
    def for_task(cls, task: Mapping[str, Any]) -> Keypad:
        return cls(Episode(task))

    @property
    def done(self) -> bool:
        return self.episode.done

    @property
    def reward(self) -> float:
        return self.episode.reward

    def press(self, digit: object) -> str:
        """Press ``digit``; returns the lock's answer (its outcome once the episode is over).

        A digit outside 0..9 (only an unconstrained model writes one) is a wrong press, like a reply
        without a digit in the text game.
        """
        if self.done:
            return self.episode.outcome()
        key = str(digit) if isinstance(digit, int) and digit in DIGITS else ""
        answer = self.episode.answer(key)
        return answer if answer is not None else self.episode.outcome()


def tool_sampling(task: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """temperature, top_p and max_tokens of a tool call: :func:`sampling_for`, with room for the forced
    call unless the LLM resource (``defaults``) or the task says otherwise."""
    return sampling_for(task, {"max_tokens": TOOL_MAX_TOKENS, **(defaults or {})})


def anthropic_base_url(endpoint: str) -> str:
    """The Anthropic SDK's base URL for an OpenAI-style endpoint: without the trailing ``/v1``, which the
    SDK adds itself (``{base}/v1/messages``)."""
    base = endpoint.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


__all__ = [
    "DIGITS",
    "PRESS",
    "PRESS_DESCRIPTION",
    "PRESS_PARAMETERS",
    "TOOL_MAX_TOKENS",
    "Digit",
    "Keypad",
    "anthropic_base_url",
    "tool_sampling",
]
