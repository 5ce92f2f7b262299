"""The recipes of clients/README.md, run as written, and clients/python/lgrpcurl.py, against live servers.

The ``sh`` blocks of the README are taken from the file itself and run with bash (only the
address is swapped for the test server's), using the real ``buf`` binary. The server runs on the
test's event loop, so every command goes through asyncio subprocesses, never a blocking call.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from lightning_grpc.server.app import RunningServer, ServerConfig, TlsFiles, start_server
from lightning_grpc.v1 import rollout_pb2, span_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc
from tests.helpers import serving

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "clients" / "README.md"
LGRPCURL = ROOT / "clients" / "python" / "lgrpcurl.py"
BIN = Path(sys.executable).parent
BUF = shutil.which("buf", path=str(BIN)) or shutil.which("buf")
STORE = pb.DESCRIPTOR.services_by_name["StoreService"]
README_ADDRESS = "127.0.0.1:4747"
TOKEN = "s3cret"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
STEP = 10.0  # seconds to wait for one line of a live stream

needs_buf = pytest.mark.skipif(BUF is None, reason="buf is not installed (pip install buf-bin)")


# ------------------------------------------------------------------------------------------ output


def json_documents(text: str) -> list[Any]:
    """The JSON documents of a text, one after the other (pretty-printed or one per line)."""
    decoder = json.JSONDecoder()
    documents, rest = [], text.strip()
    while rest:
        document, end = decoder.raw_decode(rest)
        documents.append(document)
        rest = rest[end:].lstrip()
    return documents


def first_json(text: str) -> Any:
    """The first JSON object of a text that may hold other lines (grpc's own logs) around it."""
    return json.JSONDecoder().raw_decode(text[text.index("{") :])[0]


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def documents(self) -> list[Any]:
        return json_documents(self.stdout)

    def __str__(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


async def run(
    argv: list[str], *, stdin: str | None = None, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> Result:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


class LiveOutput:
    """A command that keeps streaming (a follow or a watch): read its JSON documents as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._pending = ""
        self._decoder = json.JSONDecoder()

    @classmethod
    async def start(
        cls, argv: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None
    ) -> LiveOutput:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # one process group: bash and the buf it starts stop together
        )
        return cls(proc)

    async def next_document(self) -> Any:
        assert self.proc.stdout is not None
        while True:
            text = self._pending.lstrip()
            if text:
                try:
                    document, end = self._decoder.raw_decode(text)
                except json.JSONDecodeError:
                    pass
                else:
                    self._pending = text[end:]
                    return document
            line = await asyncio.wait_for(self.proc.stdout.readline(), STEP)
            if not line:
                err = await self.proc.stderr.read() if self.proc.stderr else b""
                raise AssertionError(f"the stream ended (exit {await self.proc.wait()}): {err.decode()}")
            self._pending = text + line.decode()

    async def document_where(self, wanted: Callable[[Any], bool], limit: int = 20) -> tuple[Any, list[Any]]:
        """The first document for which ``wanted`` holds, and those seen before it."""
        seen: list[Any] = []
        for _ in range(limit):
            document = await self.next_document()
            if wanted(document):
                return document, seen
            seen.append(document)
        raise AssertionError(f"no wanted document among {seen}")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        await asyncio.wait_for(self.proc.wait(), 10)


# ------------------------------------------------------------------------------------------ README


def readme_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the README."""
    return re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), re.M | re.S)


def readme_block(marker: str, language: str = "sh") -> str:
    found = [body for kind, body in readme_blocks() if kind == language and marker in body]
    assert len(found) == 1, (
        f"want one {language} block of clients/README.md with {marker!r}, got {len(found)}"
    )
    return found[0]


def readme_json(marker: str) -> Any:
    return json.loads(readme_block(marker, "json"))


@dataclass
class Shell:
    """Runs README blocks with bash after the README's own prelude (bcurl, SERVER, STORE)."""

    address: str
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, block: str) -> list[str]:
        script = readme_block("bcurl() {") + block
        return ["bash", "-c", script.replace(README_ADDRESS, self.address)]

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **self.env}

    async def run(self, block: str, stdin: str | None = None) -> Result:
        return await run(self.argv(block), stdin=stdin, cwd=self.cwd, env=self.environment())

    async def start(self, block: str) -> LiveOutput:
        return await LiveOutput.start(self.argv(block), cwd=self.cwd, env=self.environment())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory that looks like the repository root to the recipes."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


# ------------------------------------------------------------------------------------------ servers


@pytest_asyncio.fixture
async def store() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=0.5)) as running:
        yield running


