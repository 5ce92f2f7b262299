"""Agents the runner tests run in other processes (importable as tests.runner_agents:NAME)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

from lightning_grpc.runner import LitAgent, rollout
from lightning_grpc.tracing import emit_reward, should_stop
from lightning_grpc.types import Rollout


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


class _Server(ThreadingHTTPServer):
    request_queue_size = 512  # 200 agents connect at once
    daemon_threads = True


class TracedAgent(LitAgent):
    """Makes its own spans, spans of an instrumented library (httpx), and a reward."""

    def setup(self) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.server = _Server(("127.0.0.1", 0), _Ok)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        HTTPXClientInstrumentor().instrument()
        self.http = httpx.AsyncClient()
        self.tracer = trace.get_tracer("tests.traced_agent")

    async def teardown(self) -> None:
        await self.http.aclose()
        self.server.shutdown()

    async def rollout(self, task: Any, resources: Any, rollout: Rollout) -> None:
        with self.tracer.start_as_current_span("agent.step") as span:
            span.set_attribute("task.rollout", rollout.rollout_id)
            await asyncio.sleep(random.uniform(0.0, 0.2))
            port = self.server.server_address[1]
            response = await self.http.get(f"http://127.0.0.1:{port}/?rollout={rollout.rollout_id}")
            response.raise_for_status()
        emit_reward(task["i"] / 1000)


@rollout
async def slow_first_attempt(task: Any, rollout: Rollout) -> float:
    """The first attempt hangs (so a killed runner leaves it); later attempts succeed at once."""
    assert rollout.latest_attempt is not None
    if rollout.latest_attempt.sequence_number == 1:
        await asyncio.sleep(60)
    return 1.0


@rollout
def sync_counter(task: Any) -> float:
    time.sleep(0.01)
    return float(task.get("i", 0))


@rollout
def sync_until_stopped(task: Any) -> None:
    """A sync agent that notices cancellation through should_stop()."""
    deadline = time.monotonic() + 30
    while not should_stop() and time.monotonic() < deadline:
        time.sleep(0.02)
    marker = task.get("marker")
    if marker:
        with open(marker, "w") as f:
            f.write(f"{time.time()}\n{os.getpid()}\n")
