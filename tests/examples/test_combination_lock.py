"""The combination-lock task (rewards, parsing, transcripts, the agent over HTTP) and the direct-generation loop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from lightning_grpc.examples import combination_lock as lock
from lightning_grpc.types import LLM, Rollout

# ================================================================ tasks


def test_tasks_are_jsonable_and_val_is_held_out(tmp_path: Path) -> None:
    train, val = lock.train_tasks(), lock.val_tasks()
    assert len(train) == 32 and len(val) == 8
    assert len({t["task_id"] for t in train + val}) == len(train) + len(val)
    assert not {t["lock"] for t in train} & {t["lock"] for t in val}
    train_openings = {t["prompt"].replace(t["lock"], "{lock}").split(".")[0] for t in train}
    val_openings = {t["prompt"].replace(t["lock"], "{lock}").split(".")[0] for t in val}
    assert len(train_openings) == len(lock.TRAIN_OPENINGS) == 4 and len(val_openings) == 1
    assert not train_openings & val_openings  # other wording too
    assert {t["code"] for t in train + val} == {lock.CODE}  # the same rule
    for task in train + val:
        assert lock.CODE[0] not in task["prompt"] and lock.CODE[1] not in task["prompt"]  # never told
    # Half of the training locks arrive with the first digit entered; validation locks never do.
    assert [t["preset"] for t in train] == [0] * 16 + [1] * 16
    assert all(t["prompt"].endswith("Enter the second digit.") for t in train[16:])
    assert all(t["preset"] == 0 and t["prompt"].endswith("Enter the first digit.") for t in train[:16] + val)
    assert lock.train_tasks(half_open=False) == train[:16]
    path = lock.write_jsonl(train + val, tmp_path / "tasks.jsonl")
    assert lock.read_jsonl(path) == train + val
    assert json.loads(path.read_text().splitlines()[0])["task_id"] == "train-00"


@pytest.mark.parametrize(
    ("text", "digit"),
    [
        ("3", "3"),
        (" 7<", "7"),
        ("I press 7, then 3", "7"),
        ("x12", "1"),
        ("three", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_digit_takes_the_first_digit(text: str | None, digit: str | None) -> None:
    assert lock.parse_digit(text) == digit


@pytest.mark.parametrize(
    ("replies", "reward", "presses"),
    [
        (["3", "7"], 1.0, 2),  # opens in two presses: the episode ends there
        (["3", "7", "7"], 1.0, 2),  # a reply after the lock opened is never asked for
        (["3", "5", "7"], 1.0, 3),  # one mistake is allowed
        (["1", "3", "7"], 1.0, 3),
        (["3", "3", "3"], 0.5, 3),
        (["1", "2", "3"], 0.5, 3),
        (["7", "3", "9"], 0.5, 3),
        (["no digit", "", "I don't know"], 0.0, 3),
        (["37", "7"], 1.0, 2),  # "37" presses 3
    ],
)
def test_rewards(replies: list[str], reward: float, presses: int) -> None:
    episode = lock.play(lock.train_tasks()[0], replies)
    assert episode.done
    assert episode.reward == reward
    assert len(episode.presses) == presses
    assert episode.opened == (reward == 1.0)


@pytest.mark.parametrize(
    ("replies", "reward", "presses"),
    [(["7"], 1.0, 1), (["3", "3", "7"], 1.0, 3), (["3", "3", "3"], 0.5, 3), ([""] * 3, 0.5, 3)],
)
def test_rewards_of_a_half_open_lock(replies: list[str], reward: float, presses: int) -> None:
    """The entered digit counts: the reward is still the fraction of the code unlocked."""
    task = lock.train_tasks()[16]
    assert lock.Episode(task).unlocked == 1
    episode = lock.play(task, replies)
    assert (episode.reward, len(episode.presses)) == (reward, presses)


def test_make_task_checks_its_arguments() -> None:
    with pytest.raises(ValueError):
        lock.make_task("t", "door", "The {lock}.", code="3a")
    with pytest.raises(ValueError):
        lock.make_task("t", "door", "The {lock}.", preset=2)
    assert lock.make_task("t", "door", "The {lock}.")["prompt"] == "The door. Enter the first digit."


def test_the_conversation_the_agent_sees() -> None:
    task = lock.train_tasks()[0]
    episode = lock.Episode(task)
    assert episode.messages == [{"role": "user", "content": task["prompt"]}]
    assert episode.turn == 0
    assert episode.answer("3") == "Click. Enter the second digit."
    assert episode.answer("hmm") == "Wrong. Enter the second digit."
    assert episode.turn == 2 and not episode.done
    assert episode.answer("7 please") is None
    assert episode.done and episode.reward == 1.0
    assert [m["role"] for m in episode.messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert [p.digit for p in episode.presses] == ["3", None, "7"]
    assert [p.right for p in episode.presses] == [True, False, True]
    with pytest.raises(RuntimeError):
        episode.answer("7")
    # A wrong first press asks for the first digit again.
    assert lock.Episode(task).answer("5") == "Wrong. Enter the first digit."


def test_render_transcript() -> None:
    opened = lock.render_transcript(lock.play(lock.val_tasks()[0], ["3", "7"]))
    assert "[val-00] yellow trunk" in opened
    assert "assistant  3" in opened and "Click. Enter the second digit." in opened
    assert opened.endswith("Click. The lock opens.  reward=1.00")
    stuck = lock.render_transcript(lock.play(lock.val_tasks()[0], ["a\nb", "3", "3"]))
    assert "a\\nb" in stuck  # one line per message
    assert stuck.endswith("Out of presses: 1 of 2 digits unlocked.  reward=0.50")


def test_call_seeds_and_sampling() -> None:
    seed = lock.call_seed("ro-1", 0)
    assert seed == lock.call_seed("ro-1", 0)
    assert 0 <= seed < 2**63
    assert len({lock.call_seed("ro-1", 0), lock.call_seed("ro-1", 1), lock.call_seed("ro-2", 0)}) == 3
    task = lock.train_tasks()[0]
    assert lock.sampling_for(task) == lock.DEFAULT_SAMPLING
    assert lock.sampling_for(task, {"temperature": 0.5, "n": 3})["temperature"] == 0.5
    assert lock.sampling_for({**task, "sampling": {"max_tokens": 2}}, {"max_tokens": 5})["max_tokens"] == 2


# ================================================================ the agent over an OpenAI-compatible endpoint


async def test_agent_plays_through_the_chat_api() -> None:
    """The agent sends the whole conversation, the sampling parameters and a per-call seed."""
    requests: list[dict[str, Any]] = []
    replies = iter(["4", "3", "7"])

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append(body)
        return web.json_response(
            {
                "id": f"c{len(requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": next(replies)},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        llm = LLM(
            endpoint=f"http://127.0.0.1:{port}/v1", model="policy", sampling_parameters={"max_tokens": 3}
        )
        task = lock.train_tasks()[1]
        reward = await lock.agent.rollout(task, {"main_llm": llm}, Rollout(rollout_id="ro-42"))
    finally:
        await runner.cleanup()
    assert reward == 1.0
    assert len(requests) == 3
    assert [len(r["messages"]) for r in requests] == [1, 3, 5]
    assert requests[2]["messages"][-1] == {"role": "user", "content": "Click. Enter the second digit."}
    assert [r["seed"] for r in requests] == [lock.call_seed("ro-42", i) for i in range(3)]
    assert all(r["max_tokens"] == 3 and r["temperature"] == 1.0 and r["model"] == "policy" for r in requests)


# ================================================================ the direct-generation loop


def test_direct_generation_samples_as_the_engine_does(tiny_model: Path) -> None:
    """Same prompts and seeds: the engine's scheduler and the direct generator give the same tokens."""
    import threading

    from bench.direct import DirectGenerator, Sampling
    from lightning_grpc.engine.protocol import SamplingParams
    from lightning_grpc.engine.scheduler import Scheduler, StepEvent, Submission
    from lightning_grpc.engine.server import load_model, load_tokenizer, stop_token_ids

    torch.set_num_threads(1)
    model, tokenizer = load_model(tiny_model), load_tokenizer(tiny_model)
    generator = DirectGenerator(model, tokenizer)
    episodes = [lock.Episode(t) for t in lock.train_tasks()[:3]]
    episodes[2].answer("5")  # a longer, second-turn prompt in the batch
    prompts = [generator.chat_prompt(e.messages) for e in episodes]
    seeds = [lock.call_seed(f"ro-{i}", 0) for i in range(len(prompts))]
    direct = generator.generate(prompts, Sampling(temperature=1.0, top_p=0.9, max_tokens=6), seeds)

    scheduler = Scheduler(
        model, load_tokenizer(tiny_model), eos_ids=stop_token_ids(model, tokenizer), threads=1
    )
    scheduler.start()
    try:
        engine: list[list[int]] = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            got: list[int] = []
            finished = threading.Event()

            def sink(event: StepEvent, got: list[int] = got, finished: threading.Event = finished) -> None:
                for update in event.updates:
                    got.extend(update.token_ids)
                    if update.finish_reason:
                        finished.set()

            params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=seed)
            scheduler.submit(Submission("r", [prompt], [params], 1, sink))
            assert finished.wait(30)
            engine.append(got)
    finally:
        scheduler.close()
    assert [d.token_ids for d in direct] == engine
    for out in direct:
        assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def _direct_config(model: Path, **overrides: Any) -> Any:
    from bench.direct import DirectConfig

    options: dict[str, Any] = {
        "model_path": str(model),
        "seed": 3,
        "steps": 3,
        "tasks_per_step": 4,
        "group_size": 4,
        "max_tokens": 2,
        "eval_every": 0,
        "eval_samples": 2,
        "verbose": False,
    }
    options.update(overrides)
    return DirectConfig(**options)