@pytest_asyncio.fixture
async def guarded_store() -> AsyncIterator[RunningServer]:
    async with serving(ServerConfig(port=0, grace=0.5, token=TOKEN)) as running:
        yield running


@pytest.fixture
def sh(store: RunningServer, workdir: Path) -> Shell:
    return Shell(f"127.0.0.1:{store.port}", workdir)


def address_of(server: RunningServer) -> str:
    return f"127.0.0.1:{server.port}"


@pytest_asyncio.fixture
async def stub(store: RunningServer) -> AsyncIterator[pb_grpc.StoreServiceAsyncStub]:
    async with grpc.aio.insecure_channel(address_of(store)) as channel:
        yield pb_grpc.StoreServiceStub(channel)


async def claim(stub: pb_grpc.StoreServiceAsyncStub, rollout_id: str = "ro-demo-1") -> str:
    """Enqueues a rollout, dequeues it and returns the attempt id."""
    await stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec(rollout_id=rollout_id)]))
    claimed = await stub.DequeueRollouts(pb.DequeueRolloutsRequest(worker_id="worker-1"))
    assert claimed.rollouts[0].rollout_id == rollout_id
    return claimed.rollouts[0].latest_attempt.attempt_id


async def add_span(stub: pb_grpc.StoreServiceAsyncStub, attempt_id: str, span_id: str, name: str) -> None:
    span = span_pb2.Span(trace_id=TRACE_ID, span_id=span_id, name=name)
    await stub.AddSpans(pb.AddSpansRequest(rollout_id="ro-demo-1", attempt_id=attempt_id, spans=[span]))


# ------------------------------------------------------------------------------------------ README checks


def heredoc_requests(block: str) -> Iterator[tuple[str, str]]:
    """(method, JSON line) of every request a block writes in a heredoc."""
    for opening, body in re.findall(r"^(.*<<EOF)\n(.*?)^EOF", block, re.M | re.S):
        method = "AddSpansStream" if "spans.ndjson" in opening else re.findall(r"\$STORE/(\w+)", opening)[0]
        for line in body.splitlines():
            yield method, line.replace("$ATTEMPT", "at-0123456789ab")


def inline_requests(block: str) -> Iterator[tuple[str, str]]:
    for service, method, data in re.findall(
        r"(\$STORE|[\w.]+\.\w+Service|[\w.]+Health)/(\w+) -d '([^']*)'", block
    ):
        yield ("Health." if "Health" in service else "") + method, data


def request_class(method: str) -> Any:
    if method.startswith("Health."):
        return health_pb2.HealthCheckRequest
    assert method in STORE.methods_by_name, f"README names an unknown method {method!r}"
    return message_factory.GetMessageClass(STORE.methods_by_name[method].input_type)


def test_readme_requests_are_valid_messages_of_their_methods() -> None:
    checked = 0
    for language, block in readme_blocks():
        if language != "sh":
            continue
        for method, data in [*inline_requests(block), *heredoc_requests(block)]:
            json_format.Parse(data, request_class(method)())
            checked += 1
    assert checked >= 15  # the README has about twenty; a broken regex would find none


def load_lgrpcurl() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lgrpcurl", LGRPCURL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_lgrpcurl_lines_are_valid_command_lines() -> None:
    parser = load_lgrpcurl().build_parser()
    block = readme_block('LG=".venv/bin/python clients/python/lgrpcurl.py')
    prefix = shlex.split(re.findall(r'^LG="(.*)"$', block, re.M)[0])[2:]
    lines = [line.split("$LG", 1)[1] for line in block.splitlines() if "$LG " in line]
    assert len(lines) == 7
    for line in lines:
        args = parser.parse_args([*prefix, *shlex.split(line, comments=True)])
        if args.command == "call" and not args.data.startswith("@"):
            method = args.method.rsplit("/", 1)[1]
            json_format.Parse(args.data, request_class(method)())


# ------------------------------------------------------------------------------------------ buf curl


async def test_readme_serve_recipe_starts_a_server() -> None:
    line = readme_block("lightning-grpc serve").splitlines()[0]
    if not (ROOT / shlex.split(line)[0]).exists():
        pytest.skip("the project is not installed in .venv")
    argv = [arg if arg != "4747" else "0" for arg in shlex.split(line)]
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        assert proc.stdout is not None
        while b"event=server_started" not in (
            line_read := await asyncio.wait_for(proc.stdout.readline(), 20)
        ):
            assert line_read, "the server exited before it started"
        assert b"backend=memory" in line_read
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)


