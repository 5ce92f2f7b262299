"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright), against a live
``serve`` holding real rollouts played through the proxy and the steps of a short training run.

Each page must load with no console error; each leaves a screenshot in ``test-output/dashboard/``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lightning_grpc import semconv
from lightning_grpc.batching import RunInterruption
from lightning_grpc.client import StoreClient, TrainerClient
from lightning_grpc.engine import EngineProcess
from lightning_grpc.processes import Background
from lightning_grpc.training.loop import run_experiment
from lightning_grpc.types import RolloutStatus
from tests.cli.test_cli import tool_conversation
from tests.engine_fixtures import QUIET_ENV, ROOT
from tests.helpers import start_services
from tests.training.test_training import experiment

playwright = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")

pytestmark = pytest.mark.timeout(600)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(os.environ.get("LIGHTNING_GRPC_TEST_OUTPUT", ROOT / "test-output")) / "dashboard"
TOKEN = "dashboard-test-admin-token-0123456789"


@dataclass
class Live:
    store: str
    dashboard: str
    processes: list[Background] = field(default_factory=list)

    def client(self) -> StoreClient:
        return StoreClient(self.store, token=TOKEN)


def call(live: Live, method: str, *args: Any, trainer: bool = False, **kwargs: Any) -> Any:
    """A StoreClient (or TrainerClient) call, on a thread of its own (Playwright's sync API holds this
    thread's event loop)."""

    async def run() -> Any:
        client = TrainerClient(live.store, token=TOKEN) if trainer else live.client()
        async with client:
            return await getattr(client, method)(*args, **kwargs)

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """An engine, ``serve`` (auth on, proxy, dashboard), a Python runner, and two training steps through them."""
    if CHROMIUM is None:
        pytest.fail("the dashboard's tests need Debian's chromium (`make browser` installs it)")
    engine = EngineProcess(
        tiny_model, served_model_name="policy", extra_args=["--threads", "1"], env=QUIET_ENV
    ).start()
    started: list[Background] = []
    env = {**QUIET_ENV, "LIGHTNING_GRPC_TOKEN": TOKEN, "LIGHTNING_GRPC_ENGINE_ADMIN_KEY": engine.admin_key}
    try:
        services = start_services(engine.base_url, env, started, dashboard=True)
        store, proxy, dashboard = services.store, services.proxy, services.dashboard
        config = experiment(
            tmp_path_factory.mktemp("dashboard-run"),
            tiny_model,
            experiment={"steps": 2, "name": "dashboard-run"},
            agent={"processes": 0},
            services={"store": store, "proxy": proxy, "engine": engine.url},
        )
        old = os.environ.get("LIGHTNING_GRPC_TOKEN"), os.environ.get("LIGHTNING_GRPC_ENGINE_ADMIN_KEY")
        os.environ["LIGHTNING_GRPC_TOKEN"] = TOKEN
        os.environ["LIGHTNING_GRPC_ENGINE_ADMIN_KEY"] = engine.admin_key
        try:
            run_experiment(config, progress=False)
        finally:
            for key, value in zip(
                ("LIGHTNING_GRPC_TOKEN", "LIGHTNING_GRPC_ENGINE_ADMIN_KEY"), old, strict=True
            ):
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        SHOTS.mkdir(parents=True, exist_ok=True)
        yield Live(store, dashboard, started)
    finally:
        for process in reversed(started):
            process.stop(timeout=20)
        engine.stop()


@dataclass
class Browser:
    page: Any
    errors: list[str]

    def shot(self, name: str) -> Path:
        path = SHOTS / f"{name}.png"
        self.page.evaluate("window.scrollTo(0, 0)")  # the sticky header over the top, not mid-page
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