def test_direct_runs_repeat_exactly(tiny_model: Path) -> None:
    from bench.direct import run_direct

    torch.set_num_threads(1)
    first = run_direct(_direct_config(tiny_model, lr=1e-2))
    second = run_direct(_direct_config(tiny_model, lr=1e-2))
    assert len(first.steps) == 3 and len(first.evals) == 2  # before the first step and after the last
    timings = {"generate_seconds", "template_seconds", "update_seconds", "step_seconds", "elapsed"}

    def results(history: Any) -> list[dict[str, float]]:
        return [{k: v for k, v in step.items() if k not in timings} for step in history.steps]

    assert results(first) == results(second)  # rewards, tokens, entropy, grad norm: all of it
    assert [e["reward"] for e in first.evals] == [e["reward"] for e in second.evals]
    assert first.evals[-1]["transcript"] == second.evals[-1]["transcript"]
    other = run_direct(_direct_config(tiny_model, lr=1e-2, seed=4))
    assert [s["entropy"] for s in other.steps] != [s["entropy"] for s in first.steps]  # other samples


def test_rows_as_the_trainer_makes_them(tiny_model: Path) -> None:
    """Transition: one row per call; trajectory: calls merged into one row per rollout, or one row per call
    (a fallback, its extra rows counted as breaks) when a re-rendered prompt breaks the prefix. The same
    response tokens are trained either way."""
    from bench.direct import (
        DirectGenerator,
        Sampling,
        build_update,
        flat_groups,
        play_rollouts,
    )
    from lightning_grpc.engine.server import load_model, load_tokenizer

    torch.set_num_threads(1)
    generator = DirectGenerator(load_model(tiny_model), load_tokenizer(tiny_model))
    tasks = lock.train_tasks()
    items = [(tasks[i], f"ro-{i}-{k}", f"g{i}") for i in (0, 1, 16) for k in range(4)]
    played, timing = play_rollouts(generator, items, Sampling(1.0, 1.0, 3))
    calls = sum(len(p.calls) for p in played)
    assert timing["calls"] == calls
    assert all(len(p.calls) == len(p.episode.presses) for p in played)
    assert all(len(p.calls) >= 2 for p in played if p.episode.task["preset"] == 0)
    transition, counts = build_update(played, "transition", generator.pad_id)
    assert counts["rows"] == calls
    trajectory, counts = build_update(played, "trajectory", generator.pad_id)
    assert len(played) <= counts["rows"] == len(played) + counts["breaks"]
    for update in (transition, trajectory):
        assert update.arrays["response_mask"].sum() == sum(
            len(c.generated.token_ids) for p in played for c in p.calls
        )
        assert set(update.uid) == {"g0", "g1", "g16"}
        assert sorted(set(update.arrays["rollout_rewards"])) == sorted({p.reward for p in played})
    assert flat_groups(played) == {
        g for g in ("g0", "g1", "g16") if len({p.reward for p in played if p.group == g}) == 1
    }


