"""Prompt search over a real store, with the runner and algorithm pieces of lightning-grpc.

    python -m lightning_grpc.examples.prompt_search_demo        (the whole example in one command)

1. The store server starts as a subprocess (``lightning-grpc serve``) on a free port, with a SQLite
   file in a temporary directory.
2. A runner fleet starts with the real command line: ``lightning-grpc runner
   lightning_grpc.examples.prompt_search_demo:agent --concurrency 8 --processes 2``.
3. The search (:func:`search`, on :class:`~lightning_grpc.algorithm.Algorithm`) publishes each
   candidate template as its own resources set, enqueues every task against each, waits once, and
   compares the candidates' mean rewards; a rollout without a reward counts as failed, never as 0.
4. The runners and the server are stopped with SIGTERM; both must exit 0.

This module is the one home of the example's pieces, so that the command above runs from an installed
package: the tasks and candidates, the agent and its scoring, the search and its report.
``examples/prompt_search/`` (in a source checkout) runs the same pieces by hand, against a store and
runners started from the command line.

No LLM is called yet: :func:`score` is a deterministic stand-in for "ask the model with this prompt
and grade its answer".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from lightning_grpc import semconv
from lightning_grpc.algorithm import Algorithm, RolloutResult
from lightning_grpc.client import ClientConfig, StoreClient
from lightning_grpc.processes import CLI, Background, child_env, log_field
from lightning_grpc.runner import rollout
from lightning_grpc.tracing import operation
from lightning_grpc.types import AttemptStatus, PromptTemplate, RolloutConfig, RolloutStatus, Span

# ================================================================ the tasks and the candidates
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


# ================================================================ the agent
@operation(name="score")
def score(prompt: str, task: Mapping[str, Any]) -> float:
    """The reward of a prompt for a task, in [0, 1]: key facts covered, useful instructions, brevity.

    The stand-in for the model. With the LLM Proxy this becomes "send ``prompt`` to the
    OpenAI-compatible endpoint the agent is given, grade the answer against the task"; the agent
    below stays as it is. Traced as an operation, so each rollout's trace shows its input and output.
    """
    text = prompt.lower()
    keywords = [k.lower() for k in task["keywords"]]
    coverage = sum(k in text for k in keywords) / len(keywords)
    bonus = sum(weight for phrase, weight in INSTRUCTION_BONUS.items() if phrase in text)
    overlong = max(0, len(prompt) - PROMPT_BUDGET) / 500
    return round(min(1.0, max(0.0, 0.6 * coverage + bonus - overlong)), 4)


@rollout
def agent(task: Mapping[str, Any], prompt_template: PromptTemplate) -> float:
    """Render the candidate prompt for the task and return its score; the runner records the reward.

    ``prompt_template`` is the rollout's PromptTemplate resource, injected by kind. A template that
    cannot be rendered (a placeholder the task lacks) raises, and the attempt fails with the error.
    """
    prompt = prompt_template.format(**task)
    return score(prompt, task)


#: How the runner command line names the agent.
AGENT_REF = "lightning_grpc.examples.prompt_search_demo:agent"


# ================================================================ the search
#: The name of the template inside each candidate's resources set.
PROMPT_RESOURCE = "prompt_template"
#: Each trial's deadline; a trial whose runner vanished is tried once more.
TRIAL_CONFIG = RolloutConfig(
    timeout=20.0,
    unresponsive_timeout=15.0,
    max_attempts=2,
    retry_on=(AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE),
)


@dataclass
class CandidateResult:
    """One candidate template and the results of its rollouts (one per task, in task order)."""

    name: str
    template: str
    results: list[RolloutResult]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results if r.reward is not None]

    @property
    def failures(self) -> list[RolloutResult]:
        """Rollouts that produced no reward: failed, cancelled, unfinished, or succeeded without one."""
        return [r for r in self.results if r.reward is None]

    @property
    def mean(self) -> float | None:
        """The mean over the rewarded rollouts; None when none was."""
        rewards = self.rewards
        return fmean(rewards) if rewards else None


@dataclass
class SearchResult:
    candidates: list[CandidateResult]
    seconds: float

    @property
    def rollouts(self) -> int:
        return sum(len(c.results) for c in self.candidates)

    @property
    def rewarded(self) -> int:
        return sum(len(c.rewards) for c in self.candidates)

    @property
    def complete(self) -> bool:
        """Every rollout got a reward."""
        return self.rewarded == self.rollouts

    @property
    def best(self) -> CandidateResult | None:
        """The candidate with the best mean reward (ties go to the first); None if none got a reward."""
        best, best_mean = None, 0.0
        for c in self.candidates:
            mean = c.mean
            if mean is not None and (best is None or mean > best_mean):
                best, best_mean = c, mean
        return best


def _quiet(_text: str) -> None:
    return None


async def search(
    algo: Algorithm,
    candidates: Mapping[str, str] = CANDIDATES,
    tasks: Sequence[Mapping[str, Any]] = TASKS,
    *,
    timeout: float = 60.0,
    log: Callable[[str], None] = _quiet,
) -> SearchResult:
    """Try every task with every candidate; rollouts unfinished after ``timeout`` seconds have no reward."""
    started = time.monotonic()
    published = {
        name: await algo.publish({PROMPT_RESOURCE: PromptTemplate(template)})
        for name, template in candidates.items()
    }
    log(f"published {len(published)} candidate templates, one resources set each")
    batches = {
        name: await algo.enqueue(
            tasks, resources_id=resources_id, mode="val", config=TRIAL_CONFIG, metadata={"candidate": name}
        )
        for name, resources_id in published.items()
    }
    total = sum(len(batch) for batch in batches.values())
    log(f"enqueued {total} rollouts ({len(published)} candidates x {len(tasks)} tasks), waiting")
    results = await algo.wait([r for batch in batches.values() for r in batch], timeout=timeout)
    out, start = [], 0
    for name, batch in batches.items():
        out.append(CandidateResult(name, candidates[name], results[start : start + len(batch)]))
        start += len(batch)
    found = SearchResult(out, time.monotonic() - started)
    log(f"{found.rewarded}/{found.rollouts} rollouts rewarded in {found.seconds:.2f}s")
    return found


# ================================================================ printing
def say(who: str, text: str) -> None:
    """Print one line in a single write, so it cannot mix with lines of other writers."""
    sys.stdout.write(f"{who:<8} {text}\n")
    sys.stdout.flush()


def print_report(found: SearchResult) -> None:
    """The table of candidates (best first), the rollouts that failed, and the winner."""
    say("search", f"{'candidate':<18} {'mean':>6}  rewarded")
    ranked = sorted(found.candidates, key=lambda c: -1.0 if c.mean is None else -c.mean)
    for c in ranked:
        mean = "n/a" if c.mean is None else f"{c.mean:.3f}"
        failed = f" ({len(c.failures)} failed)" if c.failures else ""
        say("search", f"{c.name:<18} {mean:>6}  {len(c.rewards)}/{len(c.results)}{failed}")
    for c in found.candidates:
        for r in c.failures:
            why = r.rollout.status_message or (
                "no reward" if r.rollout.status == RolloutStatus.SUCCEEDED else "unfinished"
            )
            task = r.rollout.input.get("task_id", "?") if isinstance(r.rollout.input, dict) else "?"
            say("failed", f"{r.rollout.rollout_id} {c.name}/{task} {r.rollout.status}: {why}")
    best = found.best
    if best is None or best.mean is None:
        say("winner", "none: no candidate got a reward")
        return
    say("winner", f"{best.name} (mean reward {best.mean:.3f} over {len(best.rewards)} tasks)")
    say("winner", f"template: {best.template!r}")


def describe_span(span: Span) -> str:
    """One line for a span of an agent's trace."""
    attributes = span.attributes
    if span.name == semconv.SPAN_OPERATION:
        name = attributes.get(semconv.OPERATION_NAME, "?")
        return f"{span.name} name={name} output={attributes.get(semconv.OPERATION_OUTPUT)}"
    reward = semconv.read_reward(attributes)
    if reward is not None:
        return f"{span.name} " + " ".join(f"{k}={v}" for k, v in reward.items())
    return span.name


