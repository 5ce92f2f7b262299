"""Direct-generation GRPO: the model generates in-process, no Store, Proxy, engine or gRPC in between.

The peer of the full loop (runners → Proxy → engine, Trainer batches, learner), with the same task
functions (:mod:`lightning_grpc.examples.combination_lock`), the same sampling and the same learner:

1. Each step draws ``tasks_per_step`` training tasks and plays each ``group_size`` times (one GRPO group
   per task). All rollouts of the step generate together, turn by turn: the conversations still going
   are rendered with the model's chat template exactly as the engine renders a chat request
   (``add_generation_prompt=True``, tokenized without special tokens), left-padded into one batch,
   prefilled, then decoded with a KV cache for up to ``max_tokens`` tokens, stopping a row at EOS.
2. Sampling is the engine's: temperature, top-p, inverse-CDF draws with one uniform number per token
   from a generator seeded per call (:func:`~lightning_grpc.examples.combination_lock.call_seed` of the
   rollout id and the call's index, as the agent passes ``seed``), log-probs of the raw distribution,
   the reply text decoded as the engine streams it (special tokens skipped). A run is repeatable.
3. Each call becomes a triplet (prompt ids, response ids, log-probs, the reward on the last call), and the
   adapter's own :func:`~lightning_grpc.triplets.rows_from_triplets` makes the rows (``transition``: one
   per call; ``trajectory``: calls merged while each prompt extends the previous prompt and response),
   packed and padded with :mod:`.tensors` as the Trainer does, then one :meth:`Learner.update`.
4. The sampling model *is* the learner's model (the same object), so each step samples from the
   weights of the last update.
5. Every ``eval_every`` steps (and before the first), the validation tasks are played ``eval_samples``
   times each, by default with the training sampling (temperature 1: the reward the policy actually
   earns); ``eval_temperature=0`` evaluates greedily.
6. Tasks are drawn, and groups and rollouts named, as the experiment loop (``lightning_grpc.training.loop``)
   draws and names them (:func:`step_items`), so the per-call seeds are the same in both loops: at step 1,
   with the same initial weights, the two loops play the very same rollouts.

    python -m bench.direct --model /tmp/tiny --steps 300 --stop-at 0.8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lightning_grpc.batching.tensors import PackRow, pack, pad
from lightning_grpc.engine.protocol import SamplingParams
from lightning_grpc.engine.scheduler import prefill, with_cache
from lightning_grpc.engine.text import OutputText
from lightning_grpc.examples import combination_lock as lock
from lightning_grpc.training import ppo
from lightning_grpc.training.experiment import read_tasks
from lightning_grpc.training.learner import Learner, OptimConfig, UpdateInput
from lightning_grpc.triplets import Triplet, rows_from_triplets

SEED_MODULUS = 2**63


# ================================================================ configuration
@dataclass
class DirectConfig:
    """One direct-generation GRPO run. The defaults are the settings that learned the combination lock
    fastest and reliably on a 2-core CPU (validation reward 0 to over 0.8 in 55-75 steps, 72-90 s, over
    four seeds); lr 5e-3 was no faster over two seeds, 1e-2 collapsed."""

    model_path: str
    seed: int = 0
    #: Names the rollouts and groups as the experiment loop does (``experiment.name``), hence their seeds.
    name: str = "combination-lock"
    #: Stop after this many updates, or this many seconds, or once a validation reward reaches ``stop_at``.
    steps: int = 300
    max_seconds: float | None = None
    stop_at: float | None = None
    tasks_per_step: int = 16
    group_size: int = 8
    aggregation: Literal["transition", "trajectory"] = "transition"
    lr: float = 3e-3
    ppo_epochs: int = 1
    loss_agg_mode: ppo.LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    max_grad_norm: float = 1.0
    #: Leave groups whose rollouts all earned the same reward (zero advantage, zero gradient) out of the
    #: update, and skip the update when no group is left (DAPO's group filter; the full loop trains them).
    skip_flat_groups: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 4
    #: Evaluate every this many steps (0: only before and after); each val task ``eval_samples`` times.
    eval_every: int = 5
    eval_samples: int = 8
    #: None: the training temperature (sampled); 0: greedy.
    eval_temperature: float | None = None
    #: torch threads (None: leave torch's setting alone).
    threads: int | None = 1
    #: Task lists (default: the combination lock's train and val tasks).
    train_tasks: list[dict[str, Any]] | None = None
    val_tasks: list[dict[str, Any]] | None = None
    #: Print one line per step and per evaluation.
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.aggregation not in ("transition", "trajectory"):
            raise ValueError(f"aggregation must be 'transition' or 'trajectory', got {self.aggregation!r}")
        for name in ("tasks_per_step", "group_size", "max_tokens", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.temperature <= 0:
            raise ValueError("temperature must be greater than 0 (the learner scores tokens at it)")


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int


# ================================================================ generation
@dataclass
class Generated:
    """One call's output, as the engine would return it."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class DirectGenerator:
    """Batched sampling from a causal LM with the engine's rules (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from lightning_grpc.engine.server import stop_token_ids

        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(stop_token_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids of a chat request, rendered as the engine renders it."""
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=None,
            tokenize=False,
            add_generation_prompt=True,
            continue_final_message=False,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[list[int]], sampling: Sampling, seeds: Sequence[int]
    ) -> list[Generated]:
        """One reply per prompt, all prompts in one batch; ``seeds[i]`` seeds row ``i``'s draws."""
        batch = len(prompts)
        if batch == 0:
            return []
        logits, cache, mask = prefill(self.model, prompts, self.pad_id)
        greedy = sampling.temperature == 0.0
        generators = [None if greedy else torch.Generator().manual_seed(s % SEED_MODULUS) for s in seeds]
        params = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature)
        texts = [OutputText(self.tokenizer, params) for _ in range(batch)]
        tokens_out: list[list[int]] = [[] for _ in range(batch)]
        logprobs_out: list[list[float]] = [[] for _ in range(batch)]
        finish: list[str | None] = [None] * batch
        while True:
            active = [i for i in range(batch) if finish[i] is None]
            tokens = self._sample(logits, sampling, generators, active)
            raw = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
            chosen = tokens.tolist()
            for i in active:
                token = chosen[i]
                tokens_out[i].append(token)
                logprobs_out[i].append(raw[i])
                texts[i].add(token)
                if token in self.eos_ids:
                    finish[i] = "stop"
                elif len(tokens_out[i]) >= sampling.max_tokens:
                    finish[i] = "length"
                if finish[i] is not None:
                    texts[i].finish()
            if all(f is not None for f in finish):
                break
            positions = mask.sum(1, keepdim=True)
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions,
                **with_cache(self.model, cache),
                use_cache=True,
            )
            logits = out.logits[:, -1, :].float()
        return [
            Generated(tokens_out[i], logprobs_out[i], texts[i].text, finish[i] or "length")
            for i in range(batch)
        ]

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        sampling: Sampling,
        generators: Sequence[torch.Generator | None],
        active: list[int],
    ) -> torch.Tensor:
        """The engine's draw: temperature, top-p, then the inverse CDF at one uniform number per row."""
        if sampling.temperature == 0.0:
            return logits.argmax(dim=-1)
        scaled = logits / sampling.temperature
        if sampling.top_p < 1.0:
            ordered, order = scaled.sort(dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs > sampling.top_p, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)
        cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
        uniform = torch.full((logits.shape[0],), 0.5)
        for i in active:
            generator = generators[i]
            assert generator is not None
            uniform[i] = torch.rand(1, generator=generator)[0]
        target = (1.0 - uniform[:, None]) * cdf[:, -1:]
        return torch.searchsorted(cdf, target)[:, 0].clamp(max=cdf.shape[1] - 1)


