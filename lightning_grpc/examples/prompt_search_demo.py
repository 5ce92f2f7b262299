"""Prompt search over a real store: an algorithm proposes prompt templates, runner processes score them.

    python -m lightning_grpc.examples.prompt_search_demo        (what ``make demo`` runs)

1. The store server starts as a subprocess on a free port, with a SQLite file in a temporary directory.
2. Runner processes (this module with ``--runner``) long-poll the store for rollouts.
3. The algorithm publishes each candidate template as its own resources set, enqueues one rollout per
   (candidate, task) that points at it, waits for them all, reads the reward each runner wrote as a
   span attribute, and picks the candidate with the best mean reward.
4. The runners and the server are stopped with SIGTERM.

No LLM is called: a runner "executes" a rollout by rendering the prompt and scoring it with
:func:`score`, a deterministic function of the prompt and the task.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from lightning_grpc.client import StoreClient
from lightning_grpc.errors import LightningError
from lightning_grpc.types import (
    AttemptStatus,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    RolloutStatus,
    Span,
)

#: The span attribute that carries a rollout's reward.
REWARD_ATTRIBUTE = "lightning.reward"
#: The name of a prompt template inside each candidate's resources set.
PROMPT_RESOURCE = "prompt"

#: The prompt templates the search compares, by name.
CANDIDATES: dict[str, str] = {
    "bare": "{question}",
    "polite": "You are a helpful support assistant. Please answer the customer's question.\n{question}",
    "grounded": "Answer using the policy below.\nPolicy: {context}\nQuestion: {question}",
    "grounded-careful": (
        "Answer using the policy below. Think step by step, quote the policy, and keep the answer concise.\n"
        "Policy: {context}\nQuestion: {question}"
    ),
    "everything": (
        "You are a helpful, friendly, patient, knowledgeable and thorough support assistant. "
        "Think step by step. Quote the policy. Keep the answer concise. Read the policy twice.\n"
        "Policy: {context}\nPolicy again: {context}\nQuestion: {question}\nQuestion again: {question}\n"
        "Remember to be helpful, friendly, patient, knowledgeable and thorough in every answer you give."
    ),
}

#: The tasks every candidate is tried on: a question, the policy text that answers it, and the
#: key facts a good prompt puts in front of the model.
TASKS: list[dict[str, Any]] = [
    {
        "task_id": "warranty",
        "question": "How long does the warranty last?",
        "context": "The warranty covers parts and labour for 24 months from delivery.",
        "keywords": ["warranty", "24 months", "delivery"],
    },
    {
        "task_id": "returns",
        "question": "Can I return an opened item?",
        "context": "Opened items can be returned within 30 days with the receipt; a restocking fee applies.",
        "keywords": ["return", "30 days", "receipt", "refund"],
    },
    {
        "task_id": "shipping",
        "question": "Which countries do you ship to?",
        "context": "We ship to Norway, Sweden and Denmark; express delivery takes two days.",
        "keywords": ["ship", "norway", "sweden", "finland"],
    },
    {
        "task_id": "password",
        "question": "How do I reset my password?",
        "context": "Use the 'Forgot password' link; the reset email expires after one hour.",
        "keywords": ["password", "reset email", "one hour"],
    },
    {
        "task_id": "discount",
        "question": "Is there a student discount?",
        "context": "Students get 15% off with a valid university email address.",
        "keywords": ["student", "15%", "university email"],
    },
]

#: Instructions that help (weights add to the reward).
INSTRUCTION_BONUS = {"step by step": 0.15, "quote the policy": 0.1, "concise": 0.05, "helpful": 0.05}
#: Prompts longer than this many characters lose reward in proportion.
PROMPT_BUDGET = 300


def render(template: PromptTemplate, task: Mapping[str, Any]) -> str:
    return template.format(**task)


def score(prompt: str, task: Mapping[str, Any]) -> float:
    """The reward of a prompt for a task, in [0, 1]: key facts covered, useful instructions, brevity."""
    text = prompt.lower()
    keywords = [k.lower() for k in task["keywords"]]
    coverage = sum(k in text for k in keywords) / len(keywords)
    bonus = sum(weight for phrase, weight in INSTRUCTION_BONUS.items() if phrase in text)
    overlong = max(0, len(prompt) - PROMPT_BUDGET) / 500
    return round(min(1.0, max(0.0, 0.6 * coverage + bonus - overlong)), 4)


def say(who: str, text: str) -> None:
    """Print one line; a single write, so lines of the processes sharing stdout never mix."""
    sys.stdout.write(f"{who:<9} {text}\n")
    sys.stdout.flush()


# ================================================================ the store server
class ServerProcess:
    """``lightning-grpc serve`` in a subprocess; its output is drained by a thread."""

    def __init__(self, db: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_GRPC_TOKEN"}
        command = ["-m", "lightning_grpc.cli.main", "serve", "--port", "0", "--db", str(db), "--grace", "2"]
        self.proc = subprocess.Popen(
            [sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.address: str | None = None
        self.recent: deque[str] = deque(maxlen=40)
        self._started = threading.Event()
        threading.Thread(target=self._drain, name="store-server-output", daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.recent.append(line.rstrip())
            if self.address is None and "event=server_started" in line:
                self.address = line.split("address=", 1)[1].split()[0]
                self._started.set()
        self._started.set()  # the server exited: wake whoever waits for it to start

    def wait_started(self, timeout: float = 30.0) -> str:
        if not self._started.wait(timeout) or self.address is None:
            raise RuntimeError("the store server did not start:\n" + "\n".join(self.recent))
        return self.address

    def stop(self, timeout: float = 15.0) -> int:
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> int:
    """SIGTERM, then SIGKILL if it is still there after ``timeout`` seconds; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ================================================================ the algorithm
