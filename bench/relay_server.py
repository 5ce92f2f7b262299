"""The LLM proxy's floor: a bare aiohttp relay of a call to the engine, with nothing checked or recorded.

It takes the proxy's routes (``/v1/chat/completions``, also under ``/rollout/{id}/attempt/{id}``) and
posts the agent's bytes unchanged to the engine over one pooled aiohttp session, then answers the
engine's bytes: no admission, no rewriting (no token ids or log-probs asked for), no JSON parsed, no span.
It is what one more HTTP hop in Python costs on this host, so that the proxy's figures can be read
against it the way the Store's are read against ``ceiling_server.py``: the gap between the relay and
the proxy is what the proxy's own work costs.

    python bench/relay_server.py --backend http://127.0.0.1:8000/v1 --port 0    # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web


async def main(backend: str, port: int) -> None:
    target = backend.rstrip("/") + "/chat/completions"
    session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=600))

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with session.post(target, data=body, headers=headers) as answer:
            data = await answer.read()
            kind = answer.headers.get("Content-Type", "application/json")
            return web.Response(body=data, status=answer.status, headers={"Content-Type": kind})

    app = web.Application()
    for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}"):
        app.router.add_post(f"{prefix}/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"READY {bound}", flush=True)
    await asyncio.Event().wait()  # until SIGTERM ends the process: it holds nothing to write out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True, help="the engine's base URL (…/v1)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if "127.0.0.1" not in args.backend:
        parser.error(f"only 127.0.0.1: {args.backend}")
    asyncio.run(main(args.backend, args.port))
