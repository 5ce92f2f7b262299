"""The embedded engine, end to end: a tiny model built here, a real server on 127.0.0.1, the official client.

One model and one engine serve the whole module (building and loading take a few seconds); tests that
must not run beside others (timings, weight reloads) run their requests one after another.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpc.engine import EngineProcess, EngineServer, start_engine
from tests.engine.conftest import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN_IDS = {"return_token_ids": True}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2? Ünïcode ✓"},
]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def chat(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 1, **kwargs}
    extra = {**TOKEN_IDS, **body.pop("extra_body", {})}
    return await client.chat.completions.create(**body, extra_body=extra)


async def post(engine: EngineServer, path: str, body: Any, key: str | None = None) -> tuple[int, Any, Any]:
    """POST to the engine; the admin routes get the engine's admin key unless ``key`` says otherwise."""
    key = engine.admin_key if key is None and path.startswith("/admin/") else key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            engine.url + path, data=body if isinstance(body, str) else json.dumps(body), headers=headers
        ) as resp,
    ):
        return resp.status, await resp.json(), resp.headers


# ---------------------------------------------------------------- chat
async def test_chat_token_ids_match_the_template_and_the_text(
    client: openai.AsyncOpenAI, tokenizer: Any, engine: EngineServer
) -> None:
    response = await chat(client)
    data = response.model_dump()
    choice = data["choices"][0]
    assert data["prompt_token_ids"] == chat_prompt_ids(tokenizer, MESSAGES)
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"] > 0
    assert data["usage"]["prompt_tokens"] == len(data["prompt_token_ids"])
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    assert choice["finish_reason"] in {"stop", "length"}
    assert data["policy_version"] == engine.policy_version