@needs_buf
async def test_buf_lists_services_and_methods_through_reflection(sh: Shell) -> None:
    result = await sh.run(readme_block("--list-services"))
    assert result.rc == 0, result
    lines = result.stdout.split()
    assert {"grpc.health.v1.Health", "lightning.v1.StoreService", "grpc.health.v1.Health/Check"} <= set(lines)
    assert {f"lightning.v1.StoreService/{m.name}" for m in STORE.methods} <= set(lines)


@needs_buf
async def test_buf_health_check_reports_serving(sh: Shell) -> None:
    result = await sh.run(readme_block("$SERVER/grpc.health.v1.Health/Check"))
    assert result.rc == 0, result
    assert result.documents == [{"status": "SERVING"}, {"status": "SERVING"}]


@needs_buf
async def test_buf_unary_recipes_take_a_rollout_from_the_queue_to_success(sh: Shell) -> None:
    enqueued = await sh.run(readme_block('"rolloutId": "ro-demo-1", "input"'))
    assert enqueued.rc == 0, enqueued
    (rollout,) = enqueued.documents[0]["rollouts"]
    assert rollout["rolloutId"] == "ro-demo-1"
    assert rollout["status"] == "ROLLOUT_STATUS_QUEUING"
    assert rollout["config"]["retryOn"] == ["ATTEMPT_STATUS_FAILED"]

    if shutil.which("jq"):
        dequeued = await sh.run(readme_block("ATTEMPT=$("))
        assert dequeued.rc == 0, dequeued
        sh.env["ATTEMPT"] = dequeued.stdout.strip()
    else:  # the same call without jq
        dequeued = await sh.run(
            'bcurl $STORE/DequeueRollouts -d \'{"workerId": "worker-1", "maxRollouts": 1}\''
        )
        sh.env["ATTEMPT"] = dequeued.documents[0]["rollouts"][0]["latestAttempt"]["attemptId"]
    assert sh.env["ATTEMPT"].startswith("at-")

    spans = await sh.run(readme_block("$STORE/AddSpans -d @-"))
    assert spans.rc == 0, spans
    assert spans.documents == [{"sequenceIds": ["1"], "storedCount": 1}]

    finished = await sh.run(readme_block("$STORE/CompleteAttempt"))
    assert finished.rc == 0, finished
    completed, got = finished.documents
    assert completed["attempt"]["status"] == "ATTEMPT_STATUS_SUCCEEDED"
    assert got["rollout"]["status"] == "ROLLOUT_STATUS_SUCCEEDED"
    assert got["rollout"]["latestAttempt"]["attemptId"] == sh.env["ATTEMPT"]


@needs_buf
async def test_buf_lists_with_filters_and_follows_the_page_token(
    sh: Shell, stub: pb_grpc.StoreServiceAsyncStub
) -> None:
    await stub.EnqueueRollouts(pb.EnqueueRolloutsRequest(rollouts=[pb.RolloutSpec(group_id="other")]))
    first = await sh.run(readme_block('"input": "a", "groupId": "batch-7"'))
    assert first.rc == 0, first
    enqueued, page1 = first.documents
    assert len(page1["rollouts"]) == 2 and page1["totalSize"] == "3"
    assert page1["nextPageToken"]

    block = readme_block('"pageToken": "eyJwIjoyLCJm..."').replace("eyJwIjoyLCJm...", page1["nextPageToken"])
    second = await sh.run(block)
    assert second.rc == 0, second
    (page2,) = second.documents
    assert "nextPageToken" not in page2 and page2["totalSize"] == "3"
    listed = [r["rolloutId"] for r in page1["rollouts"] + page2["rollouts"]]
    assert sorted(listed) == sorted(r["rolloutId"] for r in enqueued["rollouts"])


@needs_buf
async def test_buf_tail_spans_once_and_with_follow(sh: Shell, stub: pb_grpc.StoreServiceAsyncStub) -> None:
    attempt = await claim(stub)
    await add_span(stub, attempt, "00f067aa0ba902b7", "llm.generate")
    once = await sh.run(readme_block("""TailSpans -d '{"selector": {"rolloutId": "ro-demo-1"}}'"""))
    assert once.rc == 0, once
    assert [s["spanId"] for d in once.documents for s in d["spans"]] == ["00f067aa0ba902b7"]

    live = await sh.start(
        readme_block('TailSpans -d \'{"selector": {"rolloutId": "ro-demo-1", "attemptId": "latest"}')
    )
    try:
        assert [s["name"] for s in (await live.next_document())["spans"]] == ["llm.generate"]
        await add_span(stub, attempt, "00f067aa0ba902b8", "tool.call")
        later = await live.next_document()
        assert [(s["spanId"], s["sequenceId"]) for s in later["spans"]] == [("00f067aa0ba902b8", "2")]
    finally:
        await live.stop()


