"""Logs: one line per event, and no secrets."""

from __future__ import annotations

import io
import logging

import grpc

from lightning_grpc.logs import OneLineFormatter
from lightning_grpc.v1 import store_service_pb2 as pb
from lightning_grpc.v1 import store_service_pb2_grpc as pb_grpc


def test_a_logged_traceback_stays_on_one_line() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("lightning_grpc.test_one_line")
    logger.addHandler(handler)
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        logger.error("event=failure", exc_info=True)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "event=failure" in lines[0] and "Traceback" in lines[0] and "boom | second line" in lines[0]


def test_the_server_log_never_shows_the_token(server_process) -> None:  # type: ignore[no-untyped-def]
    proc = server_process("--memory", "--port", "0", env={"LIGHTNING_GRPC_TOKEN": "tok-very-secret"}).start()
    with grpc.insecure_channel(proc.address) as channel:
        stub = pb_grpc.StoreServiceStub(channel)
        try:
            stub.GetStatistics(
                pb.GetStatisticsRequest(), metadata=[("authorization", "Bearer tok-very-secret")]
            )
            stub.GetStatistics(pb.GetStatisticsRequest(), metadata=[("authorization", "Bearer wrong")])
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert proc.terminate() == 0
    text = "".join(proc.lines)
    assert "event=server_started" in text and "auth=True" in text and "event=server_stopped" in text
    assert "tok-very-secret" not in text