async def test_a_repeated_chat_prompt_is_rendered_once_and_stays_exact(
    client: openai.AsyncOpenAI, tokenizer: Any, engine: EngineServer
) -> None:
    messages = [{"role": "user", "content": "a prompt sent by every sample of a group"}]
    before = len(engine._rendered)
    first = (await chat(client, messages=messages)).model_dump()["prompt_token_ids"]
    again = (await chat(client, messages=messages, seed=2)).model_dump()["prompt_token_ids"]
    assert first == again == chat_prompt_ids(tokenizer, messages)
    assert len(engine._rendered) == before + 1  # remembered once, served from memory the second time
    # anything that changes the rendering is a different prompt: the messages, or the template arguments
    longer = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    assert (await chat(client, messages=longer)).model_dump()["prompt_token_ids"] == chat_prompt_ids(
        tokenizer, longer
    )
    continued = await chat(
        client,
        messages=[*messages, {"role": "assistant", "content": "I"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert continued.model_dump()["prompt_token_ids"] != first
    assert len(engine._rendered) == before + 3


async def test_without_return_token_ids_the_fields_are_absent(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    data = response.model_dump()
    assert data.get("prompt_token_ids") is None and data["choices"][0].get("token_ids") is None
    assert data["choices"][0]["logprobs"] is None


async def test_streamed_ids_equal_the_non_streamed_ones(
    client: openai.AsyncOpenAI, engine: EngineServer
) -> None:
    whole = (await chat(client, max_tokens=20, logprobs=True)).model_dump()
    stream = await chat(
        client, max_tokens=20, logprobs=True, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk.model_dump() async for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert {c["policy_version"] for c in chunks} == {engine.policy_version}
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    ids = [t for c in choices for t in c["token_ids"]]
    text = "".join(c["delta"]["content"] or "" for c in choices)
    logprobs = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert text == whole["choices"][0]["message"]["content"]
    assert [e["logprob"] for e in logprobs] == [
        e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]
    ]
    assert choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)


async def test_stream_framing_is_sse_with_done(engine: EngineServer) -> None:
    # ignore_eos: the framing is under test, so the answer must be its 4 tokens long whatever is sampled
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(engine.base_url + "/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["x-policy-version"] == str(engine.policy_version)
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    deltas = [json.loads(e[6:])["choices"][0]["token_ids"] for e in events[1:-2]]
    assert sum(len(d) for d in deltas) == 4 and all(len(d) == 1 for d in deltas)


async def test_logprobs_are_consistent(client: openai.AsyncOpenAI, tokenizer: Any) -> None:
    data = (await chat(client, logprobs=True, top_logprobs=3, max_tokens=8)).model_dump()
    choice = data["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for entry in content:
        assert len(entry["top_logprobs"]) == 3
        best = entry["top_logprobs"][0]["logprob"]
        assert entry["logprob"] <= best + 1e-6 and best <= 0
    raw = b"".join(bytes(e["bytes"]) for e in content)
    assert raw.decode("utf-8", errors="replace") == tokenizer.decode(
        choice["token_ids"], skip_special_tokens=False
    )


async def test_streamed_text_never_carries_a_replacement_character_the_full_text_lacks(
    tokenizer: Any,
) -> None:
    """Byte-level tokens split characters: a chunk holds a partial character back until it is whole."""
    import random

    from lightning_grpc.engine.protocol import SamplingParams
    from lightning_grpc.engine.text import REPLACEMENT, OutputText, TokenTexts

    texts = TokenTexts(tokenizer)
    vocab = len(tokenizer)
    partial = [i for i in range(vocab) if REPLACEMENT in texts.get(i)[0]]  # lone bytes of a character
    assert partial, "the tiny tokenizer has byte tokens"
    whole = tokenizer.encode("你好 im 😀 wörld", add_special_tokens=False)
    rng = random.Random(7)
    held_back = 0
    for _ in range(2000):
        ids = [
            rng.choice(partial) if rng.random() < 0.5 else rng.choice([*whole, rng.randrange(vocab)])
            for _ in range(rng.randrange(1, 12))
        ]
        out = OutputText(tokenizer, SamplingParams(max_tokens=64))
        chunks = []
        for token_id in ids:
            out.add(token_id)
            chunks.append(out.take(final=False))
        out.finish()
        chunks.append(out.take(final=True))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(chunks) == full, ids
        at = 0
        for chunk in chunks:
            for k, ch in enumerate(chunk):
                assert ch != REPLACEMENT or full[at + k] == REPLACEMENT, (ids, chunks, full)
            at += len(chunk)
        held_back += sum(1 for c in chunks[:-1] if not c)
    assert held_back  # partial characters were held back, not sent


async def test_n_choices_differ_and_share_the_prompt(client: openai.AsyncOpenAI) -> None:
    data = (await chat(client, n=3, max_tokens=10)).model_dump()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    ids = [tuple(c["token_ids"]) for c in data["choices"]]
    assert len(set(ids)) == 3
    assert data["usage"]["completion_tokens"] == sum(len(i) for i in ids)


async def test_stop_string_truncates_and_finishes_with_stop(client: openai.AsyncOpenAI) -> None:
    free = (await chat(client, max_tokens=30, extra_body={"ignore_eos": True})).choices[0].message.content
    assert free and len(free) > 8
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    cut = await chat(client, max_tokens=30, stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    choice = cut.model_dump()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == free[: free.index(stop)]
    streamed = await chat(client, max_tokens=30, stop=stop, stream=True, extra_body={"ignore_eos": True})
    text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
    assert text == choice["message"]["content"]


async def test_max_tokens_gives_finish_reason_length(client: openai.AsyncOpenAI) -> None:
    choice = (await chat(client, max_tokens=5)).model_dump()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    choice = (await chat(client, max_completion_tokens=2)).model_dump()["choices"][0]
    assert len(choice["token_ids"]) == 2


async def test_same_seed_same_output_other_seed_other_output(client: openai.AsyncOpenAI) -> None:
    first = (await chat(client, seed=42, max_tokens=16)).model_dump()["choices"][0]["token_ids"]
    again = (await chat(client, seed=42, max_tokens=16)).model_dump()["choices"][0]["token_ids"]
    other = (await chat(client, seed=43, max_tokens=16)).model_dump()["choices"][0]["token_ids"]
    assert first == again != other


# ---------------------------------------------------------------- completions
async def test_completion_text_prompt(
    client: openai.AsyncOpenAI, tokenizer: Any, engine: EngineServer
) -> None:
    prompt = "The agent called a tool and"
    data = (
        await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, seed=3, extra_body=TOKEN_IDS
        )
    ).model_dump()
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    logprobs = choice["logprobs"]
    n = len(choice["token_ids"])
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == n
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])
    assert data["policy_version"] == engine.policy_version and "prompt_token_ids" not in data


async def test_completion_token_id_prompts_and_batches(client: openai.AsyncOpenAI) -> None:
    one = [5, 17, 300, 1200]
    data = (
        await client.completions.create(model=MODEL, prompt=one, max_tokens=4, extra_body=TOKEN_IDS)
    ).model_dump()
    assert data["choices"][0]["prompt_token_ids"] == one
    batch = [[7, 8, 9], [100, 200, 300, 400, 500]]
    data = (
        await client.completions.create(
            model=MODEL, prompt=batch, max_tokens=3, n=2, seed=5, extra_body=TOKEN_IDS
        )
    ).model_dump()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in data["choices"]] == [batch[0], batch[0], batch[1], batch[1]]
    assert data["usage"]["prompt_tokens"] == 8 and data["usage"]["completion_tokens"] == 12


async def test_completion_stream_carries_ids_per_choice(client: openai.AsyncOpenAI) -> None:
    whole = (
        await client.completions.create(
            model=MODEL, prompt="tool call", max_tokens=6, seed=9, extra_body=TOKEN_IDS
        )
    ).model_dump()
    stream = await client.completions.create(
        model=MODEL, prompt="tool call", max_tokens=6, seed=9, stream=True, extra_body=TOKEN_IDS
    )
    chunks = [c.model_dump() async for c in stream]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


# ---------------------------------------------------------------- batching
async def test_concurrent_requests_are_batched(client: openai.AsyncOpenAI) -> None:
    def request(i: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"agent {i} " * (1 + i % 5)}],
            max_tokens=16,
            seed=i,
            extra_body={**TOKEN_IDS, "ignore_eos": True},
        )

    started = time.monotonic()
    sequential = [(await request(i)).model_dump() for i in range(32)]
    sequential_s = time.monotonic() - started
    started = time.monotonic()
    concurrent = [r.model_dump() for r in await asyncio.gather(*(request(i) for i in range(32)))]
    concurrent_s = time.monotonic() - started
    print(f"32 requests x 16 tokens: sequential {sequential_s:.2f}s, concurrent {concurrent_s:.2f}s")
    assert concurrent_s < sequential_s
    # Left padding and per-row seeds: a sequence gets the same tokens alone or in a batch of 32.
    assert [r["choices"][0]["token_ids"] for r in concurrent] == [
        r["choices"][0]["token_ids"] for r in sequential
    ]
    assert all(len(r["choices"][0]["token_ids"]) == 16 for r in concurrent)


