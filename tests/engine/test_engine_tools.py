"""Tool calls in the embedded engine: the hermes parser on text, and forced calls through a real engine.

The tiny model's weights are random, so it never writes a tool call by itself: "auto" parsing is tested
on hand-written text (the parser as a unit), and through the engine with calls the grammar forces
(``tool_choice`` "required" or a named function), which are parsed the same way.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import openai
import pytest

from lightning_grpc.engine import EngineServer
from lightning_grpc.engine.errors import EngineError
from lightning_grpc.engine.protocol import parse_chat
from lightning_grpc.engine.tools import ToolCallStream, closed, parse_tool_calls
from tests.engine.conftest import MODEL

#: The engine tests share one engine and its event loop (the parser's tests are plain functions).
on_engine = pytest.mark.asyncio(loop_scope="module")

TOKEN_IDS = {"return_token_ids": True}
PRESS: Any = {
    "type": "function",
    "function": {
        "name": "press",
        "description": "Press one digit of the lock.",
        "parameters": {
            "type": "object",
            "properties": {"digit": {"type": "integer", "enum": list(range(10))}},
            "required": ["digit"],
            "additionalProperties": False,
        },
    },
}
SAY: Any = {
    "type": "function",
    "function": {
        "name": "say",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "enum": ["yes", "no"]}, "loud": {"type": "boolean"}},
            "required": ["word", "loud"],
            "additionalProperties": False,
        },
    },
}
TOOLS: Any = [PRESS, SAY]
MESSAGES: Any = [
    {"role": "system", "content": "Open the lock."},
    {"role": "user", "content": "Press a digit."},
]
NAMED: Any = {"type": "function", "function": {"name": "press"}}


async def chat(client: openai.AsyncOpenAI, **kwargs: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "seed": 1, **kwargs}
    response = await client.chat.completions.create(**body, extra_body=TOKEN_IDS)
    data: dict[str, Any] = response.model_dump()
    return data


def valid_arguments(name: str, arguments: str) -> bool:
    """The arguments satisfy the tool's schema (checked by hand: the two schemas are small)."""
    args = json.loads(arguments)
    if name == "press":
        return set(args) == {"digit"} and type(args["digit"]) is int and 0 <= args["digit"] <= 9
    return set(args) == {"word", "loud"} and args["word"] in ("yes", "no") and type(args["loud"]) is bool


def block(call: dict[str, Any]) -> str:
    """The text the template renders for a call (and the grammar lets the model write)."""
    function = call["function"]
    return (
        f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {function["arguments"]}}}\n</tool_call>'
    )


# ---------------------------------------------------------------- the parser, on text
def test_a_call_after_content_is_parsed_like_vllms_hermes_parser() -> None:
    text = 'Let me press.\n<tool_call>\n{"name": "press", "arguments": {"digit": 4}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me press."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("press", '{"digit": 4}')]
    call = parsed.calls[0].as_dict()
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "press", "arguments": '{"digit": 4}'}


def test_several_calls_no_content_and_arguments_reserialised_with_default_separators() -> None:
    text = (
        '<tool_call>\n{"name":"press","arguments":{"digit":1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "say", "arguments": {"word": "ü", "loud": true}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("press", '{"digit": 1}'),
        ("say", '{"word": "ü", "loud": true}'),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        '<tool_call>\n{"name": "press", "arguments": {"digit": 4}\n</tool_call>',  # broken JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "press"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": "press", "arguments": {}}',  # never closed
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>oops</tool_call>',  # one bad
    ],
)
def test_malformed_calls_stay_plain_content(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and parsed.content == text


@pytest.mark.parametrize("seed", range(6))
def test_the_stream_parser_gives_what_the_whole_text_parser_gives(seed: int) -> None:
    text = (
        'Pressing 1 < 2 now.\n<tool_call>\n{"name": "press", "arguments": {"digit": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "say", "arguments": {"word": "no", "loud": false}}\n</tool_call>'
    )
    rng = random.Random(seed)
    stream, content, calls = ToolCallStream(), "", []
    position = 0
    while position < len(text):
        size = rng.randint(1, 7)
        piece, position = text[position : position + size], position + size
        new_content, new_calls = stream.feed(piece)
        content += new_content
        calls += new_calls
    content += stream.finish()
    whole = parse_tool_calls(text)
    assert content == whole.content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c.as_dict()["function"] for c in whole.calls]


