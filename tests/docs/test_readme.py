"""Every code block of the docs runs here, as written, and what it prints is checked; every link resolves.

The docs are ``DOCS``: README.md, every page of docs/, bench/README.md and the examples' READMEs. Their
blocks are run against real processes started from the docs' own commands, on free ports and temporary
paths in place of the docs' 4747, 4748, 8000, /tmp/tiny and lightning.db. A block is found by its first
line, in whichever doc holds it. A block that cannot run here (a GPU cluster, the full training run) is
named in ``NOT_RUN`` with the test that covers it, and a new block is an error until it is run or named.

The README's contents link every page of docs/, and every relative link of the docs (file and
``#anchor``, GitHub's heading slugs) points at something that exists.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
#: Every doc whose code blocks are run here or named in ``NOT_RUN``.
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "examples" / "frameworks" / "README.md",
]
BIN = str(Path(sys.executable).parent) + "/"
ELLIPSIS = "…"

#: Blocks not run here (by their first line), and why: each names what covers it instead.
NOT_RUN = {
    "make demo   # sets everything up": "CI runs `make test`; `make demo` is the training run of test_training.py",
    "validation before training": "an output sample of `make demo`; test_training.py checks those lines",
    ".venv/bin/lightning-grpc train examples/combination_lock/config.toml --set": (
        "full training runs; test_training.py runs `train` with --set and --resume on a short experiment"
    ),
    "# 1. one environment: the CUDA build": "needs GPUs and a Ray cluster; `make verl-test` covers its seams",
    ".venv/bin/lightning-grpc runner my_agents:agent": (
        "placeholder module names and a Ray cluster; the walk-through runs the same runner command"
    ),
    "[model]": (
        "sections of examples/combination_lock/vllm.toml, which tests/vllm/test_vllm_training.py trains with"
        " (`make vllm-test`); test_the_real_engines_block_is_the_vllm_examples_settings checks them"
    ),
    "LIGHTNING_GRPC_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/weight_sync.py": (
        "a benchmark (never part of `make test`) of vLLM's environment (`make vllm-env`), minutes long;"
        " tests/vllm/test_vllm_training.py checks vLLM's weight sync step by step (`make vllm-test`)"
    ),
    "LIGHTNING_GRPC_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/trainer_loop.py": (
        "a benchmark (never part of `make test`) of vLLM's environment and 2 Ray ranks; `make bench` runs"
        " bench/trainer_loop.py on the demo's config, tests/vllm/test_vllm_training.py trains vllm.toml"
    ),
    ".venv/bin/python -m lightning_grpc.training.engines extension": (
        "needs vLLM's environment; tests/vllm/test_vllm_training.py runs the extension command and a vLLM"
        " started this way, then trains against it by address (`make vllm-test`)"
    ),
    ".venv/bin/lightning-grpc train examples/frameworks/langgraph_lock.toml": (
        "full training runs of the framework agents (figures in examples/frameworks/README.md);"
        " tests/examples/test_frameworks.py runs each agent through the real runner, proxy and engine"
    ),
    "  user: A two-digit combination lock keeps the barn door shut.": (
        "an output sample of a framework agent's training run; tests/training/test_transcript.py checks how a"
        " transcript shows tool calls"
    ),
    "warning: no learning signal (zero_variance)": (
        "an output sample; tests/training/test_training.py trains a constant-reward task and checks the warning"
        " line, tests/training/test_signal.py every condition"
    ),
    "PYTHONPATH=. .venv/bin/lightning-grpc runner examples.frameworks": (
        "tests/examples/test_frameworks.py runs each framework agent under the real Runner against a store,"
        " the proxy and the engine"
    ),
    ".venv/bin/grpcurl": (
        "tests/server/test_grpcurl.py runs each line as written, against `serve` without and with a token"
    ),
    "export LIGHTNING_GRPC_TOKEN=$(python": (
        "placeholder agent module; tests/server/test_access.py runs the credential command, a fleet started with"
        " the admin token and a runner holding only its credential, and tests/proxy/test_proxy_access.py the proxy"
    ),
    "# on store-a and on store-b: one database": (
        "other machines and a database of their own; tests/store/test_multi_node.py runs a writer and a standby"
        " on one database under a Ray fleet, tests/store/test_postgres_failover.py kills the writer under load"
    ),
    "# on a Ray cluster: every node joins": (
        "a Ray cluster of several machines; tests/store/test_multi_node.py runs two `ray start` nodes and a fleet"
        " spread over them, tests/runner/test_runner.py the runner command's --ray path"
    ),
    "# plain processes, no Ray": (
        "placeholder agent module; tests/server/test_access.py runs the credential command and a runner holding"
        " only its credential, tests/store/test_postgres_failover.py a runner given both store addresses"
    ),
    "# on gpu-1, with the admin token": (
        "needs vLLM on a GPU machine and running stores; tests/training/test_training.py"
        "::test_a_run_trains_through_services_already_running trains through a running store, proxy and engine"
        " with agent.processes = 0"
    ),
    "$ .venv/bin/python examples/multi_node/two_nodes_on_loopback.py": (
        "an output sample of the script; tests/store/test_multi_node.py runs it and checks its report"
    ),
}


@dataclass
class Block:
    language: str
    text: str
    doc: str = "README.md"  # the doc that holds it, relative to the repository root

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0]


def blocks() -> list[Block]:
    """The fenced blocks of every doc, in ``DOCS`` order."""
    return [
        Block(m.group(1), m.group(2), str(doc.relative_to(ROOT)))
        for doc in DOCS
        for m in re.finditer(r"```(\w*)\n(.*?)```", doc.read_text(), re.S)
    ]


def block(first_line: str) -> Block:
    """The one block of all the docs that starts with ``first_line``."""
    found = [b for b in blocks() if b.first_line.startswith(first_line)]
    assert len(found) == 1, f"want one block starting {first_line!r}, got {[b.doc for b in found]}"
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Machine:
    """The README's machine on free ports: its commands are rewritten to these before they run."""

    tmp: Path
    store: int = field(default_factory=free_port)
    proxy: int = field(default_factory=free_port)
    engine: int = field(default_factory=free_port)
    background: list[subprocess.Popen[str]] = field(default_factory=list)

    def rewrite(self, text: str) -> str:
        text = re.sub(r"(?<![\w/])\.venv/bin/", BIN, text).replace("/tmp/tiny", str(self.tmp / "tiny"))
        text = text.replace("lightning.db", str(self.tmp / "lightning.db"))
        text = re.sub(r"\b4747\b", str(self.store), text)
        text = re.sub(r"\b4748\b", str(self.proxy), text)
        return re.sub(r"\b8000\b", str(self.engine), text)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_GRPC_", "OTEL_"))}
        return {**env, "LIGHTNING_GRPC_STORE": f"127.0.0.1:{self.store}", "PYTHONUNBUFFERED": "1"}

    def run(self, command: str, timeout: float = 120) -> str:
        """One line of a bash block (``&`` at the end: started in the background)."""
        command = self.rewrite(command.split("  #")[0].strip())
        if command.endswith("&"):
            log = (self.tmp / f"background-{len(self.background)}.log").open("w")
            self.background.append(
                subprocess.Popen(
                    command[:-1],
                    shell=True,
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
            return ""
        done = subprocess.run(
            command, shell=True, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, done.stderr
        return done.stdout

    def run_block(self, b: Block) -> list[str]:
        """Each command of a bash block in turn; ``ro-…`` is the first rollout the store lists then."""
        outputs = []
        for line in b.text.replace("\\\n", " ").splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            if f"ro-{ELLIPSIS}" in line:
                line = line.replace(f"ro-{ELLIPSIS}", self.first_rollout())
            outputs.append(self.run(line))
        return outputs

    def first_rollout(self) -> str:
        listed = self.run(".venv/bin/lightning-grpc rollouts --json").splitlines()
        return str(json.loads(listed[0])["rollout_id"])

    def python(self, code: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [sys.executable, "-c", self.rewrite(code)],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def wait_for_store(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.store), 1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"no store on port {self.store} after {timeout} s")

    def stop(self) -> None:
        for process in self.background:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for process in self.background:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def expected_output(code: str) -> list[str]:
    """What a block says it prints: the comment after each ``print(...)``."""
    return [line.split("# ", 1)[1].strip() for line in code.splitlines() if line.strip().startswith("print(")]


def table(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[1:] if line.strip()]


# ---------------------------------------------------------------- the Quickstart
@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    machine = Machine(tmp_path_factory.mktemp("quickstart"))
    try:
        machine.run(block(".venv/bin/lightning-grpc serve --host").text.strip() + " &")
        machine.wait_for_store()
        yield machine
    finally:
        machine.stop()


def test_every_block_is_run_here_or_named_with_what_covers_it() -> None:
    run_here = {
        ".venv/bin/lightning-grpc serve --host",
        "import asyncio",
        ".venv/bin/lightning-grpc rollouts --status running",
        ".venv/bin/buf curl",
        "from lightning_grpc.runner import rollout",
        ".venv/bin/lightning-grpc init-model /tmp/tiny",
        "export OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "from lightning_grpc.client import TrainerClient",
        ".venv/bin/lightning-grpc triplets",
        ".venv/bin/lightning-grpc serve --memory --port 4747 &",
        ".venv/bin/python bench/auth_cost.py",
        "# the OpenAI Agents SDK, on the Responses API",
    }
    assert {doc.relative_to(ROOT).as_posix() for doc in DOCS} >= {"README.md", "docs/training.md"}
    for b in blocks():
        covered = [key for key in (*run_here, *NOT_RUN) if b.first_line.startswith(key)]
        assert len(covered) == 1, f"{b.doc} block not run by a test: {b.first_line!r}"
    for key in (*run_here, *NOT_RUN):  # a key whose block went away is stale
        assert any(b.first_line.startswith(key) for b in blocks()), f"no block starts with {key!r}"


def test_the_quickstart_program_prints_what_it_says(quickstart: Machine) -> None:
    code = block("import asyncio").text
    assert quickstart.python(code).splitlines() == expected_output(code) == ["succeeded 1.0"]


def test_looking_at_a_running_store(quickstart: Machine) -> None:
    quickstart.python(block("import asyncio").text)  # a rollout to look at
    running, one, spans, workers_resources_stats = quickstart.run_block(
        block(".venv/bin/lightning-grpc rollouts --status running")
    )
    assert all(row[1] == "running" for row in table(running))
    fields = dict(line.split(":", 1) for line in one.split("\ninput:")[0].splitlines())
    assert fields["status"].strip() == "succeeded" and fields["reward"].strip() == "1"
    assert spans.rstrip().endswith("reward=1.0")  # --follow ended with the rollout
    assert "runner-1" in workers_resources_stats and "prompt:prompt_template" in workers_resources_stats
    assert "backend" in workers_resources_stats and "sqlite" in workers_resources_stats


def test_buf_curl_lists_the_methods_and_calls_one(quickstart: Machine) -> None:
    methods, statistics = quickstart.run_block(block(".venv/bin/buf curl"))
    assert "lightning.v1.StoreService/GetStatistics" in methods.split()
    assert "lightning.v1.TrainerService/GetBatch" in methods.split()
    assert json.loads(statistics)["backend"] == "sqlite"


def test_the_otlp_settings_send_an_sdk_span_to_the_store(quickstart: Machine) -> None:
    from lightning_grpc.client import SyncStoreClient

    with SyncStoreClient(f"127.0.0.1:{quickstart.store}") as client:
        ro = client.start_rollout({"otlp": True}, worker_id="sdk")
    ids = {f"ro-{ELLIPSIS}": ro.rollout_id, f"at-{ELLIPSIS}": ro.latest_attempt.attempt_id}
    exports = block("export OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").text
    for placeholder, value in ids.items():
        exports = exports.replace(placeholder, value)
    sender = (
        "from opentelemetry import trace\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))\n"
        "with provider.get_tracer('readme').start_as_current_span('from-the-sdk'):\n"
        "    pass\n"
        "provider.shutdown()\n"
    )
    script = quickstart.rewrite(exports) + f'\n{sys.executable} -c "{sender}"\n'
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=ROOT, env=quickstart.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    with SyncStoreClient(f"127.0.0.1:{quickstart.store}") as client:
        spans = client.query_spans(ro.rollout_id)
    assert [s.name for s in spans] == ["from-the-sdk"]


# ---------------------------------------------------------------- running agents
def test_the_agent_in_the_readme_is_the_example_file() -> None:
    code = (ROOT / "examples" / "first_agent" / "agent.py").read_text()
    assert code.split('"""\n\n', 1)[1] == block("from lightning_grpc.runner import rollout").text


def test_bring_your_agent_quotes_the_framework_examples_own_lines() -> None:
    """Each excerpt of "Bring your agent" is its example file's lines, in their order (the files run in
    tests/examples/test_frameworks.py)."""
    excerpt = block("# the OpenAI Agents SDK, on the Responses API").text
    quoted: dict[str, list[str]] = {}
    for line in excerpt.splitlines():
        named = re.search(r"\((examples/frameworks/\w+\.py)\)$", line)
        if named:
            current = quoted.setdefault(named.group(1), [])
        elif line.strip():
            current.append(line.strip())
    assert sorted(quoted) == [
        "examples/frameworks/anthropic_lock.py",
        "examples/frameworks/langgraph_lock.py",
        "examples/frameworks/openai_agents_lock.py",
    ]
    for path, lines in quoted.items():
        remaining = iter(line.strip() for line in (ROOT / path).read_text().splitlines())
        for line in lines:
            assert any(line == candidate for candidate in remaining), f"{path}: {line!r} is not its line"


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Machine, list[str]]]:
    machine = Machine(tmp_path_factory.mktemp("walkthrough"))
    try:
        yield machine, machine.run_block(block(".venv/bin/lightning-grpc init-model /tmp/tiny"))
    finally:
        machine.stop()


def test_the_walkthrough_plays_every_rollout_through_the_proxy(
    walkthrough: tuple[Machine, list[str]],
) -> None:
    _machine, (_init, _engine, _serve, published, queued, runner, rollouts, spans) = walkthrough
    assert published.startswith("published rs-")
    assert "succeeded=8 failed=0" in runner and "ERROR" not in runner  # its connections closed, too
    assert len(table(queued)) == 8
    rows = table(rollouts)
    assert len(rows) == 8
    assert all(row[1] == "succeeded" and row[2] in ("0", "1") for row in rows), rollouts
    names = [line.split()[2] for line in spans.splitlines()]
    assert names == ["lightning.llm.call", "lightning.operation", "lightning.reward", "lightning.rollout"]
    assert "lightning.operation.name=grade" in spans


def test_the_trainer_examples_run_on_the_walkthroughs_rollouts(
    walkthrough: tuple[Machine, list[str]],
) -> None:
    machine, _ = walkthrough
    triplets, decoded, status = machine.run_block(block(".venv/bin/lightning-grpc triplets"))
    assert "triplets" in triplets.lower() or "prompt" in triplets.lower()
    assert decoded.strip() and status.strip()


def test_the_trainer_client_block_gets_a_batch_of_whole_groups(
    walkthrough: tuple[Machine, list[str]],
) -> None:
    machine, _ = walkthrough
    machine.run(  # plays the groups the block submits
        ".venv/bin/lightning-grpc runner examples/first_agent/agent.py:agent --concurrency 8 --max-rollouts 16 &"
    )
    code = block("from lightning_grpc.client import TrainerClient").text
    program = (
        "import asyncio\n\nasync def main():\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "\nasyncio.run(main())\n"
    )
    assert machine.python(program, timeout=180).splitlines() == expected_output(code)


def test_the_real_engines_block_is_the_vllm_examples_settings() -> None:
    import tomllib

    shown = tomllib.loads(block("[model]").text)
    example = tomllib.loads((ROOT / "examples" / "combination_lock" / "vllm.toml").read_text())
    for section, values in shown.items():
        for key, value in values.items():
            assert example[section][key] == value, (section, key)


# ---------------------------------------------------------------- bench/README.md
def test_the_trainer_batch_benchmark_runs_as_written(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    serve, *benchmarks = (
        block(".venv/bin/lightning-grpc serve --memory --port 4747 &").text.strip().splitlines()
    )
    try:
        machine.run(serve)
        machine.wait_for_store()
        for command in benchmarks:
            printed = [
                line for line in machine.run(command, timeout=300).splitlines() if line.startswith("{")
            ]
            report = json.loads(printed[-1])
            assert (
                report["workload"] == "trainer_batch" and report["speedup"] > 0 and report["wire_ratio"] > 0
            )
            assert set(report["regimes"]) == {"tiny_2048", "qwen_151646"}
            assert all(regime["identical_arrays"] for regime in report["regimes"].values())
    finally:
        machine.stop()


def test_the_access_cost_benchmark_runs_as_written(tmp_path: Path) -> None:
    (command,) = block(".venv/bin/python bench/auth_cost.py").text.strip().splitlines()
    out = tmp_path / "auth_cost.json"  # not the committed bench/results/auth_cost.json
    printed = Machine(tmp_path).run(f"{command} --out {out}", timeout=400)
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"open", "admin", "runner"} and all(rate > 0 for rate in medians.values())
    assert "rollouts/s" in printed


# ---------------------------------------------------------------- links and contents
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def without_blocks(text: str) -> str:
    """The doc without its fenced blocks, where a ``#`` line is no heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def without_code(text: str) -> str:
    """The doc without its fenced blocks and inline code, where ``[..](..)`` is no link."""
    return re.sub(r"`[^`\n]*`", "", without_blocks(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link: its text
    return re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor in ``doc``, repeats numbered as GitHub numbers them (``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in without_blocks(doc.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if not heading:
            continue
        base = slug(heading.group(1))
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def links(doc: Path) -> list[str]:
    return LINK.findall(without_code(doc.read_text()))


def test_slugs_are_githubs() -> None:
    assert slug("Train an agent: `make demo`") == "train-an-agent-make-demo"
    assert slug("Real engines: vLLM serves, FSDP ranks placed by Ray learn") == (
        "real-engines-vllm-serves-fsdp-ranks-placed-by-ray-learn"
    )
    assert slug("Training batch (`trainer_batch.py`)") == "training-batch-trainer_batchpy"
    assert slug("The loop against direct generation (`trainer_loop.py --config`)") == (
        "the-loop-against-direct-generation-trainer_looppy---config"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(ROOT).as_posix())
def test_every_relative_link_of_the_docs_points_at_something_that_exists(doc: Path) -> None:
    for target in links(doc):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        assert resolved.exists(), f"{doc.relative_to(ROOT)} links to {target!r}: no such file"
        if anchor:
            assert resolved.suffix == ".md", f"{doc.relative_to(ROOT)}: an anchor into {target!r}"
            assert anchor in anchors(resolved), (
                f"{doc.relative_to(ROOT)} links to {target!r}: no such heading"
            )


def test_the_readme_has_contents_that_link_its_sections_and_every_docs_page() -> None:
    contents = README.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    listed = LINK.findall(contents)
    sections = {slug(h) for h in re.findall(r"^## (.*)$", without_blocks(README), re.M)} - {"contents"}
    assert sections and sections <= {target[1:] for target in listed if target.startswith("#")}
    pages = {page.relative_to(ROOT).as_posix() for page in (ROOT / "docs").glob("*.md")}
    assert pages and pages <= set(listed), (
        f"docs pages missing from the README's contents: {pages - set(listed)}"
    )
    assert {"ARCHITECTURE.md", "bench/README.md", "examples/README.md"} <= set(listed)


def test_the_readme_stays_a_front_door() -> None:
    assert len(README.splitlines()) <= 270
    assert "<!-- bench:start -->" in (ROOT / "bench" / "README.md").read_text()
