"""Where a run's metrics go: a CSV (one row per step), TensorBoard when it is installed, a PNG of the reward.

:data:`METRICS` says what each of them is (name, unit, meaning); docs/metrics.md is rendered from it
(``make docs-reference``), and the training tests check that every metric a run writes is in it.
"""

from __future__ import annotations

import csv
import math
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_grpc.batching import batches
from lightning_grpc.triplets import DropReason, FallbackReason

from .signal import CONDITIONS as STALL_CONDITIONS

#: Metrics plotted in the reward figure: (column, label).
REWARD_CURVES = (
    ("reward_mean", "train reward"),
    ("val_reward", "validation reward"),
    ("solved", "train solved"),
)


class MetricsLog:
    """Rows of metrics by step, written to ``metrics.csv`` (rewritten whole, so new columns are welcome)."""

    def __init__(self, directory: Path, *, tensorboard: bool = True) -> None:
        self.directory = directory
        self.csv_path = directory / "metrics.csv"
        self.rows: list[dict[str, Any]] = self._read_existing()
        self.writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(directory / "tensorboard"))
            except ImportError:  # TensorBoard is optional
                self.writer = None

    def _read_existing(self) -> list[dict[str, Any]]:
        """A resumed run keeps the rows written before (up to where it resumes)."""
        if not self.csv_path.exists():
            return []
        with self.csv_path.open() as f:
            rows = [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        for row in rows:  # the step stays a whole number when the file is written again
            row["step"] = int(row.get("step", 0))
        return rows

    def truncate(self, step: int) -> None:
        """Forget rows after ``step`` (a run resumed from an earlier checkpoint writes them again)."""
        self.rows = [r for r in self.rows if int(r.get("step", 0)) <= step]

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.rows = [r for r in self.rows if r.get("step") != step] + [row]
        self._write_csv()
        if self.writer is not None:
            for name, value in metrics.items():
                if math.isfinite(float(value)):
                    self.writer.add_scalar(name, float(value), step)
            self.writer.flush()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add metrics to an existing step's row."""
        row = next((r for r in self.rows if r.get("step") == step), {})
        self.add(step, {**{k: v for k, v in row.items() if k != "step"}, **metrics})

    def _write_csv(self) -> None:
        columns = ["step", *sorted({k for r in self.rows for k in r} - {"step"})]
        tmp = self.csv_path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(self.csv_path)

    def plot(self, path: Path, target: float | None = None) -> Path | None:
        """The reward curves as a PNG (None when matplotlib is missing)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for column, label in REWARD_CURVES:
            points = [(r["step"], r[column]) for r in self.rows if column in r and math.isfinite(r[column])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if column == "val_reward" else None, markersize=3, label=label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def summary_line(step: int, metrics: Mapping[str, float], names: Sequence[str]) -> str:
    parts = [f"step {step:>4}"]
    for name in names:
        if name in metrics and math.isfinite(metrics[name]):
            parts.append(f"{name}={metrics[name]:.3f}")
    return " ".join(parts)


# ------------------------------------------------------------ what each metric is
@dataclass(frozen=True)
class Metric:
    """A column of ``metrics.csv`` (and a metric reported to the Trainer service): its name, unit and meaning.

    A part of the name in angle brackets stands for any text: ``drop_<reason>`` is one column per reason.
    ``meaning`` is Markdown (it is rendered into docs/metrics.md).
    """

    name: str
    unit: str
    meaning: str

    @property
    def is_family(self) -> bool:
        return "<" in self.name

    def matches(self, column: str) -> bool:
        """Whether ``column`` is this metric (its exact name, or a member of its family)."""
        if not self.is_family:
            return column == self.name
        pattern = ".+".join(re.escape(part) for part in re.split(r"<[^>]+>", self.name))
        return re.fullmatch(pattern, column) is not None


def _names(values: Iterable[str]) -> str:
    return ", ".join(f"`{v}`" for v in values)


#: Why a batch leaves something out: the triplets' reasons (calls), and the batch's own by what they count.
_CALL_DROPS = tuple(str(r) for r in DropReason)
_ROLLOUT_FAILURES = (
    batches.ROLLOUT_FAILED,
    batches.ROLLOUT_TIMED_OUT,
    batches.ROLLOUT_UNRESPONSIVE,
    batches.ROLLOUT_CANCELLED,
    batches.NO_REWARD,
)
_ROW_DROPS = (
    batches.PROMPT_TOO_LONG,
    batches.TRUNCATED_PROMPT,
    batches.TRUNCATED_RESPONSE,
    batches.ZERO_TRAINABLE_TOKENS,
)

_CLIPFRAC_NOTE = "[When `pg_clipfrac` is 0](#when-pg_clipfrac-is-0)"

#: Every metric a training run writes to ``metrics.csv`` (and reports to the Trainer service), by group:
#: (group title, what the group's figures have in common, its metrics).
METRIC_GROUPS: tuple[tuple[str, str, tuple[Metric, ...]], ...] = (
    (
        "The step, its batch and the run",
        "What the step trained on: the batch of whole GRPO groups TrainerService cut"
        " ([training data](training-data.md)), what it left out, and what befell the run.",
        (
            Metric(
                "step",
                "step",
                "The training step, 1, 2, ...: the first column of `metrics.csv`; the Trainer service gets it"
                " as the step itself, not as a metric.",
            ),
            Metric(
                "policy_version",
                "version",
                "The policy version the engine serves once the step's weights are loaded (the number of"
                " updates so far): every later LLM call records it.",
            ),
            Metric(
                "batch_rows",
                "rows",
                "Rows of the step's batch (0: the batch was empty, and the step made no update).",
            ),
            Metric(
                "carried_over_groups",
                "groups",
                "Groups still running when the batch was cut: they go into a later batch (`experiment.mode ="
                ' "async"`; sync mode waits for its groups first, so 0).',
            ),
            Metric(
                "truncated_responses",
                "share",
                "The share of the batch's rows whose response reached `sampling.max_tokens` without ending in"
                " a stop token (cut before it ended). Transition rows only (`data.aggregation ="
                ' "transition"`); the no-signal watch\'s `max_tokens` condition reads it.',
            ),
            Metric(
                "drop_<reason>",
                "count",
                "What the batch left out (or cut), counted by reason; written for the reasons that counted"
                " in some step. Calls (and choices, reward spans) the triplets left out:"
                f" {_names(_CALL_DROPS)}, and `{batches.STALE_POLICY}` (sampled more than"
                " `experiment.max_staleness` policy versions ago, async mode). Rollouts that cannot be"
                f" trained as they are: {_names(_ROLLOUT_FAILURES)}; what `data.failure_policy` did with"
                " them:"
                f" `{batches.GROUP_DROPPED}` (groups), `{batches.ROLLOUT_DROPPED}`,"
                f" `{batches.ROLLOUT_FILLED}`"
                f" (trained with `data.fill_reward`); `{batches.ROLLOUT_WITHOUT_ROWS}` (rollouts left with no"
                f" row). Rows, against `data.max_prompt_length` / `max_response_length`: {_names(_ROW_DROPS)}"
                " (truncated rows are kept, cut).",
            ),
            Metric(
                "trajectory_fallback_<reason>",
                "rollouts",
                'Rollouts of the batch whose trajectory rows (`data.aggregation = "trajectory"`) fell back to'
                f" one row per call, by reason: {_names(str(r) for r in FallbackReason)}.",
            ),
            Metric(
                "filtered_groups",
                "groups",
                "With `data.filter_groups` (dynamic sampling): the groups of the step's generation rounds set"
                " aside for having no reward spread (all rollouts the same reward).",
            ),
            Metric(
                "gen_batches",
                "rounds",
                "With `data.filter_groups`: the generation rounds the step played to fill its batch with"
                " groups that have a reward spread (1: the first batch was enough; at most"
                " `data.max_num_gen_batches`).",
            ),
            Metric(
                "filter_groups_capped",
                "1 or 0",
                "With `data.filter_groups`: 1 when the step stopped at `data.max_num_gen_batches` rounds with"
                " groups still missing, and trained on fewer than `data.batch_size` groups.",
            ),
            Metric(
                "temperature_mismatch_rows",
                "rows",
                "Rows of the batch whose calls the proxy recorded at another temperature than"
                " `sampling.temperature` (an agent that sets its own; greedy rows included).",
            ),
            Metric(
                "temperature_greedy_rows",
                "rows",
                "Rows sampled greedily (temperature 0): their log-probs are computed at"
                " `sampling.temperature`.",
            ),
            Metric(
                "temperature_distinct",
                "temperatures",
                "How many different temperatures the batch's rows were sampled at.",
            ),
            Metric(
                "temperature_min", "temperature", "The lowest temperature a row of the batch was sampled at."
            ),
            Metric(
                "temperature_max", "temperature", "The highest temperature a row of the batch was sampled at."
            ),
            Metric(
                "interruptions",
                "count",
                "Interruptions of the run so far, earlier invocations' included (`interruptions.jsonl` in"
                " `experiment.output_dir`: a child restarted, a run resumed after a stop or a kill).",
            ),
        ),
    ),
    (
        "Rewards of the batch",
        "Over the rollouts of the step's batch, each rollout once however many rows it has (with"
        " `--backend verl` too); with `data.filter_groups`, over every group the step's rounds generated,"
        " those set aside included. A rollout `data.failure_policy` dropped does not count; a filled one"
        " counts with `data.fill_reward`. *reward* is the unit of the agent's own rewards.",
        (
            Metric("reward_mean", "reward", "The mean reward of the batch's rollouts."),
            Metric(
                "reward_std",
                "reward",
                "The standard deviation of the batch's rewards (over all its rollouts, not within groups).",
            ),
            Metric(
                "solved",
                "share",
                "The share of the batch's rollouts whose reward is at least `validation.solved_at` (1.0 by"
                " default): `mean(reward >= solved_at)` over the training rollouts (`val_solved` is the"
                " same over the validation rollouts).",
            ),
            Metric(
                "zero_variance_groups",
                "groups",
                "How many GRPO groups of the batch (a count, not a share of `groups`) have rollouts that all"
                " earned the same reward: their advantages are 0, so they add no policy gradient (a group of"
                " one rollout counts too). The no-signal watch's `zero_variance` condition reads it.",
            ),
            Metric("groups", "groups", "GRPO groups in the batch."),
            Metric("rollouts", "rollouts", "Rollouts in the batch."),
        ),
    ),
    (
        "The update",
        "One GRPO/PPO update per step (`lightning_grpc/training/learner.py`, the losses of `ppo.py`):"
        " `optim.ppo_epochs` passes over the batch, each in mini-batches of `optim.mini_batch_rollouts`"
        " rollouts (0: the whole batch), one optimiser step each. Each figure is the mean over the step's"
        " optimiser steps; per-token figures are means over the response tokens the policy generated"
        " (`response_mask` 1). *nats*: natural-log units, as log-probs are. With `--backend verl` these are"
        " verl's (last group).",
        (
            Metric(
                "loss",
                "loss",
                "What the optimiser minimised: `pg_loss - ppo.entropy_coeff * entropy_loss +"
                " ppo.kl_loss_coef * kl_loss`.",
            ),
            Metric(
                "pg_loss",
                "loss",
                "The dual-clip PPO surrogate: per token `max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 +"
                " clip_ratio_high))`, at most `-A * clip_ratio_c` where the advantage `A` is negative, then"
                " aggregated by `ppo.loss_agg_mode`; `r` is the token's probability ratio, new over old"
                f" ({_CLIPFRAC_NOTE} says what the old log-prob is).",
            ),
            Metric(
                "pg_clipfrac",
                "share",
                "The share of response tokens the clip acts on: a positive advantage with `r > 1 +"
                " ppo.clip_ratio_high`, or a negative one with `r < 1 - ppo.clip_ratio_low`. Exactly 0 with"
                " the defaults (one optimiser step per training step, recomputed old log-probs):"
                f" {_CLIPFRAC_NOTE} says why and when it is not.",
            ),
            Metric(
                "pg_clipfrac_lower",
                "share",
                "The share of response tokens the dual clip acts on: a negative advantage with `r` above"
                " `ppo.clip_ratio_c`.",
            ),
            Metric(
                "ppo_kl",
                "nats per token",
                "The mean of `old log-prob - log-prob` over response tokens, before each optimiser step: how"
                " far the weights being trained are from the old log-probs' (0 where `r = 1`;"
                f" {_CLIPFRAC_NOTE}).",
            ),
            Metric(
                "entropy",
                "nats per token",
                "The mean entropy of the policy's next-token distribution (at the temperature the row was"
                " sampled at) over the response tokens, before each optimiser step.",
            ),
            Metric(
                "entropy_loss",
                "nats",
                "That entropy aggregated as the loss is (`ppo.loss_agg_mode`): the bonus `ppo.entropy_coeff`"
                " weighs. Only with `ppo.entropy_coeff` above 0.",
            ),
            Metric(
                "kl",
                "nats per token",
                "The mean per-token estimate (`ppo.kl_loss_type`) of the KL divergence of the policy from the"
                " frozen starting model. Only with `ppo.use_kl_loss`.",
            ),
            Metric(
                "kl_loss",
                "nats",
                "That estimate aggregated as the loss is: the term `ppo.kl_loss_coef` weighs. Only with"
                " `ppo.use_kl_loss`.",
            ),
            Metric("kl_coef", "coefficient", "`ppo.kl_loss_coef`, as used. Only with `ppo.use_kl_loss`."),
            Metric(
                "grad_norm",
                "L2 norm",
                "The total norm of the gradients, before they are clipped to `optim.max_grad_norm`.",
            ),
            Metric(
                "log_prob_gap_mean",
                "nats per token",
                "The mean absolute difference between the log-probs the proxy recorded when the engine"
                " sampled each token and the learner's under its weights before the update, over the tokens"
                " that have recorded ones: engine/learner mismatch, plus staleness in async mode. Only when"
                " the batch's rows carry recorded log-probs.",
            ),
            Metric(
                "log_prob_gap_max",
                "nats",
                "The largest such difference of a token (with several optimiser steps: the mean of each"
                " one's largest).",
            ),
            Metric(
                "tokens",
                "tokens",
                "Response tokens the update trained on (`response_mask` 1: the policy's own tokens, not"
                " observations or padding).",
            ),
            Metric("rows", "rows", "Rows the update trained on (the batch's: `batch_rows`)."),
            Metric(
                "update_rank<N>_seconds",
                "seconds",
                "With `learner.ranks` above 1: the seconds rank `N` spent on its share of the update.",
            ),
            Metric(
                "rank<N>_tokens",
                "tokens",
                "With `learner.ranks` above 1: the prompt and response tokens (attention mask) of the rows"
                " rank `N` trained on (whole groups, shared out by tokens).",
            ),
        ),
    ),
    (
        "Time",
        "Where the step's time went: wall-clock seconds of each part, and each process's CPU seconds.",
        (
            Metric(
                "step_seconds",
                "seconds",
                "The step, from submitting its groups to the new weights served (validation and checkpoints"
                " not included).",
            ),
            Metric(
                "generation_seconds",
                "seconds",
                "Sync mode: from submitting the groups until every rollout ended. Async mode: waiting for the"
                " batch (the data path included).",
            ),
            Metric(
                "data_path_seconds",
                "seconds",
                "Sync mode: getting the batch once every rollout ended (spans to triplets to rows, and their"
                " transfer). Async mode: 0 (it is in `generation_seconds`).",
            ),
            Metric(
                "update_seconds",
                "seconds",
                "The update (with `--backend verl`: verl's, the proxy paused meanwhile).",
            ),
            Metric(
                "weight_sync_seconds",
                "seconds",
                "Serving the new weights: exported and loaded into the engine (sync mode: with the proxy"
                " paused and drained).",
            ),
            Metric(
                "cpu_<process>_seconds",
                "CPU seconds",
                "User plus system CPU seconds of each process, by the name the run gave it: `trainer` (the"
                " run's own process), and those it started, each with its children: `engine` (with vLLM also"
                " `engine-gate`), `server`, `runners`. Measured between one step's update and the next, so a"
                " validation counts in the step after it; services running elsewhere are not measured.",
            ),
        ),
    ),
    (
        "Validation",
        "Written on validation steps only (every `validation.every` steps, and the last step if it was not"
        " one): `validation.samples` rollouts of each task of `agent.val_tasks`, at the current weights,"
        " never trained. The validation after the last step is in `metrics.csv` only (it is not reported to"
        " the Trainer service again).",
        (
            Metric(
                "val_reward",
                "reward",
                "The mean reward of the validation rollouts; one that failed or gave no reward counts 0.",
            ),
            Metric(
                "val_solved",
                "share",
                "The share of validation rollouts whose reward is at least `validation.solved_at`.",
            ),
            Metric(
                "val_failed",
                "rollouts",
                "Validation rollouts that failed or gave no reward (counted as 0 in `val_reward`). Not"
                " written for the validation after the last step.",
            ),
        ),
    ),
    (
        "No learning signal",
        "The watch `experiment.stall_window` sets (`lightning_grpc/training/signal.py`); not written with"
        " `stall_window = 0`.",
        (
            Metric(
                "stall_window",
                "steps",
                "`experiment.stall_window`, every step, so that a reader of one step (`lightning-grpc trainer"
                " status`) can say for how long a condition held.",
            ),
            Metric(
                "stalled_<condition>",
                "1 or 0",
                "1 while the condition has held for `stall_window` steps in a row, else 0; one column per"
                f" condition of `experiment.stall_conditions` ({_names(STALL_CONDITIONS)}).",
            ),
        ),
    ),
    (
        "The verl backend",
        "`lightning-grpc train --backend verl` ([verl](verl.md)) writes verl's own figures instead of the"
        " update's above (the batch's, rewards, time, validation and no-signal figures stay).",
        (
            Metric(
                "<group>/<name>",
                "verl's",
                "verl's metrics under verl's names, as its `reduce_metrics` gives them: `actor/pg_loss`,"
                " `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/entropy`, `actor/grad_norm`, `actor/lr`,"
                " `perf/...`, `global_seqlen/...`; verl's documentation defines them.",
            ),
        ),
    ),
)

#: The table: every metric, in the order of its group.
METRICS: tuple[Metric, ...] = tuple(metric for _, _, group in METRIC_GROUPS for metric in group)

#: Notes the table points at: (heading, Markdown).
METRIC_NOTES: tuple[tuple[str, str], ...] = (
    (
        "When `pg_clipfrac` is 0",
        "`pg_clipfrac` counts the tokens whose probability ratio `r = exp(log-prob - old log-prob)` the PPO"
        " clip acts on: a positive advantage with `r > 1 + ppo.clip_ratio_high`, a negative one with"
        " `r < 1 - ppo.clip_ratio_low`. `log-prob` is the learner's under the weights it is training; what"
        " `old log-prob` is decides whether `r` can leave 1:\n"
        "\n"
        '- `optim.old_log_probs = "recompute"` (the default): the learner\'s own log-probs under the weights'
        " it held when the step began, not the engine's. With `optim.ppo_epochs = 1` and"
        " `optim.mini_batch_rollouts = 0` (the defaults, and the demo's) the update is one optimiser step,"
        " and the old log-probs are taken from that step's own forward pass: `r = 1` on every token, so"
        " `pg_clipfrac`, `pg_clipfrac_lower` and `ppo_kl` are exactly 0 in every step, and `pg_loss` is the"
        " plain policy-gradient loss. Nothing is wrong: the clip has nothing to act on. Stale calls in async"
        " mode do not move `r` either (it never sees the engine's log-probs); `log_prob_gap_mean` measures"
        " that gap.\n"
        "- Several optimiser steps a training step (`optim.ppo_epochs` above 1, or"
        " `optim.mini_batch_rollouts` fewer than the batch's rollouts): the old log-probs come from one pass"
        " before the first optimiser step, which still has `r = 1` (to rounding); each later one sees the"
        " weights the earlier ones moved, and the clip can act there. The step's `pg_clipfrac` is the mean"
        " over its optimiser steps, the first one's 0 included.\n"
        '- `optim.old_log_probs = "rollout"` (verl\'s bypass mode): the old log-probs are those the proxy'
        " recorded when the engine sampled each token, so `r` compares the weights being trained with the"
        " policy that sampled. It leaves 1 from the first optimiser step on: with calls sampled by an older"
        " policy version (async mode, up to `experiment.max_staleness` versions), and with any difference"
        " between the engine's numbers and the learner's (`log_prob_gap_mean`).\n"
        "\n"
        "So `pg_clipfrac` can be above 0 only with more than one optimiser step a training step (from the"
        ' second on), or with `optim.old_log_probs = "rollout"`.',
    ),
)


def documented(column: str) -> Metric | None:
    """The entry of :data:`METRICS` that says what ``column`` is: its exact name first, else its family."""
    exact = [m for m in METRICS if not m.is_family and m.matches(column)]
    found = exact or [m for m in METRICS if m.is_family and m.matches(column)]
    return found[0] if found else None


def undocumented(columns: Iterable[str]) -> list[str]:
    """The columns :data:`METRICS` does not cover (sorted, each once)."""
    return sorted({c for c in columns if documented(c) is None})


def _wrapped(text: str, width: int = 110) -> list[str]:
    """Markdown paragraphs and ``- `` list items, each wrapped to ``width`` (the table rows are not)."""
    lines: list[str] = []
    for block in text.split("\n\n"):
        if lines:
            lines.append("")
        for item in block.split("\n"):
            indent = "  " if item.startswith("- ") else ""
            lines += textwrap.wrap(
                " ".join(item.split()),
                width,
                subsequent_indent=indent,
                break_long_words=False,
                break_on_hyphens=False,
            )
    return lines


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def metrics_reference_markdown() -> str:
    """docs/metrics.md: every metric of :data:`METRICS` by group, with its unit and meaning, and the notes."""
    lines = [
        "# Metrics reference: what a training run records",
        "",
        "<!-- Generated from METRICS in lightning_grpc/training/metrics.py by `make docs-reference`",
        "(scripts/gen_docs.py): edit the table there, not this page. -->",
        "",
    ]
    lines += _wrapped(
        "Each step of `lightning-grpc train` writes one row of `metrics.csv` in `experiment.output_dir`:"
        " `step`, then every metric below that the run gives, by name in alphabetical order (a step that"
        " does not give one, such as `val_reward` between validations, leaves it blank). The same figures"
        " go to TensorBoard (`tensorboard/`, finite values only) and are reported with the step to the"
        " Trainer service (`lightning-grpc trainer status`, `WatchTraining`, the dashboard's training"
        " curves); `reward.png` plots `reward_mean`, `solved` and `val_reward`. A name with a part in angle"
        " brackets (`drop_<reason>`) stands for a family: one column per value of that part. *share*: a"
        " fraction from 0 to 1. The settings named here are in the"
        " [configuration reference](configuration.md)."
    )
    for title, intro, group in METRIC_GROUPS:
        lines += [
            "",
            f"## {title}",
            "",
            *_wrapped(intro),
            "",
            "| Metric | Unit | Meaning |",
            "| --- | --- | --- |",
        ]
        lines += [f"| `{_cell(m.name)}` | {_cell(m.unit)} | {_cell(m.meaning)} |" for m in group]
    for heading, text in METRIC_NOTES:
        lines += ["", f"## {heading}", "", *_wrapped(text)]
    return "\n".join(lines) + "\n"
