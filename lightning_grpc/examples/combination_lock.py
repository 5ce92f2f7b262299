"""The combination lock: the toy task of the training demo, small enough for a random 0.25M-parameter model.

A two-digit combination lock. The agent presses one digit per turn and hears "Click." (the digit was
right: the lock moves on to the next one) or "Wrong." (try that digit again). It has three presses;
the lock opens after two right ones and the episode ends there. The reward is the fraction of the
code unlocked: 0, 0.5 or 1. Every lock of the building has the same factory code, 3 then 7, which the
agent is never told: it learns it by trial and error, as a policy that answers "first digit" with 3
and "second digit" with 7, whatever the lock is called::

    user       The red door has a two-digit combination lock. Enter the first digit.
    assistant  3
    user       Click. Enter the second digit.
    assistant  5
    user       Wrong. Enter the second digit.
    assistant  7                                   -> opens: reward 1.0

Why this design (the demo is described in ``docs/training.md``): with GRPO and a random tiny
model, a choice that depends on the last message, or a plain preference, is learned within minutes;
recalling or echoing a digit given in the conversation is not. Here the right digit depends only on the
last message ("first" or "second"), and a right press counts as soon as it is made.

Half of the training locks arrive *half open* (``preset=1``: "The first digit is already entered. Enter
the second digit."). Measured with :mod:`bench.direct`: with full locks only, the second
digit is asked only after a right first press, so the policy first learns "always 3"; its rollouts then
all earn 0.5, every GRPO group is flat (zero advantage, zero gradient) and it stays there (lr 1e-3:
stuck at 0.5 from step 70 on; lr 3e-4 still under 0.05 after 90 steps). With half-open locks both
digits are rewarded from the first step and the policy learns to tell "first" from "second": validation
reward 0 to over 0.8 in 55-75 steps at lr 3e-3. Held-out validation locks are always full (two to three
calls), with names and an opening sentence that training never shows; the rule is the same, so the
validation reward measures the policy rather than memorised lock names. Training words its first message
four ways: with two, one seed in three of the whole system learned to press 3 after those two sentences only
and stayed at 0.5 on the held-out one (``bench/results/defaults_study.md``). A half-open lock can open on
its first call; every full lock takes at least two.

The demo (``examples/combination_lock/``) plays the variant where a wrong digit moves the lock on too
(:func:`moving_on`): the agent enters digit 1, hears "Click." or "Wrong.", enters digit 2 -- always two
calls, reward = right digits / 2. Both digits are asked in every rollout, so no half-open locks are needed
to keep the second digit from being starved.

The pieces are pure and shared by every loop that plays the task: :func:`train_tasks` and
:func:`val_tasks` (JSON-able task dicts), :func:`parse_digit`, :class:`Episode` (the lock's side of the
conversation and the reward), :func:`call_seed` (a per-call sampling seed from the rollout id), the
``@rollout`` :func:`agent` that plays through an OpenAI-compatible endpoint (the Proxy), and
:func:`render_transcript` for a before/after view. ``bench.direct`` plays the same
episodes by generating with the model in-process.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_grpc.runner.agent import rollout as rollout_agent
from lightning_grpc.runner.llm import openai_client
from lightning_grpc.types import LLM, Rollout

#: The code of every lock (the agent is never told it).
CODE = "37"
#: Presses an agent gets: two right ones open the lock, so one mistake is allowed.
MAX_PRESSES = 3
#: Sampling defaults of the task; a task's ``sampling`` entry or the LLM resource's ``sampling_parameters``
#: override them (the task wins).
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 4}

ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")
CLICK, WRONG = "Click.", "Wrong."

TRAIN_LOCKS = (
    "red door",
    "blue gate",
    "garden shed",
    "bike chain",
    "old safe",
    "front door",
    "tool box",
    "back gate",
    "green locker",
    "attic hatch",
    "cellar door",
    "mail box",
    "gym locker",
    "piano lid",
    "wine cabinet",
    "study desk",
)
VAL_LOCKS = (
    "yellow trunk",
    "barn door",
    "school locker",
    "jewel box",
    "garage door",
    "office drawer",
    "boat cabin",
    "secret diary",
)
TRAIN_OPENINGS = (
    "The {lock} has a two-digit combination lock.",
    "You reach the {lock}. It is locked with a two-digit code.",
    "A keypad on the {lock} asks for its two-digit code.",
    "The {lock} will not open without its two-digit code.",
)
VAL_OPENINGS = ("A two-digit combination lock keeps the {lock} shut.",)

_DIGIT = re.compile(r"[0-9]")


# ================================================================ tasks
def make_task(
    task_id: str,
    lock: str,
    opening: str,
    *,
    code: str = CODE,
    split: str = "train",
    preset: int = 0,
    moves_on: bool = False,
) -> dict[str, Any]:
    """One task: the lock's name, the first message the agent sees, and the code (hidden from the agent).

    ``preset``: digits already entered when the agent arrives (the lock asks for the next one).
    """
    if not code or not code.isdigit():
        raise ValueError(f"a code is one or more digits, got {code!r}")
    if not 0 <= preset < len(code):
        raise ValueError(f"preset must leave a digit to enter, got {preset} for a {len(code)}-digit code")
    already = ""
    if preset:
        already = (
            " The first digit is already entered."
            if preset == 1
            else f" The first {preset} digits are entered."
        )
    return {
        "task_id": task_id,
        "split": split,
        "lock": lock,
        "prompt": f"{opening.format(lock=lock)}{already} {ask(preset)}",
        "code": code,
        "preset": preset,
        "max_presses": len(code) - preset if moves_on else MAX_PRESSES,
        "moves_on": moves_on,
    }


def moving_on(tasks: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The same locks where a wrong digit moves the lock on too: the agent enters digit 1, hears "Click." or
    "Wrong.", enters digit 2; always two calls, reward = right digits / 2. The demo plays these: both digits
    are asked in every rollout, so the second is learned alongside the first (no half-open locks needed)."""
    out = []
    for task in tasks:
        moved = make_task(
            str(task["task_id"]),
            str(task["lock"]),
            "{lock}",  # replaced below: keep the task's own opening sentence
            code=str(task["code"]),
            split=str(task["split"]),
            preset=int(task.get("preset", 0)),
            moves_on=True,
        )
        moved["prompt"] = task["prompt"]
        out.append(moved)
    return out