@dataclass
class Outcome:
    candidate: str
    task_id: str
    rollout: Rollout
    reward: float | None


async def publish_candidates(client: StoreClient) -> dict[str, str]:
    """One resources set per candidate; returns candidate name -> resources id."""
    published: dict[str, str] = {}
    for name, template in CANDIDATES.items():
        update = await client.add_resources(
            {PROMPT_RESOURCE: PromptTemplate(template)}, resources_id=f"candidate-{name}"
        )
        published[name] = update.resources_id
    say("algo", f"published {len(published)} candidate prompts: {', '.join(published.values())}")
    return published


async def enqueue_trials(client: StoreClient, published: Mapping[str, str]) -> list[Rollout]:
    specs = [
        {
            "input": task,
            "mode": "train",
            "resources_id": resources_id,
            "group_id": name,
            "metadata": {"candidate": name, "task_id": task["task_id"]},
            "config": RolloutConfig(
                timeout=20.0, max_attempts=2, retry_on=(AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE)
            ),
        }
        for name, resources_id in published.items()
        for task in TASKS
    ]
    rollouts = await client.enqueue_rollouts(specs)
    say("algo", f"enqueued {len(rollouts)} rollouts ({len(published)} candidates x {len(TASKS)} tasks)")
    return rollouts


async def reward_of(client: StoreClient, rollout: Rollout) -> float | None:
    """The last reward the rollout's latest attempt recorded in its spans."""
    rewards = [
        float(span.attributes[REWARD_ATTRIBUTE])
        for span in await client.query_spans(rollout.rollout_id, "latest")
        if REWARD_ATTRIBUTE in span.attributes
    ]
    return rewards[-1] if rewards else None


async def wait_for_all(
    client: StoreClient, rollout_ids: Sequence[str], timeout: float, runners_alive: Callable[[], bool]
) -> list[Rollout]:
    """The finished rollouts, once all finish, ``timeout`` passes, or no runner is left to run them."""
    deadline = time.monotonic() + timeout
    while True:
        finished = await client.wait_for_rollouts(rollout_ids, timeout=1.0)
        if len(finished) == len(rollout_ids) or time.monotonic() >= deadline or not runners_alive():
            return finished


