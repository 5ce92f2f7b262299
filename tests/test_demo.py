"""``make demo``: the prompt search example runs end to end and picks the candidate the scoring favours."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from statistics import fmean

from lightning_grpc.examples import prompt_search_demo as demo
from lightning_grpc.types import PromptTemplate
from tests.conftest import ROOT


def favoured_candidate() -> str:
    """The best mean score over the tasks, computed here without any store or runner."""
    means = {
        name: fmean(demo.score(demo.render(PromptTemplate(template), task), task) for task in demo.TASKS)
        for name, template in demo.CANDIDATES.items()
    }
    ranked = sorted(means.values(), reverse=True)
    assert ranked[0] > ranked[1], "the scoring must single out one candidate"
    return max(means, key=lambda name: means[name])


def test_demo_finds_the_favoured_prompt() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_GRPC_")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_grpc.examples.prompt_search_demo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert elapsed < 60

    rollouts = len(demo.CANDIDATES) * len(demo.TASKS)
    assert f"{rollouts}/{rollouts} rollouts finished" in done.stdout
    rewarded = re.findall(r"^runner-\d+\s+(ro-\S+) .* reward (\d\.\d+)$", done.stdout, re.MULTILINE)
    assert len({rid for rid, _ in rewarded}) == rollouts
    assert re.search(r"^runner-1\s+stopped after \d+ rollouts$", done.stdout, re.MULTILINE)

    winner = re.search(r"^winner\s+(\S+) \(mean reward (\d\.\d+)\)$", done.stdout, re.MULTILINE)
    assert winner is not None, done.stdout
    assert winner.group(1) == favoured_candidate()
    assert f"template: {demo.CANDIDATES[winner.group(1)]!r}" in done.stdout