@needs_buf
async def test_buf_watch_rollouts_streams_changes_and_resumes(
    sh: Shell, stub: pb_grpc.StoreServiceAsyncStub
) -> None:
    live = await sh.start(readme_block('"progressInterval": "10s"'))
    try:
        progress = await live.next_document()
        assert "rollout" not in progress and progress["resumeToken"]
        attempt = await claim(stub, "ro-watched")
        change, _ = await live.document_where(lambda d: "rollout" in d)
        assert change["rollout"]["rolloutId"] == "ro-watched"
        assert change["rollout"]["status"] == "ROLLOUT_STATUS_QUEUING"
    finally:
        await live.stop()

    done = pb.CompleteAttemptRequest(
        rollout_id="ro-watched", attempt_id=attempt, status=rollout_pb2.ATTEMPT_STATUS_SUCCEEDED
    )
    await stub.CompleteAttempt(done)
    block = readme_block('WatchRollouts -d \'{"resumeToken": "23237d2c62b1.8"').replace(
        "23237d2c62b1.8", progress["resumeToken"]
    )
    resumed = await sh.start(block)
    try:
        finished, before = await resumed.document_where(lambda d: "rollout" in d)
        assert finished["rollout"]["rolloutId"] == "ro-watched"
        assert finished["rollout"]["status"] == "ROLLOUT_STATUS_SUCCEEDED"  # the status filter holds
        assert all("rollout" not in d for d in before)
    finally:
        await resumed.stop()


@needs_buf
async def test_buf_bidi_stream_acks_each_batch_from_a_file_and_from_stdin(
    sh: Shell, stub: pb_grpc.StoreServiceAsyncStub
) -> None:
    sh.env["ATTEMPT"] = await claim(stub)
    from_file = await sh.run(readme_block("cat > spans.ndjson"))
    assert from_file.rc == 0, from_file
    assert from_file.documents == [{"batchId": "1", "storedCount": 1}, {"batchId": "2", "storedCount": 2}]

    from_stdin = await sh.run(readme_block("cat spans.ndjson | bcurl"))
    assert from_stdin.rc == 0, from_stdin
    assert from_stdin.documents == [
        {"batchId": "1", "duplicateCount": 1},
        {"batchId": "2", "duplicateCount": 2},
    ]

    bad_span = {"traceId": TRACE_ID, "spanId": "xyz", "name": "oops"}
    bad = {"batchId": "3", "rolloutId": "ro-demo-1", "attemptId": sh.env["ATTEMPT"], "spans": [bad_span]}
    refused = await sh.run("bcurl $STORE/AddSpansStream -d @-", stdin=json.dumps(bad) + "\n")
    assert refused.rc == 0, refused
    assert refused.documents == [readme_json('"batchId": "3"')]

    stored = await stub.ListSpans(pb.ListSpansRequest(selector=pb.SpanSelector(rollout_id="ro-demo-1")))
    assert [s.name for s in stored.spans] == ["agent.step", "tool.call", "reward"]


@needs_buf
async def test_buf_auth_header_is_required_but_health_and_reflection_stay_open(
    guarded_store: RunningServer, workdir: Path
) -> None:
    sh = Shell(address_of(guarded_store), workdir)
    result = await sh.run(readme_block("Bearer s3cret"))
    assert result.rc == 16 << 3, result  # the second call, without the header
    assert result.documents[0]["backend"] == "memory"  # the first, with it
    error = first_json(result.stderr)
    assert error["code"] == "unauthenticated" and "missing bearer token" in error["message"]

    health = await sh.run(readme_block("$SERVER/grpc.health.v1.Health/Check"))
    assert health.documents == [{"status": "SERVING"}, {"status": "SERVING"}], health
    listed = await sh.run(readme_block("--list-services"))
    assert "lightning.v1.StoreService/GetStatistics" in listed.stdout, listed
    both = await sh.run(f"bcurl --reflect-header '*' -H 'authorization: Bearer {TOKEN}' $STORE/GetStatistics")
    assert both.rc == 0, both