async def print_trace(client: StoreClient, found: SearchResult) -> None:
    """The trace of the winner's best rollout, one span a line."""
    best = found.best
    if best is None:
        return
    top = max((r for r in best.results if r.reward is not None), key=lambda r: r.reward or 0.0)
    spans = await client.query_spans(top.rollout.rollout_id, "latest")
    task = top.rollout.input.get("task_id", "?")
    say("trace", f"{top.rollout.rollout_id} ({best.name}, task {task}), latest attempt, {len(spans)} spans:")
    depth = {s.span_id: 0 for s in spans if not s.parent_span_id}  # the attempt's root span first
    for span in sorted(spans, key=lambda s: (s.parent_span_id != "", s.sequence_id)):
        depth[span.span_id] = depth.get(span.parent_span_id, -1) + 1
        say("trace", "  " * (depth[span.span_id] + 1) + describe_span(span))


async def search_and_report(store: str | ClientConfig, timeout: float) -> bool:
    """Search with the runners of a store and print the report; True when every rollout got a reward."""
    async with Algorithm(store) as algo:
        found = await search(algo, timeout=timeout, log=lambda text: say("search", text))
        print_report(found)
        await print_trace(algo.client, found)
    return found.complete and found.best is not None


# ================================================================ the processes
def start_store(db: Path) -> Background:
    args = [*CLI, "serve", "--port", "0", "--db", str(db), "--grace", "2"]
    return Background("store", args, child_env())


