"""vLLM failing under the proxy: killed in the middle of a stream (an error span, the agent told), then
started again (calls recover once the proxy has the new address); and killed in a training run, which starts it
again by itself at the current policy version."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from lightning_grpc import semconv
from lightning_grpc.client import StoreClient
from lightning_grpc.proxy import LLMProxy
from lightning_grpc.training.engines import VllmEngine
from tests.engine_fixtures import ROOT

from .conftest import MODEL, vllm_backend
from .helpers import MESSAGES, agent, llm_spans, new_attempt, services_output, train_command, train_env

pytestmark = pytest.mark.timeout(900)


async def test_vllm_killed_mid_stream_then_restarted(
    proxy: LLMProxy, store: StoreClient, vllm: VllmEngine, wide_model: Path
) -> None:
    server = vllm.processes[0]
    family = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(recursive=True))]
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    received: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content is not None:
                    received.append(chunk.choices[0].delta.content)
                if len(received) == 2:
                    # freeze generation where it is, then kill the server: the stream is cut mid-answer
                    await vllm.pause()
                    os.kill(server.proc.pid, signal.SIGKILL)
    finally:
        await client.close()
    assert "broke off" in str(caught.value.message)
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code == 2
    assert "stream" in span.attributes[semconv.LLM_ERROR]
    assert len(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS]) > 0  # what came before the cut is kept

    # while it is down the agent gets a clear error, recorded
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        with pytest.raises(openai.APIStatusError) as down:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    finally:
        await client.close()
    assert down.value.status_code == 502
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code == 2

    # stopped, nothing of vLLM is left (its engine process outlives a killed server: the group goes)
    vllm.stop()
    await asyncio.to_thread(
        psutil.wait_procs, [psutil.Process(p) for p in family if psutil.pid_exists(p)], 10
    )
    assert not [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

    # started again (as a run restarts its engine), the proxy pointed at it: calls recover
    vllm.url = ""
    vllm.start(wide_model, 0)
    proxy.set_backends([vllm_backend(vllm, await vllm.reported_version())])
    rollout_id, attempt_id = await new_attempt(store)
    client = agent(proxy, rollout_id, attempt_id)
    try:
        answer = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0
        )  # type: ignore[arg-type]
    finally:
        await client.close()
    (span,) = await llm_spans(store, rollout_id)
    assert span.status_code != 2
    assert (
        list(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS])
        == answer.model_dump()["choices"][0]["token_ids"]
    )


def vllm_server(run: psutil.Process) -> psutil.Process:
    """The run's vLLM server: its child whose command line runs vLLM's OpenAI server (through the launcher)."""
    return next(
        child
        for child in run.children()
        if any("vllm.entrypoints.openai.api_server" in arg for arg in child.cmdline())
    )


def engine_gate(run: psutil.Process) -> psutil.Process:
    """The run's gate to vLLM's socket (``python -m lightning_grpc.training.engines gate``)."""
    return next(c for c in run.children() if "lightning_grpc.training.engines" in c.cmdline())


def listening_port(process: psutil.Process) -> int:
    (port,) = {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    return int(port)


def wait_for_step(
    out: Path, step: int, run: subprocess.Popen[bytes], log: Path, timeout: float = 600
) -> None:
    """Until metrics.csv has ``step``'s row (the step, its update and its weights' publication done)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.csv"
    while not (metrics.exists() and any(r["step"] == str(step) for r in csv.DictReader(metrics.open()))):
        assert run.poll() is None, f"the run ended (code {run.returncode}):\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, (
            f"no step {step} in {timeout:.0f} s:\n{log.read_text()[-6000:]}\n{services_output(out)}"
        )
        time.sleep(0.5)


def journal(out: Path) -> list[dict[str, Any]]:
    path = out / "interruptions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_recovery(
    out: Path, process: str, run: subprocess.Popen[bytes], log: Path, timeout: float = 600
) -> dict[str, Any]:
    """The journal's first entry for ``process``, once the run has recorded its recovery."""
    deadline = time.monotonic() + timeout
    while not (found := [e for e in journal(out) if e["process"] == process]):
        assert run.poll() is None, f"the run ended (code {run.returncode}):\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"no recovery of {process} in {timeout:.0f} s: {journal(out)}"
        time.sleep(0.5)
    return found[0]


def test_a_training_run_restarts_its_vllm_killed_mid_run_at_the_current_policy(
    vllm_python: str, tmp_path: Path
) -> None:
    """kill -9 of the vLLM server a sync run started, once step 2 is done: the run starts it again on its socket
    (the gate's address, the proxy's upstream, unchanged), the rest of its family ended first, and goes on to
    its last step; the gate, killed after step 4, comes back on its port. The proof that the restarted vLLM
    serves the current policy (version 2's weights, not the model the run started from): the learner's
    log-probs of the tokens it sampled still equal vLLM's at every later step, and the policy version keeps
    rising."""
    steps = 6
    out = tmp_path / "run"
    log = tmp_path / "train.log"
    settings = {"experiment.steps": str(steps), "learner.ranks": "1"}
    with log.open("w") as output:
        run = subprocess.Popen(
            train_command(tmp_path, settings),
            cwd=ROOT,
            env=train_env(vllm_python),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_step(out, 2, run, log)
        server = vllm_server(psutil.Process(run.pid))
        family = [server, *server.children(recursive=True)]  # vLLM's engine process outlives the server
        server.send_signal(signal.SIGKILL)
        engine = wait_for_recovery(out, "engine", run, log)
        # what was left of the dead server went before the new one started
        assert not [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert vllm_server(psutil.Process(run.pid)).pid != server.pid
        wait_for_step(out, 4, run, log)
        gate = engine_gate(psutil.Process(run.pid))
        port = listening_port(gate)
        gate.send_signal(signal.SIGKILL)
        wait_for_recovery(out, "engine-gate", run, log)
        assert listening_port(engine_gate(psutil.Process(run.pid))) == port
        assert run.wait(timeout=800) == 0, log.read_text()[-6000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert engine["cause"] == "killed by signal 9 (SIGKILL)", engine
    assert engine["recovery"].startswith("restarted on the same ports"), engine
    assert engine["step"] >= 3, engine
    assert [e["process"] for e in journal(out)] == ["engine", "engine-gate"], journal(out)
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(float(r["policy_version"])) for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert float(row["batch_rows"]) > 0, row
        # the tokens vLLM sampled, before and after its restart: the learner's log-probs of them agree
        assert float(row["log_prob_gap_max"]) < 1e-4, row
    print(
        f"\nvLLM restarted in {engine['recovery_seconds']:.1f} s; "
        + "; ".join(f"step {r['step']}: gap {float(r['log_prob_gap_max']):.1e}" for r in rows)
    )