# ================================================================ playing
@dataclass
class Call:
    prompt_ids: list[int]
    generated: Generated


@dataclass
class Played:
    """One rollout played: its id, group, episode and LLM calls."""

    rollout_id: str
    group: str
    episode: lock.Episode
    calls: list[Call] = field(default_factory=list)

    @property
    def reward(self) -> float:
        return self.episode.reward


def play_rollouts(
    generator: DirectGenerator,
    items: Sequence[tuple[Mapping[str, Any], str, str]],
    sampling: Sampling,
) -> tuple[list[Played], dict[str, float]]:
    """Play ``(task, rollout_id, group)`` items together, turn by turn; returns them and timings."""
    played = [Played(rollout_id, group, lock.Episode(task)) for task, rollout_id, group in items]
    template_seconds = 0.0
    calls = 0
    while True:
        active = [p for p in played if not p.episode.done]
        if not active:
            break
        started = time.perf_counter()
        prompts = [generator.chat_prompt(p.episode.messages) for p in active]
        template_seconds += time.perf_counter() - started
        seeds = [lock.call_seed(p.rollout_id, p.episode.turn) for p in active]
        for p, prompt, out in zip(active, prompts, generator.generate(prompts, sampling, seeds), strict=True):
            p.calls.append(Call(prompt, out))
            p.episode.answer(out.text)
        calls += len(active)
    return played, {"template_seconds": template_seconds, "calls": float(calls)}


