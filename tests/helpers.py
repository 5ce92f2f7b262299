"""Small builders shared by the tests, and the start-up of the servers several test files run."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_grpc.server.app import RunningServer, ServerConfig, start_server
from lightning_grpc.types import Span

if TYPE_CHECKING:
    from lightning_grpc.client import StoreClient
    from lightning_grpc.errors import ResourceExhaustedError
    from lightning_grpc.processes import Background
    from lightning_grpc.proxy import ProxyConfig

_span_counter = itertools.count(1)


def make_span(
    name: str = "step", *, span_id: str | None = None, trace_id: str | None = None, **attributes: object
) -> Span:
    now = time.time_ns()
    return Span(
        trace_id=trace_id or uuid.uuid4().hex,
        span_id=span_id or f"{next(_span_counter):016x}",
        name=name,
        start_time_unix_nano=now,
        end_time_unix_nano=now + 1000,
        attributes=dict(attributes),
    )


async def fill_memory_until_refused(
    client: StoreClient, rollout_id: str, attempt_id: str, blob: str = "z", batches: int = 60
) -> ResourceExhaustedError:
    """Add batches of 20 spans of ~900 bytes to an attempt until a memory-limited store refuses one; the
    refusal (AssertionError when ``batches`` batches all went in)."""
    from lightning_grpc.errors import ResourceExhaustedError

    for _ in range(batches):
        spans = make_spans(20)
        for span in spans:
            span.attributes["blob"] = blob * 900
        try:
            await client.add_spans(spans, rollout_id=rollout_id, attempt_id=attempt_id)
        except ResourceExhaustedError as exc:
            return exc
    raise AssertionError(f"{batches} batches of 20 spans were all taken: the store never filled up")


def make_spans(n: int, name: str = "step", trace_id: str | None = None) -> list[Span]:
    trace = trace_id or uuid.uuid4().hex
    return [make_span(name, trace_id=trace, index=i) for i in range(n)]


def llm_call(
    prompt: list[int],
    response: list[int],
    *,
    logprobs: list[float] | None = None,
    version: int = 0,
    start_ns: int | None = None,
    **attributes: object,
) -> Span:
    """An LLM-call span as the proxy writes it (token ids as int arrays)."""
    from lightning_grpc import semconv

    span = make_span(semconv.SPAN_LLM_CALL, **attributes)
    span.attributes.update(
        {
            semconv.LLM_PROMPT_TOKEN_IDS: list(prompt),
            semconv.LLM_RESPONSE_TOKEN_IDS: list(response),
            semconv.LLM_POLICY_VERSION: version,
            semconv.LLM_MODEL: "policy",
        }
    )
    if logprobs is not None:
        span.attributes[semconv.LLM_RESPONSE_LOGPROBS] = list(logprobs)
    if start_ns is not None:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return span


def reward_span(value: float, *, start_ns: int | None = None) -> Span:
    from lightning_grpc import semconv

    span = make_span(semconv.SPAN_REWARD, **semconv.reward_attributes(value))
    if start_ns is not None:
        span.start_time_unix_nano, span.end_time_unix_nano = start_ns, start_ns + 1000
    return span


# ------------------------------------------------------------------------------------------ servers


@asynccontextmanager
async def serving(config: ServerConfig) -> AsyncIterator[RunningServer]:
    """A Store server in this process on ``config``, stopped when the block ends."""
    running = await start_server(config)
    try:
        yield running
    finally:
        await running.stop()


@asynccontextmanager
async def serving_with_proxy(
    config: ServerConfig, proxy: ProxyConfig | None = None
) -> AsyncIterator[RunningServer]:
    """The Store with TrainerService, OTLP and ProxyService on one port (a proxy with no backend unless
    ``proxy`` says otherwise), stopped when the block ends."""
    from lightning_grpc.proxy import ProxyConfig
    from lightning_grpc.server.proxy_app import start_with_store

    running, llm_proxy = await start_with_store(config, proxy or ProxyConfig(port=0, backends=[]))
    try:
        yield running
    finally:
        await llm_proxy.stop(1)
        await running.stop()


@dataclass
class Services:
    """What :func:`start_services` started, and where its services listen."""

    store: str
    proxy: str
    dashboard: str = ""


def start_services(
    engine_base_url: str, env: dict[str, str], started: list[Background], *, dashboard: bool = False
) -> Services:
    """``lightning-grpc serve`` (in memory, its proxy in front of the engine's "policy", the dashboard when
    ``dashboard``) and a runner of the combination-lock agent on it, as a user starts them for a run that
    starts nothing itself. Each process joins ``started`` as soon as it exists: the caller stops them."""
    from lightning_grpc.examples.combination_lock import AGENT_REF
    from lightning_grpc.processes import Background, log_field
    from tests.engine_fixtures import CLI

    cli = CLI[1:]
    serve = ["serve", "--port", "0", "--memory", "--proxy-backend", engine_base_url]
    serve += ["--proxy-model-name", "policy", "--proxy-port", "0"]
    server = Background("server", [*cli, *serve, *(["--dashboard-port", "0"] if dashboard else [])], env)
    started.append(server)
    store = log_field(server.wait_for("event=server_started", timeout=60)[0], "address")
    proxy = log_field(server.wait_for("event=proxy_started", timeout=60)[0], "http_address")
    shown = ""
    if dashboard:
        shown = log_field(server.wait_for("event=dashboard_started", timeout=60)[0], "http_address")
    runner = Background(
        "runner",
        [*cli, "runner", AGENT_REF, "--store", store, "--concurrency", "32", "--poll-wait", "1"],
        env,
    )
    started.append(runner)
    runner.wait_for("event=runner_started", timeout=120)
    return Services(store, proxy, shown)
