"""Whether a run can still learn: conditions under which GRPO gets no gradient, watched step after step.

GRPO learns from the spread of rewards inside a group: a group whose rollouts all earned the same reward
has zero advantage everywhere, so a step whose groups are all flat changes nothing (or only what the KL
and entropy terms push). A run in that state prints the same line step after step until its step limit;
:class:`SignalWatcher` reads each step's metrics and says so once a condition has held for ``window``
steps in a row, with the figures it measured, the usual causes and what to change.

Pure: it reads the metrics dict the loop records (``zero_variance_groups``, ``groups``, ``reward_std``,
``rollouts``, ``truncated_responses``, ``drop_stale_policy``, ``batch_rows``) and nothing else.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: The conditions watched, in the order they are reported.
CONDITIONS = ("zero_variance", "equal_rewards", "max_tokens", "all_stale")

#: The metric recorded per step for each condition: 1.0 while it has held for the window, else 0.0.
METRIC_PREFIX = "stalled_"

FLAT_GROUPS_CAUSES = (
    "Usual causes: the policy settled on one answer that earns a constant reward; the reward cannot tell"
    " the samples apart; sampling.temperature too low or sampling.max_tokens too small for the answers to"
    " differ; data.group_size too small to sample a different answer."
)
FLAT_GROUPS_REMEDIES = (
    "Try: raise sampling.temperature; raise ppo.entropy_coeff (entropy bonus) or ppo.clip_ratio_high"
    " (clip-higher) to keep the policy exploring; raise data.group_size; change the reward so that it"
    " tells better answers from worse (partial credit); or skip the flat groups: data.filter_groups = true"
    " (dynamic sampling) sets them aside and draws other groups, up to data.max_num_gen_batches rounds a step."
)

REMEDIES = {
    "zero_variance": f"{FLAT_GROUPS_CAUSES} {FLAT_GROUPS_REMEDIES}",
    "equal_rewards": f"{FLAT_GROUPS_CAUSES} {FLAT_GROUPS_REMEDIES}",
    "max_tokens": (
        "The responses are cut before they end, so the reward judges cut text. Usual causes:"
        " sampling.max_tokens too small for the task, or a policy that stopped emitting its end token."
        " Try: raise sampling.max_tokens; reward (or penalise) length; check the prompt asks for a short"
        " answer."
    ),
    "all_stale": (
        "Async mode trained on nothing: every call was sampled more than experiment.max_staleness policy"
        " versions ago, so generation falls behind the updates. Try: raise experiment.max_staleness;"
        ' lower experiment.async_groups; or run experiment.mode = "sync".'
    ),
}


@dataclass(frozen=True)
class Reading:
    """One step's figures for one condition: whether it held, and what was counted."""

    step: int
    holds: bool
    count: float = 0.0
    total: float = 0.0
    reward_mean: float = math.nan


@dataclass(frozen=True)
class Stall:
    """A condition that has held for the whole window: the warning to print and log."""

    condition: str
    first_step: int
    last_step: int
    message: str


def _number(metrics: Mapping[str, float], name: str) -> float | None:
    value = metrics.get(name)
    return None if value is None or not math.isfinite(value) else float(value)


