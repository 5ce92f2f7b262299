"""The temperatures a batch's calls were sampled at, against the experiment's ``sampling.temperature``.

The proxy records each call's sampling parameters on its span (``semconv.LLM_REQUEST_TEMPERATURE`` and its
family: the request's values, the engine's defaults where the request sets none), each batch row carries the
temperature of its calls (the ``temperatures`` array), and the learner computes a row's log-probs at it.
An agent that sets its own temperature (hard-coded in its client call, say) thus trains on log-probs at the
temperature it sampled at, but not at the one the experiment names: :func:`temperature_mismatch` counts
those rows every step, and :class:`TemperatureCheck` says so once per run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lightning_grpc import logs

log = logs.get_logger(__name__)

#: Recorded and configured temperatures closer than this are the same (float32 on the wire).
TOLERANCE = 1e-5


def recorded_temperatures(arrays: Mapping[str, Any]) -> np.ndarray | None:
    """The batch's per-row recorded temperatures (float64), or None when it has none (a server before them)."""
    values = arrays.get("temperatures")
    return None if values is None else np.asarray(values, dtype=np.float64).reshape(-1)


def temperature_mismatch(arrays: Mapping[str, Any], configured: float) -> dict[str, float]:
    """How a batch's recorded temperatures compare with the configured ``sampling.temperature``.

    * ``temperature_mismatch_rows``: rows whose recorded temperature differs from ``configured`` (greedy
      rows included);
    * ``temperature_greedy_rows``: rows sampled greedily (temperature 0: the learner computes them at
      ``configured``, there being no sampled distribution to match);
    * ``temperature_distinct``: how many different temperatures the rows were sampled at;
    * ``temperature_min``, ``temperature_max``: the lowest and highest of them.

    Empty when the batch carries no temperatures (a server before them) or no rows.
    """
    values = recorded_temperatures(arrays)
    if values is None or not values.size:
        return {}
    differs = ~np.isclose(values, float(configured), rtol=TOLERANCE, atol=TOLERANCE)
    return {
        "temperature_mismatch_rows": float(np.count_nonzero(differs)),
        "temperature_greedy_rows": float(np.count_nonzero(values <= 0)),
        "temperature_distinct": float(len(distinct_temperatures(values))),
        "temperature_min": float(values.min()),
        "temperature_max": float(values.max()),
    }


def distinct_temperatures(values: np.ndarray) -> list[float]:
    """The different temperatures among ``values``, ascending (float32's noise rounded away)."""
    return sorted({round(float(v), 4) for v in values.tolist()})


def mismatch_warning(
    arrays: Mapping[str, Any], configured: float, *, learner_uses_recorded: bool = True
) -> str:
    """The warning for a batch whose rows were sampled at other temperatures than ``configured`` ("" when
    none were)."""
    values = recorded_temperatures(arrays)
    if values is None or not values.size:
        return ""
    differs = ~np.isclose(values, float(configured), rtol=TOLERANCE, atol=TOLERANCE)
    if not differs.any():
        return ""
    recorded = ", ".join(f"{t:g}" for t in distinct_temperatures(values[differs]))
    greedy = int(np.count_nonzero(values <= 0))
    plural = "s" if recorded.count(",") else ""
    outcome = (
        "the learner computes each row's log-probs at the temperature recorded for its calls"
        + (f" (the {greedy} greedy rows, temperature 0, at sampling.temperature)" if greedy else "")
        if learner_uses_recorded
        else "the verl backend computes every row's log-probs at sampling.temperature, so these rows train on "
        "log-probs of another distribution than the one they were sampled from"
    )
    return (
        f"{int(differs.sum())} of {values.size} rows were sampled at temperature{plural} {recorded} (as the "
        f"proxy recorded their calls), not at sampling.temperature = {configured:g}; {outcome}. An agent that "
        "sets its own temperature should take llm.sampling_parameters, or set sampling.temperature to the "
        "agent's (temperature_mismatch_rows counts these rows every step; this warning is given once per run)"
    )


class TemperatureCheck:
    """:func:`temperature_mismatch` of each batch, with one warning per run the first time rows differ.

    ``say``: where the warning line goes besides the log (``warning: ...``), e.g. the run's output.
    ``learner_uses_recorded``: False for an update backend that computes log-probs at the configured
    temperature (verl), which the warning then says.
    """

    def __init__(
        self,
        configured: float,
        say: Callable[[str], None] | None = None,
        *,
        learner_uses_recorded: bool = True,
    ) -> None:
        self.configured = float(configured)
        self.say = say
        self.learner_uses_recorded = learner_uses_recorded
        self.warned = False

    def __call__(self, arrays: Mapping[str, Any]) -> dict[str, float]:
        metrics = temperature_mismatch(arrays, self.configured)
        if not self.warned and metrics.get("temperature_mismatch_rows", 0.0) > 0:
            self.warned = True
            message = mismatch_warning(
                arrays, self.configured, learner_uses_recorded=self.learner_uses_recorded
            )
            log.warning("event=training_temperature_mismatch message=%s", message)
            if self.say is not None:
                self.say(f"warning: {message}")
        return metrics


__all__ = ["TemperatureCheck", "mismatch_warning", "temperature_mismatch"]
