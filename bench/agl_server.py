"""Run Agent Lightning's own store server (in-memory store) for the side-by-side bench.

    bench/.venv-agl/bin/python bench/agl_server.py --port 4747

Binds 127.0.0.1 only, prints ``READY <port>`` once its health route answers, and exits with status 0 on
SIGTERM or SIGINT after a graceful shutdown. The store is built the way the reference's ``agl store
--backend memory`` builds it (a thread-safe in-memory store served in asyncio mode, no metrics tracker).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agl_setup import apply_offline_env

apply_offline_env()

from agentlightning.store.client_server import LightningStoreServer  # noqa: E402
from agentlightning.store.memory import InMemoryLightningStore  # noqa: E402
from agentlightning.utils.server_launcher import PythonServerLauncherArgs  # noqa: E402

HOST = "127.0.0.1"
HEALTH_PATH = "/v1/agl/health"


def build_server(port: int, log_level: int) -> LightningStoreServer:
    store = InMemoryLightningStore(thread_safe=True)
    launcher_args = PythonServerLauncherArgs(
        host=HOST,
        port=port,
        access_host=HOST,
        launch_mode="asyncio",
        healthcheck_url=HEALTH_PATH,
        log_level=log_level,
        access_log=False,
    )
    return LightningStoreServer(store, launcher_args=launcher_args)


def health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{HEALTH_PATH}", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


async def wait_healthy(port: int, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        if await asyncio.to_thread(health_ok, port):
            return True
        await asyncio.sleep(0.1)
    return False


async def serve(port: int, log_level: int) -> int:
    server = build_server(port, log_level)
    await server.start()
    # Installed after start, so these handlers (not uvicorn's) see the signal; uvicorn then stops normally.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if not await wait_healthy(port, 30.0):
        print(f"agl_server: health route on port {port} did not answer", file=sys.stderr)
        await server.stop()
        return 1
    print(f"READY {port}", flush=True)
    await stop.wait()
    await server.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args()
    level = logging.getLevelName(args.log_level)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(args.port, level))


if __name__ == "__main__":
    raise SystemExit(main())