@needs_buf
async def test_buf_error_is_not_found_with_an_error_info_that_decodes(sh: Shell) -> None:
    result = await sh.run(readme_block("""bcurl $STORE/GetRollout -d '{"rolloutId": "ro-missing"}'"""))
    assert result.rc == 5 << 3, result
    assert result.stdout == ""
    error = json.loads(result.stderr)
    assert error == readme_json('"type": "google.rpc.ErrorInfo"')
    value = error["details"][0]["value"]
    info = error_details_pb2.ErrorInfo.FromString(base64.b64decode(value + "=" * (-len(value) % 4)))
    assert (info.reason, info.domain, dict(info.metadata)) == (
        "ROLLOUT_NOT_FOUND",
        "lightning-grpc.dev",
        {"rolloutId": "ro-missing"},
    )

    decoded = await sh.run(readme_block("buf convert"))
    assert decoded.rc == 0, decoded
    assert decoded.documents == [json_format.MessageToDict(info)]


@needs_buf
async def test_buf_and_lgrpcurl_over_tls_with_a_private_ca(workdir: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(workdir / "ca.pem"))
    cert.private_key_pem.write_to_path(str(workdir / "server.key"))
    (workdir / "server.pem").write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    tls = TlsFiles(cert_chain=workdir / "server.pem", private_key=workdir / "server.key")
    running = await start_server(ServerConfig(port=0, grace=0.5, tls=tls))
    try:
        sh = Shell(address_of(running), workdir)
        result = await sh.run(readme_block("--cacert ca.pem https://"))
        assert result.rc == 0, result
        assert result.documents[0]["backend"] == "memory"
        lg = await lgrpcurl(
            "--cacert", str(workdir / "ca.pem"), address_of(running), "call", "grpc.health.v1.Health/Check"
        )
        assert lg.rc == 0, lg
        assert lg.documents == [{"status": "SERVING"}]
    finally:
        await running.stop()


@needs_buf
async def test_buf_without_reflection_takes_the_schema_from_the_repository(sh: Shell) -> None:
    for marker in ("bcurl --schema . ", "buf build -o lightning.binpb"):
        result = await sh.run(readme_block(marker))
        assert result.rc == 0, result
        assert result.documents[-1]["backend"] == "memory"
    assert (sh.cwd / "lightning.binpb").stat().st_size > 1000


@needs_buf
async def test_buf_generate_template_is_valid(workdir: Path) -> None:
    plugin = BIN / "protoc-gen-mypy"
    if not plugin.exists():
        pytest.skip("protoc-gen-mypy is not installed")
    template = readme_block("go_package_prefix", "yaml")
    local = f"plugins:\n  - local: {plugin}\n    out: gen/py\ninputs:"
    (workdir / "buf.gen.yaml").write_text(
        re.sub(r"^plugins:\n.*?^inputs:", local, template, flags=re.M | re.S)
    )
    result = await run([str(BUF), "generate"], cwd=workdir)
    assert result.rc == 0, result
    assert (workdir / "gen/py/lightning/v1/store_service_pb2.pyi").exists()


async def test_protoc_recipe_generates_python_stubs(workdir: Path) -> None:
    result = await Shell("unused", workdir).run(readme_block("--grpc_python_out"))
    assert result.rc == 0, result
    generated = workdir / "gen/py/lightning/v1"
    assert {"store_service_pb2.py", "store_service_pb2.pyi", "store_service_pb2_grpc.py"} <= {
        p.name for p in generated.iterdir()
    }


# ------------------------------------------------------------------------------------------ lgrpcurl


async def lgrpcurl(*args: str, stdin: str | None = None) -> Result:
    return await run([sys.executable, str(LGRPCURL), *args], stdin=stdin)


def plain(server: RunningServer) -> list[str]:
    return ["--plaintext", address_of(server)]


def lines_as_json(result: Result) -> list[Any]:
    """lgrpcurl prints one compact JSON object per line."""
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_lgrpcurl_lists_and_describes(store: RunningServer) -> None:
    services, methods, service, message, oneof, enum, unknown = await asyncio.gather(
        lgrpcurl(*plain(store), "list"),
        lgrpcurl(*plain(store), "list", "lightning.v1.StoreService"),
        lgrpcurl(*plain(store), "describe", "lightning.v1.StoreService"),
        lgrpcurl(*plain(store), "describe", "lightning.v1.Span"),
        lgrpcurl(*plain(store), "describe", "lightning.v1.AnyValue"),
        lgrpcurl(*plain(store), "describe", "lightning.v1.RolloutStatus"),
        lgrpcurl(*plain(store), "describe", "lightning.v1.NoSuchThing"),
    )
    assert services.stdout.split() == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "lightning.v1.StoreService",
        "lightning.v1.TrainerService",
        "opentelemetry.proto.collector.trace.v1.TraceService",
    ], services
    assert methods.stdout.split() == [f"lightning.v1.StoreService/{m.name}" for m in STORE.methods]
    assert (
        "rpc AddSpansStream(stream lightning.v1.AddSpansStreamRequest) returns "
        "(stream lightning.v1.AddSpansStreamResponse);" in service.stdout
    )
    assert (
        "rpc TailSpans(lightning.v1.TailSpansRequest) returns (stream lightning.v1.TailSpansResponse);"
        in (service.stdout)
    )
    assert "  map<string, lightning.v1.AnyValue> attributes = 12;" in message.stdout
    assert "  repeated lightning.v1.SpanEvent events = 13;" in message.stdout
    assert "  oneof value {\n    string string_value = 1;" in oneof.stdout
    assert "  ROLLOUT_STATUS_SUCCEEDED = 5;" in enum.stdout
    assert unknown.rc == 2 and "NoSuchThing" in unknown.stderr