async def test_a_finished_request_is_freed_without_the_cyclic_collector(client: openai.AsyncOpenAI) -> None:
    """Nothing of a request is left in a reference cycle once it is answered: under load, cycles left for the
    cyclic garbage collector paused the whole engine (every sequence of the batch) every few seconds."""
    from lightning_grpc.engine.scheduler import Submission

    await chat(client, messages=[{"role": "user", "content": "warm up"}], max_tokens=2)
    gc.collect()
    gc.disable()
    try:
        for i in range(8):
            await chat(client, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4, seed=i)
        await asyncio.sleep(0.05)  # the scheduler thread lets go of the last step's submissions
        left = [o for o in gc.get_objects() if type(o) is Submission]
    finally:
        gc.enable()
    assert left == []


async def test_greedy_tokens_and_logprobs_are_those_of_a_forward_pass_over_the_whole_text(
    client: openai.AsyncOpenAI, model_dir: Path
) -> None:
    """The KV cache the scheduler keeps (left padding, newcomers merged in, finished rows dropped) computes
    what the model computes over the whole sequence: each greedy token is the argmax of one forward pass,
    without any cache, over the prompt and the tokens before it, and its log-prob is that pass's."""
    prompts = [[5, 17, 300, 1200], [7, 8, 9], list(range(40, 71)), [11] * 12]
    responses = await asyncio.gather(
        *(
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=4 + 3 * i,  # rows end at different steps and leave a running batch
                temperature=0,
                logprobs=1,
                extra_body={**TOKEN_IDS, "ignore_eos": True},
            )
            for i, prompt in enumerate(prompts)
        )
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    for prompt, response in zip(prompts, responses, strict=True):
        choice = response.model_dump()["choices"][0]
        ids = list(prompt)
        for token, logprob in zip(choice["token_ids"], choice["logprobs"]["token_logprobs"], strict=True):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            assert token == int(logits.argmax()), f"prompt {prompt}, after {ids[len(prompt) :]}"
            assert logprob == pytest.approx(float(torch.log_softmax(logits, dim=-1)[token]), abs=1e-4)
            ids.append(token)
        assert len(ids) - len(prompt) == len(choice["token_ids"]) > 3


