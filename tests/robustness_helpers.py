"""What the robustness tests share (tests/store/test_store_robustness.py, tests/server/test_server_robustness.py):
the contract's constants, the check of a refusal's shape, and the in-process
server of each backend with a small span limit (fixtures ``server_config`` and ``stub``: a test module
imports them by name to use them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from lightning_grpc.server.app import RunningServer, ServerConfig
from lightning_grpc.v1 import rollout_pb2
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc

ERROR_DOMAIN = "lightning-grpc.dev"
CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
ALLOWED_CODES = frozenset(
    {
        "NOT_FOUND",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "ALREADY_EXISTS",
        "ABORTED",
        "RESOURCE_EXHAUSTED",
        "OUT_OF_RANGE",
    }
)
OK = "OK"
NOT_FOUND = "NOT_FOUND"
INVALID = "INVALID_ARGUMENT"
PRECONDITION = "FAILED_PRECONDITION"
EXISTS = "ALREADY_EXISTS"
ABORTED = "ABORTED"
EXHAUSTED = "RESOURCE_EXHAUSTED"
OUT_OF_RANGE = "OUT_OF_RANGE"

MAX_SPAN_BYTES = 4096
CALL_TIMEOUT = 15.0
MESSAGE_LIMIT = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
]
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
MAX_DURATION_SECONDS = 315_576_000_000  # google.protobuf.Duration's documented range: about 10,000 years

# The documented id syntax: "1-128 characters of letters, digits, '.', '_', ':' or '-', starting
# with a letter or digit".
ID_SYNTAX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")
HEX16 = re.compile(r"[0-9a-f]{16}")
HEX32 = re.compile(r"[0-9a-f]{32}")

# Enum numbers of the contract.
ROLLOUT_QUEUING, ROLLOUT_PREPARING, ROLLOUT_RUNNING, ROLLOUT_REQUEUING = 1, 2, 3, 4
ROLLOUT_SUCCEEDED, ROLLOUT_FAILED, ROLLOUT_CANCELLED = 5, 6, 7
TERMINAL_ROLLOUT = frozenset({ROLLOUT_SUCCEEDED, ROLLOUT_FAILED, ROLLOUT_CANCELLED})
QUEUED_ROLLOUT = frozenset({ROLLOUT_QUEUING, ROLLOUT_REQUEUING})
ATTEMPT_PREPARING, ATTEMPT_RUNNING, ATTEMPT_SUCCEEDED, ATTEMPT_FAILED = 1, 2, 3, 4
ATTEMPT_TIMEOUT, ATTEMPT_UNRESPONSIVE, ATTEMPT_CANCELLED = 5, 6, 7
ACTIVE_ATTEMPT = frozenset({ATTEMPT_PREPARING, ATTEMPT_RUNNING})
RETRYABLE_ATTEMPT = frozenset({ATTEMPT_FAILED, ATTEMPT_TIMEOUT, ATTEMPT_UNRESPONSIVE})
ROLLOUT_STATUS_NAMES = {v.number: v.name for v in rollout_pb2.RolloutStatus.DESCRIPTOR.values}
BAD_ENUM_NUMBERS = [-1, INT32_MIN, 8, 99, INT32_MAX]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def error_shape(exc: grpc.RpcError, context: str) -> tuple[str, error_details_pb2.ErrorInfo]:
    """Check a refusal's shape (code, Status, one ErrorInfo, field name); return code and info."""
    code = exc.code().name  # type: ignore[attr-defined]
    details = exc.details() or ""  # type: ignore[attr-defined]
    where = f"{context} -> {code}: {details!r}"
    assert code in ALLOWED_CODES, f"not a client-error code: {where}"
    assert "Traceback" not in details, f"traceback in the message: {where}"
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except ValueError as bad:  # the Status disagrees with the gRPC code
        raise AssertionError(f"{bad}: {where}") from None
    assert status is not None, f"no google.rpc.Status in grpc-status-details-bin: {where}"
    assert status.code == exc.code().value[0], f"Status.code differs from the gRPC code: {where}"  # type: ignore[attr-defined]
    assert status.message == details, f"Status.message differs from the gRPC details: {where}"
    assert len(status.details) == 1, f"{len(status.details)} details instead of one ErrorInfo: {where}"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info), f"the detail is not an ErrorInfo: {where}"
    assert info.domain == ERROR_DOMAIN, f"ErrorInfo domain {info.domain!r}: {where}"
    assert info.reason, f"empty ErrorInfo reason: {where}"
    assert "Traceback" not in str(dict(info.metadata)), f"traceback in the ErrorInfo: {where}"
    if code == INVALID:
        named = info.metadata.get("field", "")
        assert named and named in details, f"INVALID_ARGUMENT does not name its field: {where}"
    return code, info


# ====================================================================== the in-process server of the boundary cases


@pytest.fixture
def server_config(backend: str, tmp_path: Path) -> ServerConfig:
    """The shared in-process server, with the same small span limit as the fuzzed one."""
    db = tmp_path / "store.db" if backend == "sqlite" else None
    return ServerConfig(port=0, db=db, grace=1.0, max_span_bytes=MAX_SPAN_BYTES)


@pytest.fixture
async def stub(server: RunningServer) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.StoreServiceStub(channel)


async def outcome(call: Any) -> tuple[str, Any]:
    """("OK", response) or (code, ErrorInfo) of an awaited call. A refusal without the required
    shape (Status, one ErrorInfo of the domain...) is labelled with what is wrong with it."""
    try:
        return OK, await call
    except grpc.aio.AioRpcError as exc:
        try:
            return error_shape(exc, "boundary case")
        except AssertionError as bad:
            return f"{exc.code().name} [{str(bad).splitlines()[0][:160]}]", None


async def started_attempt(stub: Any, rollout_id: str) -> str:
    response = await stub.StartRollout(pb.StartRolloutRequest(rollout=pb.RolloutSpec(rollout_id=rollout_id)))
    return str(response.rollout.latest_attempt.attempt_id)