def start_runners(address: str, processes: int, concurrency: int) -> Background:
    args = [*CLI, "runner", AGENT_REF, "--store", address]
    args += ["--concurrency", str(concurrency), "--processes", str(processes), "--poll-wait", "1"]
    return Background("runners", args, child_env())


async def search_while(alive: Callable[[], bool], address: str, timeout: float) -> bool:
    """:func:`search_and_report`, abandoned if the runner fleet exits before it is done."""
    task = asyncio.create_task(search_and_report(address, timeout))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if not alive():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            say("search", "gave up: the runner fleet exited")
            return False


def run_demo(processes: int, concurrency: int, timeout: float) -> int:
    started = time.monotonic()
    ok = False
    fleet: Background | None = None
    fleet_code: int | None = None
    with tempfile.TemporaryDirectory(prefix="lightning-grpc-demo-") as tmp:
        db = Path(tmp) / "store.db"
        server = start_store(db)
        try:
            address = log_field(server.wait_for("event=server_started")[0], "address")
            say("store", f"serving on {address} (SQLite file {db})")
            fleet = start_runners(address, processes, concurrency)
            # Wait until every runner process is up: each has its SIGTERM handler by then.
            fleet.wait_for("event=runner_started", count=processes, timeout=60)
            say("runners", f"{processes} processes x {concurrency} rollouts at once: {AGENT_REF}")
            ok = asyncio.run(search_while(fleet.alive, address, timeout))
        except RuntimeError as exc:  # a process did not start
            say("failed", str(exc))
        finally:
            if fleet is not None:
                fleet_code = fleet.stop()
            server_code = server.stop()
    if fleet is not None:
        counts = [log_field(line, "completed") for line in fleet.lines if "event=runner_exit" in line]
        say(
            "runners", f"stopped (exit {fleet_code}); rollouts run per process: {', '.join(counts) or 'none'}"
        )
    say("store", f"stopped (exit {server_code})")
    ok = ok and fleet_code == 0 and server_code == 0
    if not ok:
        for process in (p for p in (fleet, server) if p is not None):
            sys.stdout.write(f"{process.name} output (last lines):\n{process.tail()}\n")
    say("done" if ok else "failed", f"in {time.monotonic() - started:.1f}s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=2, help="runner processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts at once per process (default 8)")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds to wait for the rollouts")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.concurrency < 1:
        parser.error("--processes and --concurrency must be at least 1")
    try:
        return run_demo(args.processes, args.concurrency, args.timeout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