async def test_lgrpcurl_unary_calls_print_one_json_object_per_response(store: RunningServer) -> None:
    spec = '{"rollouts": [{"rollout_id": "ro-lg-1", "input": {"n": 1}, "mode": "ROLLOUT_MODE_VAL"}]}'
    enqueued = await lgrpcurl(*plain(store), "call", "lightning.v1.StoreService/EnqueueRollouts", "-d", spec)
    assert enqueued.rc == 0, enqueued
    assert lines_as_json(enqueued)[0]["rollouts"][0]["input"] == {"n": 1}

    got, defaults = await asyncio.gather(
        lgrpcurl(
            *plain(store), "call", "lightning.v1.StoreService.GetRollout", "-d", '{"rolloutId": "ro-lg-1"}'
        ),
        lgrpcurl(*plain(store), "call", "/lightning.v1.StoreService/GetStatistics", "--emit-defaults"),
    )
    (rollout,) = lines_as_json(got)
    assert rollout["rollout"]["rolloutId"] == "ro-lg-1"
    assert rollout["rollout"]["mode"] == "ROLLOUT_MODE_VAL"
    (stats,) = lines_as_json(defaults)
    assert stats["totalRollouts"] == "1" and stats["totalSpans"] == "0"  # 0 only shows with --emit-defaults


async def test_lgrpcurl_server_stream_once_and_with_follow(
    store: RunningServer, stub: pb_grpc.StoreServiceAsyncStub
) -> None:
    attempt = await claim(stub)
    await add_span(stub, attempt, "00f067aa0ba902b7", "llm.generate")
    method = "lightning.v1.StoreService/TailSpans"
    once = await lgrpcurl(*plain(store), "call", method, "-d", '{"selector": {"rolloutId": "ro-demo-1"}}')
    assert once.rc == 0, once
    assert [[s["name"] for s in d["spans"]] for d in lines_as_json(once)] == [["llm.generate"]]

    follow = '{"selector": {"rolloutId": "ro-demo-1"}, "follow": true}'
    live = await LiveOutput.start(
        [sys.executable, str(LGRPCURL), *plain(store), "call", method, "-d", follow]
    )
    try:
        assert (await live.next_document())["spans"][0]["spanId"] == "00f067aa0ba902b7"
        await add_span(stub, attempt, "00f067aa0ba902b8", "tool.call")
        assert (await live.next_document())["spans"][0]["spanId"] == "00f067aa0ba902b8"
    finally:
        await live.stop()


async def test_lgrpcurl_bidi_stream_reads_requests_from_stdin(
    store: RunningServer, stub: pb_grpc.StoreServiceAsyncStub
) -> None:
    attempt = await claim(stub)
    batches = [
        {"batchId": str(n), "rolloutId": "ro-demo-1", "attemptId": attempt, "spans": spans}
        for n, spans in enumerate(
            [
                [{"traceId": TRACE_ID, "spanId": "00000000000000a1", "name": "one"}],
                [{"traceId": TRACE_ID, "spanId": f"00000000000000b{i}", "name": "two"} for i in range(3)],
            ],
            start=1,
        )
    ]
    method = "lightning.v1.StoreService/AddSpansStream"
    ndjson = "".join(json.dumps(b) + "\n" for b in batches)
    acks = await lgrpcurl(*plain(store), "call", method, "-d", "@-", stdin=ndjson)
    assert acks.rc == 0, acks
    assert lines_as_json(acks) == [{"batchId": "1", "storedCount": 1}, {"batchId": "2", "storedCount": 3}]

    pretty = "".join(json.dumps(b, indent=2) + "\n" for b in batches)  # multi-line documents work too
    again = await lgrpcurl(*plain(store), "call", method, "-d", "@-", stdin=pretty)
    assert lines_as_json(again) == [
        {"batchId": "1", "duplicateCount": 1},
        {"batchId": "2", "duplicateCount": 3},
    ]

    broken = json.dumps(batches[0]) + '\n{"batchId": "9", "noSuchField": 1}\n'
    refused = await lgrpcurl(*plain(store), "call", method, "-d", "@-", stdin=broken)
    assert refused.rc == 2, refused
    assert "request 2" in refused.stderr and "noSuchField" in refused.stderr