def test_the_stream_parser_sends_held_back_text_when_no_call_comes() -> None:
    stream = ToolCallStream()
    assert stream.feed("a\n<tool_") == ("a", [])
    assert stream.feed("box>") == ("\n<tool_box>", [])
    assert stream.feed("\n<tool") == ("", [])
    assert stream.finish() == "\n<tool"
    stream = ToolCallStream()
    assert stream.feed("<") == ("", [])  # a call may start the text
    assert stream.feed("tool_call>\n") == ("", [])
    assert stream.finish() == "<tool_call>\n"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"press": {}}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [PRESS, PRESS]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "jump"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ],
)
def test_bad_tools_and_tool_choices_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(EngineError) as caught:
        parse_chat({"messages": MESSAGES, **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_tool_choice_defaults_and_forced_choices_carry_a_grammar() -> None:
    assert parse_chat({"messages": MESSAGES}).tool_choice.mode == "none"  # type: ignore[union-attr]
    auto = parse_chat({"messages": MESSAGES, "tools": TOOLS})
    assert auto.tool_choice is not None and auto.tool_choice.mode == "auto" and auto.params.grammar is None
    assert parse_chat({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}).params.grammar is None
    named = parse_chat({"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED}).params.grammar
    required = parse_chat({"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}).params.grammar
    assert named is not None and '"name\\": \\"press\\"' in named and "say" not in named
    assert required is not None and "press" in required and "say" in required


# ---------------------------------------------------------------- through the engine
@on_engine
async def test_a_named_tool_choice_forces_a_valid_call_whose_ids_are_its_text(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    data = await chat(client, tool_choice=NAMED)
    choice = data["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "press" and valid_arguments("press", call["function"]["arguments"])
    ids = choice["token_ids"]
    assert ids[-1] == tokenizer.eos_token_id  # the grammar ends the turn with <|im_end|>
    assert tokenizer.decode(ids, skip_special_tokens=True) == block(call)
    assert (
        data["prompt_token_ids"]
        == tokenizer(
            tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@on_engine
async def test_required_calls_one_of_the_tools_with_valid_arguments(
    client: openai.AsyncOpenAI, seed: int
) -> None:
    data = await chat(client, tool_choice="required", seed=seed, temperature=1.5)
    calls = data["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] in {"press", "say"}
    assert valid_arguments(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    assert data["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
@on_engine
async def test_a_streamed_forced_call_has_the_same_ids_and_calls_as_the_non_streamed_one(
    client: openai.AsyncOpenAI, tool_choice: Any
) -> None:
    whole = await chat(client, tool_choice=tool_choice, seed=5, logprobs=True)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        seed=5,
        logprobs=True,
        stream=True,
        extra_body=TOKEN_IDS,
    )
    ids: list[int] = []
    calls: dict[int, dict[str, Any]] = {}
    content, finish, logprobs = "", None, 0
    async for chunk in stream:
        body = chunk.model_dump()
        for choice in body["choices"]:
            assert choice["token_ids"] is not None  # every chunk carries its ids
            ids += choice["token_ids"]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                calls[delta["index"]]["name"] += delta["function"].get("name") or ""
                calls[delta["index"]]["arguments"] += delta["function"].get("arguments") or ""
            logprobs += len((choice.get("logprobs") or {}).get("content") or [])
            finish = choice["finish_reason"] or finish
    expected = whole["choices"][0]
    assert ids == expected["token_ids"]
    assert logprobs == len(ids)
    assert finish == "tool_calls" and content == ""
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in expected["message"]["tool_calls"]]


@on_engine
async def test_logprobs_of_a_forced_call_are_the_models_own(client: openai.AsyncOpenAI) -> None:
    """The mask decides what may be sampled; the recorded log-probs are the unmasked distribution's, so
    the forced tokens' probabilities sum to less than one where the model preferred something else."""
    data = await chat(client, tool_choice=NAMED, logprobs=True, top_logprobs=3)
    entries = data["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(data["choices"][0]["token_ids"])
    assert all(e["logprob"] <= 0.0 for e in entries)
    # somewhere the forced token is not the model's favourite (random weights): the top entry differs
    assert any(e["top_logprobs"][0]["logprob"] > e["logprob"] for e in entries)


@on_engine
async def test_a_forced_call_sent_back_renders_the_same_text_and_continues_the_token_ids(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    """The call re-renders to exactly the generated text, always. Token-exact continuation holds when the
    sampled ids are the tokenizer's own split of that text; constrained sampling may pick another split of
    the same text (llguidance allows any tokenization), so that part is checked only when it is canonical,
    and the test requires at least one of the seeds to be canonical."""
    canonical_seen = 0
    for seed in (1, 2, 3, 4, 5, 6):
        first = await chat(client, tool_choice="required", seed=seed)
        choice = first["choices"][0]
        call = choice["message"]["tool_calls"][0]
        history = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "the lock clicks"},
        ]
        second = await chat(client, messages=history, max_tokens=2)
        rendered = tokenizer.decode(second["prompt_token_ids"])
        previous = tokenizer.decode(first["prompt_token_ids"] + choice["token_ids"])
        assert rendered.startswith(previous)  # the text: always exact
        response_text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        canonical = (
            tokenizer(response_text, add_special_tokens=False)["input_ids"] == choice["token_ids"][:-1]
        )
        if canonical:
            canonical_seen += 1
            prefix = first["prompt_token_ids"] + choice["token_ids"]
            assert second["prompt_token_ids"][: len(prefix)] == prefix
    assert canonical_seen > 0


@on_engine
async def test_auto_and_none_leave_text_without_calls_as_content(
    client: openai.AsyncOpenAI, tokenizer: Any
) -> None:
    for tool_choice in ("auto", "none"):
        data = await chat(client, tool_choice=tool_choice, max_tokens=12)
        choice = data["choices"][0]
        text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        assert "<tool_call>" not in text  # random weights: the model never starts a call by itself
        assert choice["message"]["content"] == text and not choice["message"].get("tool_calls")
        assert choice["finish_reason"] in {"stop", "length"}


@on_engine
async def test_unconstrained_sequences_are_untouched_by_a_constrained_neighbour(
    client: openai.AsyncOpenAI,
) -> None:
    async def plain() -> list[int]:
        data = await chat(client, tools=None, max_tokens=16, seed=11)
        ids: list[int] = data["choices"][0]["token_ids"]
        return ids

    alone = await plain()
    together = await asyncio.gather(plain(), chat(client, tool_choice="required", n=3), plain())
    assert together[0] == together[2] == alone
    assert [c["finish_reason"] for c in together[1]["choices"]] == ["tool_calls"] * 3


@pytest.mark.parametrize("seed", [1, 2, 3])
@on_engine
async def test_a_forced_calls_forced_positions_are_every_token_but_the_digit(
    client: openai.AsyncOpenAI, tokenizer: Any, seed: int
) -> None:
    """With one tool and a digit enum the only choice is the digit: every other token of the block, and the
    end of turn after it, was the only token the grammar allowed."""
    data = await chat(client, tools=[PRESS], tool_choice=NAMED, seed=seed, temperature=1.5)
    choice = data["choices"][0]
    ids, forced = choice["token_ids"], choice["forced_token_positions"]
    free = [i for i in range(len(ids)) if i not in set(forced)]
    assert sorted(forced) == forced and len(set(forced)) == len(forced)
    assert [tokenizer.decode([ids[i]]) for i in free] == [
        str(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["digit"])
    ]
    assert ids[-1] == tokenizer.eos_token_id and len(ids) - 1 in forced


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
@on_engine
async def test_streamed_forced_positions_are_the_whole_responses(
    client: openai.AsyncOpenAI, tool_choice: Any
) -> None:
    whole = await chat(client, tool_choice=tool_choice, seed=3, temperature=1.5)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        seed=3,
        temperature=1.5,
        stream=True,
        extra_body=TOKEN_IDS,
    )
    ids: list[int] = []
    forced: list[int] = []
    async for chunk in stream:
        for choice in chunk.model_dump()["choices"]:
            forced += [len(ids) + i for i in choice["forced_token_positions"]]
            assert all(0 <= i < len(choice["token_ids"]) for i in choice["forced_token_positions"])
            ids += choice["token_ids"]
    expected = whole["choices"][0]
    assert ids == expected["token_ids"] and forced == expected["forced_token_positions"]
    assert 0 < len(forced) < len(ids)


@on_engine
async def test_unconstrained_answers_have_no_forced_positions(client: openai.AsyncOpenAI) -> None:
    for tool_choice in ("auto", "none"):
        data = await chat(client, tool_choice=tool_choice, max_tokens=8)
        assert "forced_token_positions" not in data["choices"][0]
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, extra_body=TOKEN_IDS
    )
    async for chunk in stream:
        assert all("forced_token_positions" not in c for c in chunk.model_dump()["choices"])
    without_ids = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=200
    )
    assert "forced_token_positions" not in without_ids.model_dump()["choices"][0]


@on_engine
async def test_a_schema_llguidance_cannot_compile_is_a_400_naming_tools(engine: EngineServer) -> None:
    bad: Any = {"type": "function", "function": {"name": "x", "parameters": {"type": "no-such-type"}}}
    c = openai.AsyncOpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[bad], tool_choice="required"
            )
        assert caught.value.body["param"] == "tools"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as caught:
            await c.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=NAMED | {"function": {"name": "jump"}},
            )
        assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]
    finally:
        await c.close()


def test_a_forced_calls_objects_hold_their_declared_properties_only() -> None:
    """JSON Schema lets any other key in by default; a forced call's grammar does not (xgrammar's strict
    mode does the same in vLLM), except where the schema says otherwise. Data (enum, const) is not a schema."""
    schema = {
        "type": "object",
        "properties": {
            "place": {"type": "object", "properties": {"city": {"type": "string"}}},
            "extra": {"type": "object", "additionalProperties": True},
            "choice": {"enum": [{"type": "object"}]},
        },
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["place"]["additionalProperties"] is False
    assert out["properties"]["extra"]["additionalProperties"] is True
    assert out["properties"]["choice"] == {"enum": [{"type": "object"}]}
    assert "additionalProperties" not in schema  # the caller's schema is left as it was