def train_tasks(*, half_open: bool = True) -> list[dict[str, Any]]:
    """The 16 training locks (four opening sentences, in turn), each also half open by default.

    A half-open lock already has its first digit entered and asks for the second: 32 tasks in all. Without
    them (``half_open=False``) the second digit is asked only after a right first press, so the policy
    learns "always 3" first, its rollouts then all earn 0.5 (zero advantage) and it stays there.
    """
    tasks = [
        make_task(f"train-{i:02d}", lock, TRAIN_OPENINGS[i % len(TRAIN_OPENINGS)])
        for i, lock in enumerate(TRAIN_LOCKS)
    ]
    if half_open:
        tasks += [
            make_task(f"train-h{i:02d}", lock, TRAIN_OPENINGS[(i + 1) % len(TRAIN_OPENINGS)], preset=1)
            for i, lock in enumerate(TRAIN_LOCKS)
        ]
    return tasks


def val_tasks() -> list[dict[str, Any]]:
    """The 8 held-out locks: names and an opening sentence that training never shows, the same rule."""
    return [
        make_task(f"val-{i:02d}", lock, VAL_OPENINGS[i % len(VAL_OPENINGS)], split="val")
        for i, lock in enumerate(VAL_LOCKS)
    ]


def write_jsonl(tasks: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(dict(task)) + "\n" for task in tasks), encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# ================================================================ the lock
def ask(position: int) -> str:
    """The lock's request for the digit at ``position`` (0-based)."""
    ordinal = ORDINALS[position] if position < len(ORDINALS) else f"number {position + 1}"
    return f"Enter the {ordinal} digit."


def parse_digit(text: str | None) -> str | None:
    """The digit a reply presses: the first digit character in it; None (a wrong press) when it has none."""
    match = _DIGIT.search(text or "")
    return match.group(0) if match else None


def lock_reward(unlocked: int, code_length: int) -> float:
    """The fraction of the code unlocked."""
    return unlocked / code_length if code_length else 0.0


@dataclass
class Press:
    """One key press: what the agent said, the digit it pressed (None: no digit) and whether it was right."""

    text: str
    digit: str | None
    right: bool