async def test_clients_that_hang_up_leave_the_batch(engine: EngineServer, client: openai.AsyncOpenAI) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(engine.base_url + "/chat/completions", json={**body, "stream": True})
        await resp.content.readline()
        resp.close()
        with pytest.raises(asyncio.TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.3)
            await session.post(engine.base_url + "/chat/completions", json=body, timeout=timeout)
    assert engine.scheduler is not None
    for _ in range(60):
        if engine.scheduler.load()["running"] == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.scheduler.load() == {"running": 0, "waiting": 0, "updates": 0}
    assert (await chat(client, max_tokens=2)).choices[0].finish_reason == "length"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "stop": [""]}, "stop"),
        ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
async def test_bad_chat_requests_get_400(engine: EngineServer, body: dict[str, Any], param: str) -> None:
    status, data, _ = await post(engine, "/v1/chat/completions", body)
    assert status == 400
    assert data["error"]["type"] == "BadRequestError" and data["error"]["code"] == 400
    assert data["error"]["param"] == param and data["error"]["message"]


async def test_other_errors_are_openai_json(engine: EngineServer, client: openai.AsyncOpenAI) -> None:
    status, data, _ = await post(engine, "/v1/chat/completions", "{not json")
    assert status == 400 and "JSON" in data["error"]["message"]
    status, data, _ = await post(engine, "/v1/completions", {"model": MODEL, "prompt": [[1, 2], [10**7]]})
    assert status == 400 and data["error"]["param"] == "prompt"
    status, data, _ = await post(engine, "/v1/nothing", {})
    assert status == 404 and data["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="other", messages=MESSAGES)
    assert caught.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="x", logprobs=99)