async def test_lgrpcurl_errors_exit_non_zero_with_the_decoded_error_info(store: RunningServer) -> None:
    get = "lightning.v1.StoreService/GetRollout"
    missing, bad_json, bad_method = await asyncio.gather(
        lgrpcurl(*plain(store), "call", get, "-d", '{"rolloutId": "ro-missing"}'),
        lgrpcurl(*plain(store), "call", get, "-d", '{"rolloutId": '),
        lgrpcurl(*plain(store), "call", "lightning.v1.StoreService/NoSuchMethod"),
    )
    assert missing.rc == 64 + grpc.StatusCode.NOT_FOUND.value[0], missing
    assert missing.stdout == ""
    assert first_json(missing.stderr) == readme_json('"@type": "type.googleapis.com/google.rpc.ErrorInfo"')
    assert bad_json.rc == 2 and "not valid JSON" in bad_json.stderr
    assert bad_method.rc == 2 and "NoSuchMethod" in bad_method.stderr


async def test_lgrpcurl_sends_the_token_and_health_needs_none(guarded_store: RunningServer) -> None:
    stats = "lightning.v1.StoreService/GetStatistics"
    refused, with_token, with_header, health = await asyncio.gather(
        lgrpcurl(*plain(guarded_store), "call", stats),
        lgrpcurl("--token", TOKEN, *plain(guarded_store), "call", stats),
        lgrpcurl("-H", f"Authorization: Bearer {TOKEN}", *plain(guarded_store), "call", stats),
        lgrpcurl(*plain(guarded_store), "call", "grpc.health.v1.Health/Check"),
    )
    assert refused.rc == 64 + grpc.StatusCode.UNAUTHENTICATED.value[0], refused
    error = first_json(refused.stderr)
    assert error["code"] == "UNAUTHENTICATED"
    assert error["details"][0]["reason"] == "BAD_TOKEN"
    assert with_token.rc == 0 and lines_as_json(with_token)[0]["backend"] == "memory", with_token
    assert with_header.rc == 0, with_header
    assert lines_as_json(health) == [{"status": "SERVING"}]


# ------------------------------------------------------------------------------------------ any server

ECHO_FILE = "lgrpcurl_test/echo.proto"
ECHO_SERVICE = "lgrpcurl_test.Echo"


def echo_descriptors() -> descriptor_pb2.FileDescriptorProto:
    """A service unlike ours, with a client stream and a bidi stream, registered for reflection."""
    proto = descriptor_pb2.FileDescriptorProto(name=ECHO_FILE, package="lgrpcurl_test", syntax="proto3")
    for name in ("Word", "Sentence"):
        message = proto.message_type.add(name=name)
        message.field.add(name="text", number=1, type=9, label=1, json_name="text")  # string
        message.field.add(name="count", number=2, type=5, label=1, json_name="count")  # int32
    service = proto.service.add(name="Echo")
    service.method.add(
        name="Join",
        input_type=".lgrpcurl_test.Word",
        output_type=".lgrpcurl_test.Sentence",
        client_streaming=True,
    )
    service.method.add(
        name="Shout",
        input_type=".lgrpcurl_test.Word",
        output_type=".lgrpcurl_test.Word",
        client_streaming=True,
        server_streaming=True,
    )
    return proto


def echo_classes() -> tuple[Any, Any]:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(ECHO_FILE)
    except KeyError:
        pool.AddSerializedFile(echo_descriptors().SerializeToString())
    word = message_factory.GetMessageClass(pool.FindMessageTypeByName("lgrpcurl_test.Word"))
    sentence = message_factory.GetMessageClass(pool.FindMessageTypeByName("lgrpcurl_test.Sentence"))
    return word, sentence


