"""Logs: one line per event, and no secrets."""

from __future__ import annotations

import ast
import io
import logging
import subprocess
import sys
from pathlib import Path

import grpc

import lightning_grpc
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


def test_the_default_log_level_keeps_an_agents_http_requests_out() -> None:
    """httpx logs one INFO line per request; a runner's log at INFO shows its own events only."""
    script = """
import http.server, logging, threading
import httpx
from lightning_grpc import logs

server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=server.serve_forever, daemon=True).start()
logs.configure_logging("INFO")
httpx.get(f"http://127.0.0.1:{server.server_port}/")
logging.getLogger("lightning_grpc.runner").info("event=agent_called")
server.shutdown()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert "event=agent_called" in done.stdout
    assert "HTTP Request" not in done.stdout + done.stderr


def test_every_module_names_its_logger_after_itself() -> None:
    """``get_logger(__name__)``, never a hand-written name: a logger sits under its package's, where a
    component's level is set and its records are captured."""
    root = Path(lightning_grpc.__file__).parent
    spelled = []
    for path in sorted(root.rglob("*.py")):
        if "node_modules" in path.parts or path.parent.name == "v1":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                in ("get_logger", "getLogger")
                and node.args
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))
            ):
                spelled.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert spelled == []


def test_a_module_run_with_python_m_logs_under_its_own_name(tmp_path: Path) -> None:
    (tmp_path / "probe_module.py").write_text(
        "from lightning_grpc import logs\nprint(logs.get_logger(__name__).name)\n", encoding="utf-8"
    )
    done = subprocess.run(
        [sys.executable, "-m", "probe_module"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "probe_module"