async def run_trials(
    client: StoreClient, timeout: float, runners_alive: Callable[[], bool]
) -> list[Outcome] | None:
    published = await publish_candidates(client)
    rollouts = await enqueue_trials(client, published)
    started = time.monotonic()
    finished = await wait_for_all(client, [r.rollout_id for r in rollouts], timeout, runners_alive)
    say("algo", f"{len(finished)}/{len(rollouts)} rollouts finished in {time.monotonic() - started:.2f}s")
    if len(finished) < len(rollouts):
        return None
    rewards = await asyncio.gather(*(reward_of(client, r) for r in finished))
    return [
        Outcome(r.metadata["candidate"], r.metadata["task_id"], r, reward)
        for r, reward in zip(finished, rewards, strict=True)
    ]


def best_candidate(outcomes: Sequence[Outcome]) -> tuple[str, dict[str, float]]:
    """The candidate with the best mean reward (a missing reward counts as 0; ties go to the first)."""
    means = {
        name: fmean(o.reward or 0.0 for o in outcomes if o.candidate == name)
        for name in CANDIDATES
        if any(o.candidate == name for o in outcomes)
    }
    return max(means, key=lambda name: means[name]), means


async def search(address: str, timeout: float, runners_alive: Callable[[], bool]) -> bool:
    async with StoreClient(address) as client:
        outcomes = await run_trials(client, timeout, runners_alive)
    if outcomes is None:
        say("algo", "gave up: " + ("timed out" if runners_alive() else "every runner exited"))
        return False
    failed = [o for o in outcomes if o.rollout.status != RolloutStatus.SUCCEEDED or o.reward is None]
    for o in failed:
        say("algo", f"{o.rollout.rollout_id} {o.rollout.status}: {o.rollout.status_message or 'no reward'}")
    winner, means = best_candidate(outcomes)
    say("algo", f"{'candidate':<18} mean reward")
    for name, mean in sorted(means.items(), key=lambda item: -item[1]):
        say("algo", f"{name:<18} {mean:.3f}")
    say("winner", f"{winner} (mean reward {means[winner]:.3f})")
    say("winner", f"template: {CANDIDATES[winner]!r}")
    return not failed