@dataclass
class Episode:
    """The lock's side of one game: the conversation so far, the presses, and the reward.

    Drive it with ``while not episode.done: episode.answer(model_reply(episode.messages))``.
    """

    task: Mapping[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
    presses: list[Press] = field(default_factory=list)
    unlocked: int = 0
    #: The digit the lock asks for next (0-based).
    position: int = 0

    def __post_init__(self) -> None:
        self.unlocked = max(self.unlocked, int(self.task.get("preset", 0)))
        self.position = max(self.position, self.unlocked)
        if not self.messages:
            self.messages = [{"role": "user", "content": str(self.task["prompt"])}]

    @property
    def code(self) -> str:
        return str(self.task["code"])

    @property
    def max_presses(self) -> int:
        return int(self.task.get("max_presses", MAX_PRESSES))

    @property
    def opened(self) -> bool:
        return self.unlocked >= len(self.code)

    @property
    def done(self) -> bool:
        return self.opened or len(self.presses) >= self.max_presses or self.position >= len(self.code)

    @property
    def moves_on(self) -> bool:
        """A wrong digit moves the lock on to the next one too (every digit is asked exactly once)."""
        return bool(self.task.get("moves_on", False))

    @property
    def reward(self) -> float:
        return lock_reward(self.unlocked, len(self.code))

    @property
    def turn(self) -> int:
        """The 0-based index of the next LLM call."""
        return len(self.presses)

    def answer(self, text: str) -> str | None:
        """The agent's reply; returns the lock's next message, or None when the episode is over."""
        if self.done:
            raise RuntimeError("the episode is over")
        digit = parse_digit(text)
        right = digit is not None and digit == self.code[self.position]
        self.presses.append(Press(text, digit, right))
        self.messages.append({"role": "assistant", "content": text})
        if right:
            self.unlocked += 1
        if right or self.moves_on:
            self.position += 1
        if self.done:
            return None
        reply = f"{CLICK if right else WRONG} {ask(self.position)}"
        self.messages.append({"role": "user", "content": reply})
        return reply

    def outcome(self) -> str:
        if self.opened:
            return "Click. The lock opens."
        return f"Out of presses: {self.unlocked} of {len(self.code)} digits unlocked."


def play(task: Mapping[str, Any], replies: Sequence[str]) -> Episode:
    """An episode played with canned replies (tests, docs): stops when the episode ends."""
    episode = Episode(task)
    for text in replies:
        if episode.done:
            break
        episode.answer(text)
    return episode


def render_transcript(episode: Episode, *, width: int = 10) -> str:
    """One episode as text: each message with its role, the lock's verdict and the reward."""
    lines = [f"[{episode.task.get('task_id', '?')}] {episode.task.get('lock', '')}"]
    for message in episode.messages:
        content = message["content"].replace("\n", "\\n")
        lines.append(f"  {message['role']:<{width}} {content}")
    lines.append(f"  {'lock':<{width}} {episode.outcome()}  reward={episode.reward:.2f}")
    return "\n".join(lines)


# ================================================================ sampling
def call_seed(rollout_id: str, call_index: int) -> int:
    """A sampling seed for one LLM call of a rollout: the same rollout replays the same tokens."""
    digest = hashlib.blake2b(f"{rollout_id}:{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # under 2**63, the engine's seed range


def sampling_for(task: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """temperature, top_p and max_tokens: the task's ``sampling`` over ``defaults`` over the task's defaults."""
    out = dict(DEFAULT_SAMPLING)
    out.update({k: v for k, v in (defaults or {}).items() if k in DEFAULT_SAMPLING})
    out.update({k: v for k, v in (task.get("sampling") or {}).items() if k in DEFAULT_SAMPLING})
    return out


# ================================================================ the agent
@rollout_agent
async def agent(task: Mapping[str, Any], llm: LLM, rollout: Rollout | None = None) -> float:
    """Play one lock through the OpenAI-compatible endpoint ``llm`` (the Proxy's route for this attempt).

    Each call sends the whole conversation so far, with the task's sampling parameters and a seed
    derived from the rollout id and the call's index. Returns the reward (the fraction unlocked).
    """
    params = sampling_for(task, llm.sampling_parameters)
    rollout_id = rollout.rollout_id if rollout is not None else ""
    episode = Episode(task)
    client = openai_client(llm)  # the official OpenAI client, over the runner's shared connection pool
    while not episode.done:
        extra: dict[str, Any] = {"seed": call_seed(rollout_id, episode.turn)} if rollout_id else {}
        response = await client.chat.completions.create(
            model=llm.model,
            messages=episode.messages,
            temperature=params["temperature"],
            top_p=params["top_p"],
            max_tokens=params["max_tokens"],
            **extra,
        )
        episode.answer(response.choices[0].message.content or "")
    return episode.reward


#: How the runner command line names the agent.
AGENT_REF = "lightning_grpc.examples.combination_lock:agent"

__all__ = [
    "AGENT_REF",
    "CODE",
    "DEFAULT_SAMPLING",
    "MAX_PRESSES",
    "Episode",
    "Press",
    "agent",
    "ask",
    "call_seed",
    "lock_reward",
    "make_task",
    "parse_digit",
    "play",
    "read_jsonl",
    "render_transcript",
    "sampling_for",
    "train_tasks",
    "val_tasks",
    "write_jsonl",
]