@pytest.fixture
def browser(live: Live) -> Iterator[Browser]:
    with playwright.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = chromium.new_page(viewport={"width": 1360, "height": 900})
            errors: list[str] = []
            page.on(
                "console",
                lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.set_default_timeout(20_000)
            # the credential, as a user gives it on the prompt
            page.goto(f"{live.dashboard}/#/")
            page.locator("form.login input[name=token]").fill(TOKEN)
            page.locator("form.login button").click()
            page.locator("[data-stat=queue]").wait_for()
            # The one request refused before the credential was given is the browser's 401, which Chromium
            # logs as a failed resource; from here on nothing may log an error.
            assert all("401" in e for e in errors), errors
            errors.clear()
            yield Browser(page, errors)
            assert errors == [], errors
        finally:
            chromium.close()


def test_a_server_with_auth_asks_for_the_credential_and_refuses_a_wrong_one(live: Live) -> None:
    with playwright.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = chromium.new_page()
            page.goto(f"{live.dashboard}/#/rollouts")
            form = page.locator("form.login")
            form.wait_for()
            assert "BAD_TOKEN" in form.inner_text()
            form.locator("input[name=token]").fill("not-the-token")
            form.locator("button").click()
            page.wait_for_timeout(500)
            assert page.locator("form.login").count() == 1
            assert page.locator("table.rollouts").count() == 0
        finally:
            chromium.close()


def test_overview_shows_queue_statuses_throughput_and_workers(live: Live, browser: Browser) -> None:
    page = browser.page
    stats = call(live, "statistics")
    rollouts = page.locator("[data-stat=rollouts] .stat-value")
    assert int(rollouts.inner_text().replace(",", "")) == stats.total_rollouts
    assert page.locator("[data-stat=workers] .stat-value").inner_text().startswith("1 /")
    assert "succeeded" in page.locator("table.bars").inner_text()
    browser.shot("overview")


def test_rollouts_page_filters_pages_shows_rewards_and_a_new_rollout_live(
    live: Live, browser: Browser
) -> None:
    page = browser.page
    page.goto(f"{live.dashboard}/#/rollouts")
    rows = page.locator("table.rollouts tbody tr[data-rollout-id]")
    rows.first.wait_for()
    total = call(live, "statistics").total_rollouts
    assert rows.count() == 25  # one page of the run's training and validation rollouts
    assert page.locator(".pager .muted").inner_text() == f"1–25 of {total}"
    page.locator(".pager button", has_text="next").click()
    page.wait_for_function("document.querySelector('.pager .muted').textContent.startsWith('26–')")
    page.locator(".pager button", has_text="previous").click()
    page.wait_for_function("document.querySelector('.pager .muted').textContent.startsWith('1–')")
    # rewards are read from each rollout's reward span
    page.wait_for_function(
        "[...document.querySelectorAll('td.reward')].every(td => /^[0-9.]+$/.test(td.textContent))"
    )
    # filter: only succeeded
    page.select_option("select[name=status]", "5")
    page.wait_for_function(
        "[...document.querySelectorAll('tbody tr[data-rollout-id]')].every(tr => tr.dataset.status === 'succeeded')"
    )
    page.select_option("select[name=status]", "")
    rows.first.wait_for()
    # sort: by rollout id, ascending
    page.select_option("select[name=sort]", "rollout_id")
    page.select_option("select[name=order]", "asc")
    page.wait_for_function(
        "(() => { const ids = [...document.querySelectorAll('tbody tr[data-rollout-id]')]"
        ".map(tr => tr.dataset.rolloutId); return ids.length === 25 && "
        "ids.every((id, i) => i === 0 || ids[i - 1] < id); })()"
    )
    shown = rows.evaluate_all("rows => rows.map(r => r.dataset.rolloutId)")
    every = sorted(r.rollout_id for r in call(live, "query_rollouts"))
    assert shown == every[:25]
    page.select_option("select[name=sort]", "create_time")
    page.select_option("select[name=order]", "desc")
    page.locator("tbody[data-view^='create_time:desc:']").wait_for()
    # a rollout queued now appears at the top without a reload (the watch stream)
    queued = call(live, "enqueue_rollout", {"prompt": "appears live"}, group_id="live-group")
    page.locator(f"tr[data-rollout-id='{queued.rollout_id}']").wait_for(timeout=15_000)
    assert rows.first.get_attribute("data-rollout-id") == queued.rollout_id
    # and its row follows it: the runner takes it and its agent fails on an input that is no lock
    page.locator(f"tr[data-rollout-id='{queued.rollout_id}'][data-status=failed]").wait_for(timeout=30_000)
    assert call(live, "get_rollout", queued.rollout_id).status == RolloutStatus.FAILED
    page.wait_for_function("![...document.querySelectorAll('td.reward')].some(td => td.textContent === '…')")
    browser.shot("rollouts")


def test_a_rollouts_span_tree_shows_its_llm_calls_token_counts(live: Live, browser: Browser) -> None:
    rollouts = call(live, "query_rollouts", status_in=["succeeded"], mode="train")
    rollout = rollouts[0]
    spans = call(live, "query_spans", rollout.rollout_id)
    calls = [s for s in spans if s.name == semconv.SPAN_LLM_CALL]
    assert calls, [s.name for s in spans]
    page = browser.page
    page.goto(f"{live.dashboard}/#/rollouts/{rollout.rollout_id}")
    page.locator("[data-span-name='lightning.rollout']").first.wait_for()
    assert page.locator("[data-span-name='lightning.llm.call']").count() == len(calls)
    for span in calls:
        box = page.locator(f".llm-call[data-span-id='{span.span_id}']")
        prompt = len(span.attributes[semconv.LLM_PROMPT_TOKEN_IDS])
        response = len(span.attributes[semconv.LLM_RESPONSE_TOKEN_IDS])
        assert box.locator("[data-field=prompt-tokens]").inner_text() == str(prompt)
        assert box.locator("[data-field=response-tokens]").inner_text() == str(response)
        version = span.attributes[semconv.LLM_POLICY_VERSION]
        assert box.locator("[data-field=policy-version]").inner_text() == str(version)
        assert box.locator("[data-field=logprobs] .lp").count() == response
        assert box.locator(".msg.role-user").count() >= 1
    assert page.locator("[data-field=reward]").inner_text() != "–"
    assert page.locator("[data-field=status]").inner_text() == "succeeded"
    assert page.locator(".attempt").count() == rollout.attempt_count
    browser.shot("rollout")


def test_a_rollouts_llm_calls_show_their_tool_calls_tool_results_and_dialect(
    live: Live, browser: Browser
) -> None:
    # a rollout started outside the queue (the runner does not take it), holding a two-call tool conversation
    rollout = call(live, "start_rollout", {"lock": [3, 1, 4]}, group_id="tool-group")
    attempt_id = rollout.latest_attempt.attempt_id
    second, first = tool_conversation()
    call(live, "add_spans", [first, second], rollout_id=rollout.rollout_id, attempt_id=attempt_id)
    call(live, "complete_attempt", rollout.rollout_id, attempt_id, "succeeded")
    page = browser.page
    page.goto(f"{live.dashboard}/#/rollouts/{rollout.rollout_id}")
    asked = page.locator(f".llm-call[data-span-id='{first.span_id}']")
    asked.wait_for()
    assert asked.locator("[data-field=dialect]").inner_text() == "chat_completions"
    assert asked.locator("[data-field=finish]").inner_text() == "tool_calls"
    assert asked.locator("[data-field=tools]").inner_text() == "press, reset (tool_choice auto)"
    made = asked.locator(".msg.reply .tool-call[data-tool-call-id=call_1]")
    assert made.locator(".tool-name").inner_text() == "press"
    assert made.locator(".tool-args").inner_text() == '{"digit": 3}'
    answered = page.locator(f".llm-call[data-span-id='{second.span_id}']")
    assert answered.locator("[data-field=dialect]").inner_text() == "–"  # the call names none
    result = answered.locator(".msg.tool-result[data-tool-call-id=call_1]")
    assert result.locator(".role").inner_text() == "press →"
    assert result.locator(".content").inner_text() == "click: 1 of 3 digits right"
    # the assistant's earlier tool call is in this prompt too, and the reply is text
    assert answered.locator(".msg.role-assistant:not(.reply) .tool-name").inner_text() == "press"
    assert answered.locator(".msg.reply .content").inner_text() == "The lock is open."
    browser.shot("rollout-tools")


def test_a_failed_rollout_shows_its_agents_error(live: Live, browser: Browser) -> None:
    queued = call(live, "enqueue_rollout", {"prompt": "no lock here"}, group_id="error-group")
    for _ in range(300):
        if call(live, "get_rollout", queued.rollout_id).status == RolloutStatus.FAILED:
            break
        time.sleep(0.1)
    page = browser.page
    page.goto(f"{live.dashboard}/#/rollouts/{queued.rollout_id}")
    attempt = page.locator(".attempt").first
    attempt.wait_for()
    assert "failed" in attempt.inner_text()
    assert "KeyError" in attempt.locator(".error").inner_text()
    attempt.locator("details summary").click()
    assert "Traceback" in attempt.locator("pre").inner_text()
    assert page.locator("[data-field=status]").inner_text() == "failed"
    browser.shot("rollout-failed")


def test_workers_page_lists_the_runner(live: Live, browser: Browser) -> None:
    workers = call(live, "query_workers")
    page = browser.page
    page.goto(f"{live.dashboard}/#/workers")
    page.locator("table.workers tbody tr[data-worker-id]").first.wait_for()
    shown = page.locator("table.workers tbody tr[data-worker-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.workerId)"
    )
    assert sorted(shown) == sorted(w.worker_id for w in workers)
    assert "alive" in page.locator("table.workers").inner_text()
    browser.shot("workers")


def test_training_page_plots_the_runs_steps(live: Live, browser: Browser) -> None:
    page = browser.page
    page.goto(f"{live.dashboard}/#/training")
    page.locator("button.run[data-run='dashboard-run']").wait_for()
    page.locator("table.steps tbody tr[data-step]").nth(1).wait_for()
    assert page.locator("table.steps tbody tr[data-step]").count() == 2
    for metric in ("reward_mean", "ppo_kl", "pg_clipfrac", "step_seconds"):
        assert page.locator(f"figure[data-metric={metric}] circle").count() == 2, metric
    assert page.locator("[data-stat=policy] .stat-value").inner_text() == "2"
    # a step reported now is plotted without a reload (WatchTraining follows)
    call(
        live,
        "report_step",
        3,
        3,
        {"reward_mean": 0.5, "ppo_kl": 0.01, "pg_clipfrac": 0.1, "step_seconds": 0.5},
        run_id="dashboard-run",
        trainer=True,
    )
    page.locator("table.steps tbody tr[data-step='3']").wait_for(timeout=15_000)
    for metric in ("reward_mean", "ppo_kl", "pg_clipfrac", "step_seconds"):
        assert page.locator(f"figure[data-metric={metric}] circle").count() == 3, metric
    # the run's interruptions: none so far, then one reported with a step is listed live
    section = page.locator("[data-section=interruptions]")
    assert section.locator("p.no-interruptions").is_visible()
    assert not section.locator("table.interruptions").is_visible()
    call(
        live,
        "report_step",
        4,
        4,
        {"reward_mean": 0.5},
        run_id="dashboard-run",
        interruptions=[
            RunInterruption(
                time=time.time() - 5,
                process="engine",
                cause="exited with signal 9 (SIGKILL)",
                recovery="restarted on the same port after 1.0 s back-off",
                recovery_seconds=2.5,
                step=4,
            )
        ],
        trainer=True,
    )
    row = section.locator("table.interruptions tbody tr[data-interruption=engine]")
    row.wait_for(timeout=15_000)
    cells = row.locator("td").all_inner_texts()
    assert cells[1:] == [
        "4",
        "engine",
        "exited with signal 9 (SIGKILL)",
        "restarted on the same port after 1.0 s back-off",
        "2.5",
    ], cells
    assert not section.locator("p.no-interruptions").is_visible()
    browser.shot("training")