def flat_groups(played: Sequence[Played]) -> set[str]:
    """Groups whose rollouts all earned the same reward: their GRPO advantages are all zero."""
    rewards: dict[str, set[float]] = {}
    for rollout in played:
        rewards.setdefault(rollout.group, set()).add(rollout.reward)
    return {group for group, values in rewards.items() if len(values) == 1}


def triplets_of(played: Played, policy_version: int = 0) -> list[Triplet]:
    """The rollout's calls as the adapter's triplets; the rollout's reward goes to the last call."""
    last = len(played.calls) - 1
    return [
        Triplet(
            prompt_ids=np.asarray(call.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(call.generated.token_ids, dtype=np.int32),
            logprobs=np.asarray(call.generated.logprobs, dtype=np.float32),
            reward=played.reward if index == last else None,
            span_id=f"{played.rollout_id}:{index}",
            response_id="",
            model="direct",
            policy_version=policy_version,
            call_index=index,
            agent_name="",
            finish_reason=call.generated.finish_reason,
            streamed=False,
        )
        for index, call in enumerate(played.calls)
    ]


def build_update(
    played: Sequence[Played], aggregation: str, pad_token_id: int, policy_version: int = 0
) -> tuple[UpdateInput, dict[str, float]]:
    """The learner's input for a step's rollouts (rows as the Trainer makes them) and row counts."""
    rows: list[PackRow] = []
    uid: list[str] = []
    breaks = 0
    for index, rollout in enumerate(played):
        aggregated = rows_from_triplets(triplets_of(rollout, policy_version), aggregation)
        breaks += len(aggregated.breaks)
        for row in aggregated.rows:
            rows.append(
                PackRow(
                    row.prompt_ids,
                    row.response_ids,
                    row.response_mask,
                    row.logprobs,
                    row.reward,
                    rollout.reward,
                    index,
                )
            )
            uid.append(rollout.group)
    arrays = pad(pack(rows), pad_token_id=pad_token_id)
    return UpdateInput(arrays, np.asarray(uid, dtype=object)), {
        "rows": float(len(rows)),
        "breaks": float(breaks),
    }


# ================================================================ the loop
@dataclass
class DirectHistory:
    """What a run did: one record per step and per evaluation, and the run's totals."""

    config: dict[str, Any]
    steps: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def first_eval_reaching(self, threshold: float) -> dict[str, Any] | None:
        """The first evaluation whose reward is at least ``threshold`` (None if none)."""
        return next((e for e in self.evals if e["reward"] >= threshold), None)

    def to_json(self) -> str:
        return json.dumps(
            {"config": self.config, "steps": self.steps, "evals": self.evals, "seconds": self.seconds}
        )


def step_items(
    tasks: Sequence[Mapping[str, Any]], groups: int, group_size: int, *, seed: int, name: str, tag: str
) -> list[tuple[Mapping[str, Any], str, str]]:
    """``(task, rollout id, group id)`` of one step's rollouts, chosen and named as the experiment loop
    (:meth:`lightning_grpc.training.loop.Experiment.submit`) does: tasks drawn by ``random.Random(f"{seed}-{tag}")``,
    group ids ``{name}-{tag}-g{i}``, rollout ids ``{group}-r{k}``. Same ids, same per-call seeds: at equal weights
    the two loops sample the same tokens."""
    if groups <= 0:
        return []
    rng = random.Random(f"{seed}-{tag}")
    chosen = [tasks[i % len(tasks)] for i in rng.sample(range(max(groups, len(tasks))), groups)]
    items = []
    for i, task in enumerate(chosen):
        group = f"{name}-{tag}-g{i}"
        items += [(task, f"{group}-r{k}", group) for k in range(group_size)]
    return items


def evaluate(
    generator: DirectGenerator,
    tasks: Sequence[Mapping[str, Any]],
    sampling: Sampling,
    samples: int,
    *,
    seed: int,
    name: str,
    step: int,
) -> dict[str, Any]:
    """The mean reward over ``samples`` plays of each task, with the experiment loop's validation ids."""
    items = step_items(tasks, len(tasks), samples, seed=seed, name=name, tag=f"v{step}")
    started = time.perf_counter()
    played, _ = play_rollouts(generator, items, sampling)
    rewards = np.asarray([p.reward for p in played], dtype=np.float64)
    return {
        "reward": float(rewards.mean()),
        "solved": float((rewards >= 1.0).mean()),
        "rollouts": len(played),
        "seconds": time.perf_counter() - started,
        "transcript": lock.render_transcript(played[0].episode),
    }


def run_direct(config: DirectConfig, log: Callable[[str], None] | None = None) -> DirectHistory:
    """Train with direct generation until ``steps``, ``max_seconds`` or ``stop_at``; returns the history."""
    from lightning_grpc.engine.server import load_tokenizer

    say = log or (lambda line: print(line, flush=True))
    if not config.verbose:
        say = lambda line: None  # noqa: E731
    if config.threads:
        torch.set_num_threads(config.threads)
    train = config.train_tasks if config.train_tasks is not None else lock.train_tasks()
    val = config.val_tasks if config.val_tasks is not None else lock.val_tasks()
    learner = Learner(
        config.model_path,
        ppo_config=ppo.PPOConfig(loss_agg_mode=config.loss_agg_mode, entropy_coeff=config.entropy_coeff),
        optim=OptimConfig(
            lr=config.lr,
            ppo_epochs=config.ppo_epochs,
            temperature=config.temperature,
            max_grad_norm=config.max_grad_norm,
        ),
        device="cpu",
        seed=config.seed,
    )
    generator = DirectGenerator(learner.model, load_tokenizer(config.model_path))
    sampling = Sampling(config.temperature, config.top_p, config.max_tokens)
    eval_sampling = Sampling(
        config.temperature if config.eval_temperature is None else config.eval_temperature,
        config.top_p,
        config.max_tokens,
    )
    history = DirectHistory(
        config={k: v for k, v in asdict(config).items() if k not in ("train_tasks", "val_tasks")}
    )
    started = time.perf_counter()

    def run_eval(step: int) -> float:
        record = evaluate(
            generator, val, eval_sampling, config.eval_samples, seed=config.seed, name=config.name, step=step
        )
        record.update(step=step, elapsed=time.perf_counter() - started)
        history.evals.append(record)
        say(
            f"eval step={step:4d} val_reward={record['reward']:.3f} val_solved={record['solved']:.3f} "
            f"seconds={record['seconds']:.2f} elapsed={record['elapsed']:.1f}"
        )
        return float(record["reward"])

    val_reward = run_eval(0)
    for step in range(1, config.steps + 1):
        step_started = time.perf_counter()
        items = step_items(
            train,
            config.tasks_per_step,
            config.group_size,
            seed=config.seed,
            name=config.name,
            tag=f"s{step}",
        )
        played, timing = play_rollouts(generator, items, sampling)
        generated = time.perf_counter()
        flat = flat_groups(played)
        trained = [p for p in played if p.group not in flat] if config.skip_flat_groups else played
        metrics: dict[str, float] = {}
        counts = {"rows": 0.0, "breaks": 0.0}
        if trained:
            update, counts = build_update(
                trained, config.aggregation, generator.pad_id, policy_version=step - 1
            )
            metrics = learner.update(update)
        done = time.perf_counter()
        rewards = np.asarray([p.reward for p in played], dtype=np.float64)
        record = {
            "step": float(step),
            "reward": float(rewards.mean()),
            "solved": float((rewards >= 1.0).mean()),
            "zero_variance_groups": float(len(flat)),
            "entropy": metrics.get("entropy", math.nan),
            "grad_norm": metrics.get("grad_norm", math.nan),
            "rollouts": float(len(played)),
            "trained_rollouts": float(len(trained)),
            "calls": timing["calls"],
            "rows": counts["rows"],
            "trajectory_breaks": counts["breaks"],
            "tokens": metrics.get("tokens", 0.0),
            "generate_seconds": generated - step_started,
            "template_seconds": timing["template_seconds"],
            "update_seconds": done - generated,
            "step_seconds": done - step_started,
            "elapsed": done - started,
        }
        history.steps.append(record)
        say(
            f"step={step:4d} reward={record['reward']:.3f} solved={record['solved']:.3f} "
            f"flat_groups={int(record['zero_variance_groups']):2d} entropy={record['entropy']:.2f} "
            f"gen={record['generate_seconds']:.2f}s update={record['update_seconds']:.2f}s "
            f"elapsed={record['elapsed']:.1f}s"
        )
        last = step == config.steps
        out_of_time = config.max_seconds is not None and done - started >= config.max_seconds
        if (config.eval_every and step % config.eval_every == 0) or last or out_of_time:
            val_reward = run_eval(step)
            if config.stop_at is not None and val_reward >= config.stop_at:
                break
        if out_of_time:
            break
    history.seconds = time.perf_counter() - started
    return history


def summarize(history: DirectHistory, threshold: float = 0.8) -> dict[str, Any]:
    """Steps and seconds to the first evaluation at ``threshold``, and mean per-step costs."""
    hit = history.first_eval_reaching(threshold)
    steps = history.steps
    mean = lambda name: float(np.mean([s[name] for s in steps])) if steps else math.nan  # noqa: E731
    total_gen = sum(s["generate_seconds"] for s in steps)
    total_step = sum(s["step_seconds"] for s in steps)
    rollouts = sum(s["rollouts"] for s in steps)
    return {
        "initial_val": history.evals[0]["reward"] if history.evals else math.nan,
        "final_val": history.evals[-1]["reward"] if history.evals else math.nan,
        "threshold": threshold,
        "steps_to_threshold": None if hit is None else hit["step"],
        "seconds_to_threshold": None if hit is None else hit["elapsed"],
        "steps": len(steps),
        "generate_seconds_per_step": mean("generate_seconds"),
        "update_seconds_per_step": mean("update_seconds"),
        "step_seconds": mean("step_seconds"),
        "rollouts_per_second_generation": rollouts / total_gen if total_gen else math.nan,
        "rollouts_per_second_loop": rollouts / total_step if total_step else math.nan,
        "seconds": history.seconds,
    }


# ================================================================ command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model directory (lightning-grpc init-model)")
    parser.add_argument("--json", help="write the history here")
    parser.add_argument(
        "--train-tasks",
        help="a JSONL task file (default: the combination lock's locks, half of them half open)",
    )
    parser.add_argument(
        "--val-tasks", help="a JSONL task file (default: the combination lock's held-out locks)"
    )
    defaults = DirectConfig(model_path="")
    for name in (
        "seed",
        "name",
        "steps",
        "max_seconds",
        "stop_at",
        "tasks_per_step",
        "group_size",
        "aggregation",
        "lr",
        "ppo_epochs",
        "loss_agg_mode",
        "entropy_coeff",
        "max_grad_norm",
        "skip_flat_groups",
        "temperature",
        "top_p",
        "max_tokens",
        "eval_every",
        "eval_samples",
        "eval_temperature",
        "threads",
    ):
        default = getattr(defaults, name)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            continue
        kind = int if name == "threads" else type(default) if default is not None else float
        parser.add_argument(flag, type=kind, default=default)
    args = parser.parse_args(argv)
    files = ("model", "json", "train_tasks", "val_tasks")
    options = {k: v for k, v in vars(args).items() if k not in files}
    tasks = {
        name: read_tasks(Path(getattr(args, name)))
        for name in ("train_tasks", "val_tasks")
        if getattr(args, name)
    }
    history = run_direct(DirectConfig(model_path=args.model, **options, **tasks))
    summary = summarize(history, args.stop_at or 0.8)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(history.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
