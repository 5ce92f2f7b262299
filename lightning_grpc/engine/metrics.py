"""The engine's ``GET /metrics``: Prometheus text, under vLLM's metric names where vLLM has the same one.

So a dashboard or an alert written for a vLLM server reads the embedded engine too::

    vllm:num_requests_running        gauge    sequences (choices) in the running batch
    vllm:num_requests_waiting        gauge    sequences waiting for a row
    vllm:prompt_tokens_total         counter  prompt tokens prefilled
    vllm:generation_tokens_total     counter  tokens sampled
    vllm:iteration_tokens_total      histogram tokens a step: the prompts it admitted, plus one a row decoded

and the engine's own, under ``lightning_engine_``: its steps, prefill and decode passes (a step with
newcomers runs both), and the policy version it serves. Each sample carries the label ``model_name`` (the
served model name). Tokens a step is the figure to watch when agents are many: a batch that holds fewer
rows does more passes for the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lightning_grpc._extras import extra_imports

with extra_imports("engine"):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector

from .scheduler import STEP_TOKEN_BUCKETS, EngineCounters

#: The content type of :func:`exposition`: Prometheus text format 0.0.4, what ``generate_latest`` writes
#: (the library's CONTENT_TYPE_LATEST names a newer version of the format).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Reads the scheduler at each scrape (nothing is kept between scrapes)."""

    def __init__(
        self,
        model_name: str,
        counters: Callable[[], EngineCounters],
        load: Callable[[], dict[str, int]],
        policy_version: Callable[[], int],
    ) -> None:
        self.model_name = model_name
        self._counters = counters
        self._load = load
        self._policy_version = policy_version

    def collect(self) -> Iterator[Metric]:
        c, load, labels = self._counters(), self._load(), [self.model_name]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield _one(
            gauge, "vllm:num_requests_running", "Sequences in the running batch.", labels, load["running"]
        )
        yield _one(
            gauge, "vllm:num_requests_waiting", "Sequences waiting for a row.", labels, load["waiting"]
        )
        yield _one(counter, "vllm:prompt_tokens", "Prompt tokens prefilled.", labels, c.prompt_tokens)
        yield _one(counter, "vllm:generation_tokens", "Tokens sampled.", labels, c.generation_tokens)
        yield _step_tokens(labels, c)
        yield _one(counter, "lightning_engine_steps", "Steps of the scheduler's loop.", labels, c.steps)
        yield _one(
            counter,
            "lightning_engine_prefill_passes",
            "Forward passes over newly admitted prompts.",
            labels,
            c.prefill_passes,
        )
        yield _one(
            counter,
            "lightning_engine_decode_passes",
            "Forward passes of one token for every row.",
            labels,
            c.decode_passes,
        )
        yield _one(
            gauge,
            "lightning_engine_policy_version",
            "Policy version of the weights served.",
            labels,
            self._policy_version(),
        )


def _one(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    labels: list[str],
    value: float,
) -> Metric:
    """A gauge or counter family with the one sample of this engine."""
    family = kind(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _step_tokens(labels: list[str], c: EngineCounters) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "vllm:iteration_tokens_total",
        "Tokens a step (prompts admitted plus rows decoded).",
        labels=["model_name"],
    )
    bounds = [str(float(b)) for b in STEP_TOKEN_BUCKETS] + ["+Inf"]
    buckets, seen = [], 0
    for bound, count in zip(bounds, c.step_token_counts, strict=True):
        seen += count
        buckets.append((bound, seen))
    family.add_metric(labels, buckets, sum_value=c.step_tokens_sum)
    return family


def registry(collector: EngineCollector) -> CollectorRegistry:
    """A registry of its own (never the process-wide default one), holding the engine's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """The registry's samples in Prometheus text format."""
    return generate_latest(reg)