# ---------------------------------------------------------------- models, health, weights
async def test_models_and_health(engine: EngineServer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(engine.base_url + "/models") as resp:
            models = await resp.json()
        async with session.get(engine.url + "/health") as resp:
            health = await resp.json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["policy_version"] == engine.policy_version
    assert models["data"][0]["max_model_len"] == 2048
    assert health["status"] == "ok"


async def scrape(engine: EngineServer, key: str | None = None) -> tuple[int, str, dict[str, float]]:
    """GET /metrics: the status, the content type and each sample by name (the model_name label dropped)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(engine.url + "/metrics", headers=headers) as resp,
    ):
        text, status, kind = await resp.text(), resp.status, resp.headers.get("Content-Type", "")
    if status != 200:
        return status, kind, {}
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == MODEL
            le = sample.labels.pop("le", None)
            assert not sample.labels, sample
            samples[sample.name + (f"[{le}]" if le else "")] = sample.value
    return status, kind, samples


async def test_metrics_count_the_tokens_and_steps_of_the_calls_served(
    engine: EngineServer, client: openai.AsyncOpenAI
) -> None:
    status, kind, before = await scrape(engine)
    assert status == 200 and kind.startswith("text/plain; version=0.0.4")

    def request(i: int, n: int = 1) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"metrics {i} " * (1 + i % 4)}],
            max_tokens=5,
            n=n,
            seed=i,
            extra_body={"ignore_eos": True},
        )

    answers = await asyncio.gather(*(request(i) for i in range(12)), request(99, n=3))
    _, _, after = await scrape(engine)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    choices = sum(len(a.choices) for a in answers)
    prompt = sum(a.usage.prompt_tokens * len(a.choices) for a in answers)  # prefilled once a choice
    generated = sum(a.usage.completion_tokens for a in answers)
    assert (choices, generated) == (15, 75)
    assert grew["vllm:prompt_tokens_total"] == prompt
    assert grew["vllm:generation_tokens_total"] == generated
    # A step's tokens: the prompts it admitted, then one a row decoded (every token but a choice's first,
    # which its prefill samples).
    assert grew["vllm:iteration_tokens_total_sum"] == prompt + generated - choices
    assert grew["vllm:iteration_tokens_total_count"] == grew["lightning_engine_steps_total"]
    assert grew["vllm:iteration_tokens_total_bucket[+Inf]"] == grew["lightning_engine_steps_total"]
    assert grew["vllm:iteration_tokens_total_bucket[1.0]"] <= grew["vllm:iteration_tokens_total_bucket[8.0]"]
    # Batched: far fewer decode passes than tokens, and at most one prefill pass a choice.
    assert 4 <= grew["lightning_engine_decode_passes_total"] < generated / 2
    assert 1 <= grew["lightning_engine_prefill_passes_total"] <= choices
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["lightning_engine_policy_version"] == engine.policy_version


async def test_weight_reload_changes_outputs_and_version(
    engine: EngineServer, client: openai.AsyncOpenAI, model_dir: Path, tmp_path: Path
) -> None:
    greedy = {"temperature": 0, "max_tokens": 12}
    before = (await chat(client, **greedy)).model_dump()
    version = engine.policy_version

    status, data, headers = await post(
        engine, "/admin/load_weights", {"path": str(perturbed_checkpoint(model_dir, tmp_path / "step-1"))}
    )
    assert (
        status == 200
        and data["policy_version"] == version + 1
        and headers["x-policy-version"] == str(version + 1)
    )
    response = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, seed=1, extra_body=TOKEN_IDS, **greedy
    )
    after = response.parse().model_dump()
    assert response.headers["x-policy-version"] == str(version + 1) and after["policy_version"] == version + 1
    assert after["prompt_token_ids"] == before["prompt_token_ids"]
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    assert (await client.models.list()).model_dump()["data"][0]["policy_version"] == version + 1

    status, data, _ = await post(engine, "/admin/load_weights", {"path": str(tmp_path / "missing")})
    assert status == 400 and data["error"]["param"] == "path" and engine.policy_version == version + 1


async def test_a_reload_waits_for_running_requests(
    engine: EngineServer, client: openai.AsyncOpenAI, model_dir: Path
) -> None:
    """Running requests finish on the old weights; requests arriving meanwhile run on the new ones."""
    original = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    greedy = {"temperature": 0, "max_tokens": 12}
    old = engine.policy_version
    stream = await chat(client, temperature=0, max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    chunks = [await anext(aiter(stream))]
    reload = asyncio.create_task(engine.load_state_dict(original, policy_version=old + 10))
    await asyncio.sleep(0.05)
    assert engine.scheduler is not None and engine.scheduler.load()["updates"] == 1
    assert not reload.done()
    waiting = asyncio.create_task(chat(client, **greedy))
    chunks += [c async for c in stream]
    assert {c.model_dump()["policy_version"] for c in chunks} == {old}
    assert sum(len(c.model_dump()["choices"][0]["token_ids"]) for c in chunks if c.choices) == 400
    assert await reload == old + 10 == engine.policy_version
    late = (await waiting).model_dump()
    assert late["policy_version"] == old + 10
    # The original weights are back: the module's first greedy output again.
    status, data, _ = await post(engine, "/admin/load_weights", {"path": str(model_dir), "policy_version": 7})
    assert status == 200 and data["policy_version"] == 7
    assert (await chat(client, **greedy)).model_dump()["choices"][0]["token_ids"] == late["choices"][0][
        "token_ids"
    ]


def perturbed_checkpoint(model_dir: Path, out: Path) -> Path:
    """What a trainer would write: the same architecture, other weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------- the CLI and the subprocess helper
async def test_init_model_refuses_to_overwrite_a_model_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_grpc import logs
    from lightning_grpc.cli import main as cli

    monkeypatch.setattr(logs, "configure_logging", lambda level="INFO": None)
    path = tmp_path / "model"
    build = ["init-model", str(path), "--vocab-size", "300"]
    assert await asyncio.to_thread(cli.main, [*build, "--seed", "1"]) == 0
    weights = (path / "model.safetensors").read_bytes()
    assert await asyncio.to_thread(cli.main, [*build, "--seed", "2"]) == 2
    assert "init-model writes a new model there only with --force" in capsys.readouterr().err
    assert (path / "model.safetensors").read_bytes() == weights  # untouched
    assert await asyncio.to_thread(cli.main, [*build, "--seed", "2", "--force"]) == 0
    assert (path / "model.safetensors").read_bytes() != weights


async def test_init_model_builds_the_shape_asked_for_and_refuses_heads_that_do_not_divide_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_grpc import logs
    from lightning_grpc.cli import main as cli

    monkeypatch.setattr(logs, "configure_logging", lambda level="INFO": None)
    path = tmp_path / "two-heads"
    args = ["init-model", str(path), "--vocab-size", "300", "--hidden-size", "64", "--heads", "2"]
    assert await asyncio.to_thread(cli.main, args) == 0
    config = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).config
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 2, 2)
    assert config.hidden_size // config.num_attention_heads == 32  # what vLLM's CPU attention takes
    odd = ["init-model", str(tmp_path / "odd"), "--vocab-size", "300", "--hidden-size", "64", "--heads", "3"]
    assert await asyncio.to_thread(cli.main, odd) == 1
    assert not (tmp_path / "odd" / "model.safetensors").exists()