def echo_handler() -> grpc.GenericRpcHandler:
    word, sentence = echo_classes()

    async def join(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        texts = [w.text async for w in requests]
        if not texts:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field="text", description="send some words"
            )
            detail = status_pb2.Status().details.add()
            detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
            status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="no words", details=[detail])
            await context.abort_with_status(rpc_status.to_status(status))
        return sentence(text=" ".join(texts), count=len(texts))

    async def shout(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for w in requests:
            yield word(text=w.text.upper(), count=len(w.text))

    codec = {"request_deserializer": word.FromString, "response_serializer": lambda m: m.SerializeToString()}
    return grpc.method_handlers_generic_handler(
        ECHO_SERVICE,
        {
            "Join": grpc.stream_unary_rpc_method_handler(join, **codec),
            "Shout": grpc.stream_stream_rpc_method_handler(shout, **codec),
        },
    )


@pytest_asyncio.fixture
async def echo_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((echo_handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    reflection.enable_server_reflection((ECHO_SERVICE, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.5)


async def test_lgrpcurl_works_with_any_reflecting_server_and_client_streams(echo_server: str) -> None:
    words = '{"text": "hello"}\n{"text": "gRPC"}\n{"text": "world"}\n'
    listed, described, joined, shouted, empty, broken = await asyncio.gather(
        lgrpcurl("--plaintext", echo_server, "list"),
        lgrpcurl("--plaintext", echo_server, "describe", ECHO_SERVICE),
        lgrpcurl("--plaintext", echo_server, "call", f"{ECHO_SERVICE}/Join", "-d", words),
        lgrpcurl("--plaintext", echo_server, "call", f"{ECHO_SERVICE}/Shout", "-d", "@-", stdin=words),
        lgrpcurl("--plaintext", echo_server, "call", f"{ECHO_SERVICE}/Join", "-d", ""),
        lgrpcurl(
            "--plaintext", echo_server, "call", f"{ECHO_SERVICE}/Join", "-d", "@-", stdin=words + "[1]\n"
        ),
    )
    assert listed.stdout.split() == ["grpc.reflection.v1alpha.ServerReflection", ECHO_SERVICE], listed
    assert "rpc Join(stream lgrpcurl_test.Word) returns (lgrpcurl_test.Sentence);" in described.stdout
    assert lines_as_json(joined) == [{"text": "hello gRPC world", "count": 3}], joined
    assert [w["text"] for w in lines_as_json(shouted)] == ["HELLO", "GRPC", "WORLD"], shouted
    assert empty.rc == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0], empty
    assert first_json(empty.stderr)["details"] == [
        {
            "@type": "type.googleapis.com/google.rpc.BadRequest",
            "fieldViolations": [{"field": "text", "description": "send some words"}],
        }
    ]
    assert broken.rc == 2 and "request 4 must be a JSON object" in broken.stderr, (
        broken
    )  # the call is cancelled


async def test_buf_trainer_recipes_submit_groups_and_take_a_padded_batch(
    sh: Shell, store: RunningServer
) -> None:
    import base64

    import numpy as np

    from lightning_grpc.client import StoreClient
    from tests.helpers import llm_call, reward_span

    block = readme_block("$TRAINER/GetBatch")
    submit, get = (line for line in block.splitlines() if line.startswith("bcurl "))
    submitted = await sh.run("TRAINER=$SERVER/lightning.v1.TrainerService\n" + submit)
    assert submitted.rc == 0, submitted
    groups = submitted.documents[0]["groups"]
    assert [g["rolloutIds"] for g in groups] == [[f"{g}-r{i}" for i in range(3)] for g in ("g-1", "g-2")]
    async with StoreClient(address_of(store)) as client:
        for claimed in await client.dequeue_rollouts(6, worker_id="w", wait=5):
            attempt = claimed.latest_attempt
            assert attempt is not None
            spans = [llm_call([1, 2, 3], [4, 5], logprobs=[-0.1, -0.2]), reward_span(1.0)]
            await client.add_spans(spans, rollout_id=claimed.rollout_id, attempt_id=attempt.attempt_id)
            await client.complete_attempt(claimed.rollout_id, attempt.attempt_id, "succeeded")
    taken = await sh.run("TRAINER=$SERVER/lightning.v1.TrainerService\n" + get)
    assert taken.rc == 0, taken
    [message] = taken.documents
    header = message["header"]
    assert header["batchId"] == "step-1" and header["groupIds"] == ["g-1", "g-2"] and header["rowCount"] == 6
    tensor = message["tensors"]["input_ids"]
    assert tensor["dtype"] == "D_TYPE_UINT16"
    shape = [int(n) for n in tensor["shape"]]
    ids = np.frombuffer(base64.b64decode(tensor["data"] + "=="), "<u2").reshape(shape)
    assert ids.tolist() == [[1, 2, 3, 4, 5]] * 6
    documented = readme_json('"batchId": "step-1"')
    assert set(documented["header"]) <= set(
        pb.DESCRIPTOR.pool.FindMessageTypeByName("lightning.v1.BatchHeader").fields_by_camelcase_name
    )