class SignalWatcher:
    """Fed every step's metrics; warns once per condition after it held ``window`` steps in a row.

    A condition that clears (one step where it does not hold) starts its count again and may warn again.
    ``window = 0`` turns the watcher off: it never warns and records no metric.
    """

    def __init__(
        self,
        window: int,
        *,
        zero_variance_fraction: float = 0.9,
        truncated_fraction: float = 0.9,
        conditions: Iterable[str] = CONDITIONS,
    ) -> None:
        self.window = window
        #: The conditions watched (a task that cuts its answers on purpose leaves max_tokens out).
        self.conditions = tuple(c for c in CONDITIONS if c in set(conditions))
        self.zero_variance_fraction = zero_variance_fraction
        self.truncated_fraction = truncated_fraction
        self._streaks: dict[str, deque[Reading]] = {c: deque(maxlen=max(1, window)) for c in CONDITIONS}
        self._warned: set[str] = set()
        readers: dict[str, Callable[[int, Mapping[str, float]], Reading]] = {
            "zero_variance": self._zero_variance,
            "equal_rewards": self._equal_rewards,
            "max_tokens": self._max_tokens,
            "all_stale": self._all_stale,
        }
        self._readers = {c: readers[c] for c in self.conditions}

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[Stall]:
        """Record this step; the conditions that have just held for the window (each once until it clears)."""
        if not self.enabled:
            return []
        stalls = []
        for condition, read in self._readers.items():
            reading = read(step, metrics)
            streak = self._streaks[condition]
            if not reading.holds:
                streak.clear()
                self._warned.discard(condition)
                continue
            streak.append(reading)
            if self._held_for_window(condition) and condition not in self._warned:
                self._warned.add(condition)
                stalls.append(self._stall(condition))
        return stalls

    def _held_for_window(self, condition: str) -> bool:
        return len(self._streaks[condition]) >= self.window

    def stalled(self) -> list[str]:
        """The conditions that hold now and have for the whole window."""
        return [c for c in self.conditions if self.enabled and self._held_for_window(c)]

    def metrics(self) -> dict[str, float]:
        """``stalled_<condition>``: 1.0 while the condition has held for the window, else 0.0; and the window
        (``stall_window``), so a reader of one step's metrics (``trainer status``) can say for how long."""
        if not self.enabled:
            return {}
        now = set(self.stalled())
        return {"stall_window": float(self.window)} | {
            f"{METRIC_PREFIX}{c}": float(c in now) for c in self.conditions
        }

    # ------------------------------------------------------------ one step's reading of each condition
    def _zero_variance(self, step: int, metrics: Mapping[str, float]) -> Reading:
        flat, groups = _number(metrics, "zero_variance_groups"), _number(metrics, "groups")
        if flat is None or not groups:
            return Reading(step, False)
        holds = flat / groups >= self.zero_variance_fraction
        return Reading(step, holds, flat, groups, _reward_mean(metrics))

    def _equal_rewards(self, step: int, metrics: Mapping[str, float]) -> Reading:
        std, rollouts = _number(metrics, "reward_std"), _number(metrics, "rollouts")
        if std is None or rollouts is None or rollouts <= 1:
            return Reading(step, False)
        return Reading(step, std == 0.0, rollouts, rollouts, _reward_mean(metrics))

    def _max_tokens(self, step: int, metrics: Mapping[str, float]) -> Reading:
        fraction, rows = _number(metrics, "truncated_responses"), _number(metrics, "batch_rows")
        if fraction is None or not rows:
            return Reading(step, False)
        return Reading(step, fraction >= self.truncated_fraction, fraction * rows, rows)

    def _all_stale(self, step: int, metrics: Mapping[str, float]) -> Reading:
        stale, rows = _number(metrics, "drop_stale_policy"), _number(metrics, "batch_rows")
        holds = bool(stale) and rows == 0.0
        return Reading(step, holds, stale or 0.0, stale or 0.0)

    # ------------------------------------------------------------ the warning
    def _stall(self, condition: str) -> Stall:
        streak = list(self._streaks[condition])
        first, last = streak[0].step, streak[-1].step
        count = sum(r.count for r in streak)
        total = sum(r.total for r in streak)
        span = f"the last {len(streak)} steps (steps {first}-{last})"
        measured = MEASURED[condition](count, total, span) + _mean_reward(streak)
        message = f"no learning signal ({condition}): {measured}. {REMEDIES[condition]}"
        return Stall(condition, first, last, message)


def _reward_mean(metrics: Mapping[str, float]) -> float:
    value = _number(metrics, "reward_mean")
    return math.nan if value is None else value


def _mean_reward(streak: list[Reading]) -> str:
    means = [r.reward_mean for r in streak if math.isfinite(r.reward_mean)]
    return f"; reward_mean {sum(means) / len(means):.3f}" if means else ""


def _percent(count: float, total: float) -> str:
    return f"{100 * count / total:.0f}%" if total else "-"


MEASURED: dict[str, Callable[[float, float, str], str]] = {
    "zero_variance": lambda n, total, span: (
        f"zero reward variance in {n:.0f} of {total:.0f} GRPO groups ({_percent(n, total)}) over {span}"
    ),
    "equal_rewards": lambda n, total, span: (
        f"every rollout of each step earned the same reward (reward_std 0, {n:.0f} rollouts) over {span}"
    ),
    "max_tokens": lambda n, total, span: (
        f"{n:.0f} of {total:.0f} responses ({_percent(n, total)}) stopped at sampling.max_tokens over {span}"
    ),
    "all_stale": lambda n, total, span: (
        f"every call was dropped as stale ({n:.0f} calls, drop_stale_policy; no batch rows) over {span}"
    ),
}


def truncated_share(lengths: Iterable[int], responses: Any, limit: int, stop_ids: frozenset[int]) -> float:
    """The share of responses cut at ``limit`` tokens: as long as the limit and not ended by a stop token
    (an answer that ends with its stop token right at the limit is whole). ``responses``: rows right-padded."""
    cut = [
        int(length) >= limit and int(responses[row][int(length) - 1]) not in stop_ids
        for row, length in enumerate(lengths)
    ]
    return sum(cut) / len(cut) if cut else 0.0