async def test_init_model_cli_then_an_engine_subprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_grpc import logs
    from lightning_grpc.cli import main as cli

    monkeypatch.setattr(logs, "configure_logging", lambda level="INFO": None)  # keep pytest's logging
    path = tmp_path / "llama"
    args = ["init-model", str(path), "--arch", "llama", "--vocab-size", "512", "--seed", "3"]
    with caplog.at_level(logging.INFO, logger="lightning_grpc.engine"):
        assert await asyncio.to_thread(cli.main, args) == 0
    assert "event=tiny_model_built" in caplog.text
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == len(tokenizer) <= 512
    assert sum(p.numel() for p in model.parameters()) < 5_000_000 and tokenizer.chat_template

    def serve_and_ask() -> tuple[dict[str, Any], EngineProcess]:
        with EngineProcess(path, served_model_name="llama") as engine:
            client = openai.OpenAI(base_url=engine.base_url, api_key="EMPTY", max_retries=0)
            data = client.chat.completions.create(
                model="llama", messages=MESSAGES, max_tokens=3, extra_body=TOKEN_IDS
            ).model_dump()
        return data, engine

    data, engine = await asyncio.to_thread(serve_and_ask)
    assert data["prompt_token_ids"] == chat_prompt_ids(tokenizer, MESSAGES)
    assert len(data["choices"][0]["token_ids"]) == data["usage"]["completion_tokens"] > 0
    assert data["policy_version"] == 0
    assert engine.proc is not None and engine.proc.returncode == 0
    assert any("event=engine_stopped" in line for line in engine.lines)