@pytest.mark.timeout(300)
def test_direct_training_improves_the_validation_reward(tiny_model: Path) -> None:
    """20 GRPO steps (16 locks x 8 samples, lr 5e-3) take the sampled validation reward (8 held-out locks x 4
    samples) from about 0 to about 0.45: measured +0.42, +0.45 and +0.48 for seeds 0-2, about 35 s each on
    2 cores with one torch thread. The test asks for half of the smallest gain."""
    from bench.direct import run_direct, summarize

    torch.set_num_threads(1)
    config = _direct_config(
        tiny_model, seed=0, steps=20, tasks_per_step=16, group_size=8, max_tokens=4, lr=5e-3, eval_samples=4
    )
    history = run_direct(config)
    before, after = history.evals[0]["reward"], history.evals[-1]["reward"]
    assert before < 0.1
    assert after - before >= 0.2, (before, after)
    summary = summarize(history)
    assert summary["steps"] == 20 and summary["rollouts_per_second_loop"] > 0
    assert history.steps[-1]["reward"] > history.steps[0]["reward"]


def test_a_lock_that_moves_on_asks_each_digit_once_in_exactly_two_calls() -> None:
    [task] = lock.moving_on([lock.train_tasks(half_open=False)[0]])
    assert task["prompt"] == lock.train_tasks(half_open=False)[0]["prompt"] and task["max_presses"] == 2
    wrong_then_right = lock.play(task, ["5", "7", "3"])
    assert [p.right for p in wrong_then_right.presses] == [False, True]  # the third reply is never asked for
    assert wrong_then_right.reward == 0.5 and wrong_then_right.done and not wrong_then_right.opened
    assert wrong_then_right.messages[2]["content"] == "Wrong. Enter the second digit."
    opened = lock.play(task, ["3", "7"])
    assert opened.reward == 1.0 and opened.opened and len(opened.presses) == 2
    assert lock.play(task, ["no digit", "x"]).reward == 0.0