# ================================================================ the runner
async def next_rollout(
    client: StoreClient, worker_id: str, stop: asyncio.Event, wait: float
) -> Rollout | None:
    """Long-poll for a rollout; None when the wait ends empty or ``stop`` is set."""
    dequeue = asyncio.create_task(client.dequeue_rollout(worker_id=worker_id, wait=wait))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({dequeue, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not dequeue.done():
        dequeue.cancel()
        await asyncio.gather(dequeue, return_exceptions=True)
        return None
    return dequeue.result()


def make_spans(rollout: Rollout, prompt: str, reward: float, start_ns: int, end_ns: int) -> list[Span]:
    """An agent span covering the work, and a reward span (its child) carrying the reward."""
    trace_id, agent_id = secrets.token_hex(16), secrets.token_hex(8)
    agent = Span(
        trace_id=trace_id,
        span_id=agent_id,
        name="agent",
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns,
        attributes={
            "candidate": rollout.metadata.get("candidate", ""),
            "task.id": rollout.input["task_id"],
            "prompt": prompt,
        },
    )
    reward_span = Span(
        trace_id=trace_id,
        span_id=secrets.token_hex(8),
        parent_span_id=agent_id,
        name="reward",
        start_time_unix_nano=end_ns,
        end_time_unix_nano=time.time_ns(),
        attributes={REWARD_ATTRIBUTE: float(reward)},
    )
    return [agent, reward_span]


class Runner:
    def __init__(self, client: StoreClient, worker_id: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.templates: dict[str, PromptTemplate] = {}
        self.completed = 0

    async def template_of(self, resources_id: str) -> PromptTemplate:
        if resources_id not in self.templates:
            update = await self.client.get_resources(resources_id)
            resource = update.resources[PROMPT_RESOURCE]
            if not isinstance(resource, PromptTemplate):
                raise TypeError(f"resource {PROMPT_RESOURCE!r} of {resources_id} is not a prompt template")
            self.templates[resources_id] = resource
        return self.templates[resources_id]

    async def execute(self, rollout: Rollout) -> None:
        attempt = rollout.latest_attempt
        assert attempt is not None, "a dequeued rollout has an attempt"
        rid, aid = rollout.rollout_id, attempt.attempt_id
        start_ns = time.time_ns()
        try:
            prompt = render(await self.template_of(rollout.resources_id), rollout.input)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            await self.client.complete_attempt(rid, aid, "failed", f"cannot render the prompt: {exc!r}")
            say(self.worker_id, f"{rid} failed: cannot render the prompt ({exc!r})")
            return
        reward = score(prompt, rollout.input)
        await asyncio.sleep(0.005)  # stands in for the agent's work
        await self.client.add_spans(
            make_spans(rollout, prompt, reward, start_ns, time.time_ns()), rollout_id=rid, attempt_id=aid
        )
        await self.client.complete_attempt(rid, aid, "succeeded")
        self.completed += 1
        candidate, task_id = rollout.metadata.get("candidate", "?"), rollout.input["task_id"]
        say(self.worker_id, f"{rid} {candidate:<18} {task_id:<9} reward {reward:.3f}")

    async def run(self, stop: asyncio.Event, poll: float) -> None:
        await self.client.update_worker(self.worker_id, {"completed": 0})
        while not stop.is_set():
            rollout = await next_rollout(self.client, self.worker_id, stop, poll)
            if rollout is not None:
                await self.execute(rollout)
                await self.client.update_worker(self.worker_id, {"completed": self.completed})


async def run_runner(address: str, worker_id: str, poll: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with StoreClient(address) as client:
        runner = Runner(client, worker_id)
        try:
            await runner.run(stop, poll)
        except LightningError as exc:
            say(worker_id, f"stopping: {exc.reason}: {exc.message}")
            return 1
    say(worker_id, f"stopped after {runner.completed} rollouts")
    return 0


# ================================================================ putting it together
def start_runner(address: str, worker_id: str) -> subprocess.Popen[bytes]:
    module = "lightning_grpc.examples.prompt_search_demo"
    return subprocess.Popen(
        [sys.executable, "-m", module, "--runner", "--store", address, "--worker-id", worker_id]
    )


def run_demo(runners: int, timeout: float) -> int:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lightning-grpc-demo-") as tmp:
        db = Path(tmp) / "store.db"
        server = ServerProcess(db)
        processes: list[subprocess.Popen[bytes]] = []
        ok = False
        try:
            address = server.wait_started()
            say("store", f"serving on {address} (SQLite file {db})")
            worker_ids = [f"runner-{i + 1}" for i in range(runners)]
            processes = [start_runner(address, worker_id) for worker_id in worker_ids]
            say("runners", f"started {', '.join(worker_ids)} (separate processes)")
            ok = asyncio.run(search(address, timeout, lambda: any(p.poll() is None for p in processes)))
        finally:
            codes = [stop_process(p, 10.0) for p in processes]
            server_code = server.stop()
            say("store", f"stopped runners (exit {codes}) and server (exit {server_code})")
    ok = ok and not any(codes) and server_code == 0
    say("done" if ok else "failed", f"in {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runners", type=int, default=2, help="how many runner processes (default 2)")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds to wait for the rollouts")
    parser.add_argument("--runner", action="store_true", help="be a runner process (used by the demo)")
    parser.add_argument("--store", help="runner: the store's HOST:PORT")
    parser.add_argument("--worker-id", default="runner-1", help="runner: its worker id")
    parser.add_argument("--poll", type=float, default=2.0, help="runner: seconds a dequeue long-polls")
    args = parser.parse_args(argv)
    if args.runner:
        if not args.store:
            parser.error("--runner needs --store")
        return asyncio.run(run_runner(args.store, args.worker_id, args.poll))
    return run_demo(max(1, args.runners), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