# ---------------------------------------------------------------- the admin routes need the admin key
async def test_load_weights_needs_the_admin_key_which_the_engine_wrote_where_only_its_user_reads_it(
    engine: EngineServer, model_dir: Path, client: openai.AsyncOpenAI
) -> None:
    version = engine.policy_version
    for key in ("", "wrong-key", "EMPTY"):
        status, data, _ = await post(engine, "/admin/load_weights", {"path": str(model_dir)}, key=key or "")
        assert status == 401 and "admin key" in data["error"]["message"], (key, data)
    assert engine.policy_version == version
    # no key was configured: one was made at start and written to a file only this user can read
    assert engine.admin_key_file is not None
    assert engine.admin_key_file.read_text().strip() == engine.admin_key
    assert stat.S_IMODE(engine.admin_key_file.stat().st_mode) == 0o600
    status, data, _ = await post(
        engine, "/admin/load_weights", {"path": str(model_dir), "policy_version": version + 3}
    )
    assert status == 200 and data["policy_version"] == version + 3
    # inference stays open on loopback when no API key is set
    assert (await chat(client, max_tokens=2)).model_dump()["policy_version"] == version + 3


async def test_an_api_key_also_guards_the_admin_routes_unless_an_admin_key_is_given(
    model_dir: Path, tmp_path: Path
) -> None:
    server = await start_engine(model_dir, served_model_name=MODEL, api_key="infer-key")
    try:
        assert server.admin_key == "infer-key" and server.admin_key_file is None
        # /health and /metrics are served without a key, as vLLM serves them; /v1 needs it
        status, _, samples = await scrape(server)
        assert status == 200 and samples["lightning_engine_steps_total"] == 0
        async with aiohttp.ClientSession() as session, session.get(server.base_url + "/models") as resp:
            assert resp.status == 401
        status, _, _ = await post(server, "/admin/load_weights", {"path": str(model_dir)}, key="infer-key")
        assert status == 200
    finally:
        await server.stop()
    keyfile = tmp_path / "keys" / "engine.admin-key"
    server = await start_engine(
        model_dir, served_model_name=MODEL, api_key="infer-key", admin_key="admin-key", admin_key_file=keyfile
    )
    try:
        status, _, _ = await post(server, "/admin/load_weights", {"path": str(model_dir)}, key="infer-key")
        assert status == 401
        status, _, _ = await post(server, "/admin/load_weights", {"path": str(model_dir)}, key="admin-key")
        assert status == 200 and not keyfile.exists()  # a given key is never written anywhere
    finally:
        await server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_the_admin_key_file_the_engine_made_is_removed_when_it_exits(
    model_dir: Path, sig: signal.Signals
) -> None:
    def serve_then_signal() -> tuple[Path, bool, EngineProcess]:
        engine = EngineProcess(model_dir, served_model_name=MODEL, extra_args=["--threads", "1"])
        # no key given: the engine makes one and writes it to the temp directory
        for name in ("LIGHTNING_GRPC_ENGINE_ADMIN_KEY", "LIGHTNING_GRPC_ENGINE_API_KEY"):
            engine.env.pop(name, None)
        with engine:
            written = next(line for line in engine.lines if "event=engine_admin_key_written" in line)
            path = Path(written.split("file=", 1)[1].split()[0])
            existed = (
                path.is_file()
                and stat.S_IMODE(path.stat().st_mode) == 0o600
                and bool(path.read_text().strip())
            )
            assert engine.proc is not None
            engine.proc.send_signal(sig)
            engine.proc.wait(30)
        return path, existed, engine

    path, existed, engine = await asyncio.to_thread(serve_then_signal)
    assert path.parent == Path(tempfile.gettempdir()) and path.name.endswith(".admin-key")
    assert existed  # there while the engine ran, readable by its user only
    assert engine.proc is not None and engine.proc.returncode == 0
    assert any("event=engine_stopped" in line for line in engine.lines)
    assert not path.exists()


async def test_an_admin_key_file_named_by_the_user_is_left_in_place(model_dir: Path, tmp_path: Path) -> None:
    server = await start_engine(model_dir, served_model_name=MODEL)
    default_file = server.admin_key_file
    await server.stop()
    assert default_file is not None and not default_file.exists()  # the engine's own: gone with it
    keyfile = tmp_path / "engine.admin-key"
    server = await start_engine(model_dir, served_model_name=MODEL, admin_key_file=keyfile)
    await server.stop()
    assert server.admin_key_file == keyfile and keyfile.read_text().strip() == server.admin_key
