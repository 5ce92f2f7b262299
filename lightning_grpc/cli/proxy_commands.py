"""``lightning-grpc proxy``: the LLM proxy on its own; and the ``--proxy-*`` options of ``serve``.

lightning-grpc proxy --store 127.0.0.1:4747 --backend http://127.0.0.1:8000/v1 --model-name policy
lightning-grpc serve --memory --proxy-backend http://127.0.0.1:8000/v1 --proxy-port 4748
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from lightning_grpc import environment, logs
from lightning_grpc.cli.inspect_commands import add_store_option

log = logs.get_logger(__name__)

#: How long serve and proxy wait for a backend that is still starting (connection refused) to list its model.
BACKEND_START_WAIT = 60.0

DEFAULT_HTTP_PORT = 4748
DEFAULT_GRPC_PORT = 4749


def _backend_options(p: argparse.ArgumentParser, prefix: str) -> None:
    """The options that describe the backends (``prefix`` is "" or "proxy-")."""
    p.set_defaults(proxy_option_prefix=prefix)  # so messages name the option as this command spells it
    p.add_argument(
        f"--{prefix}backend",
        dest="proxy_backends",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="base URL of a model server (repeatable), e.g. http://127.0.0.1:8000/v1",
    )
    p.add_argument(
        f"--{prefix}model-name",
        dest="proxy_model_name",
        metavar="NAME",
        help="the model name agents ask for (default: the first model the first backend lists)",
    )
    p.add_argument(
        f"--{prefix}backend-wait",
        dest="proxy_backend_wait",
        metavar="SECONDS",
        type=float,
        default=BACKEND_START_WAIT,
        help="without a model name, how long to wait for a backend still starting to list its model",
    )
    p.add_argument(
        f"--{prefix}backend-model",
        dest="proxy_backend_model",
        metavar="NAME",
        default="",
        help="the model name the backends expect (default: the model name)",
    )
    p.add_argument(
        f"--{prefix}dialect",
        dest="proxy_dialect",
        choices=("vllm", "openai"),
        default="vllm",
        help="vllm: vLLM or the embedded engine (token ids recorded); openai: any other server, via LiteLLM",
    )
    p.add_argument(
        f"--{prefix}api-key",
        dest="proxy_api_key",
        metavar="KEY",
        default=os.environ.get(environment.BACKEND_API_KEY, ""),
        help=f"bearer token for the backends (default: ${environment.BACKEND_API_KEY})",
    )
    p.add_argument(
        f"--{prefix}policy-version",
        dest="proxy_policy_version",
        metavar="VERSION",
        type=int,
        default=0,
        help="policy version recorded when a backend does not report one",
    )
    p.add_argument(
        f"--{prefix}public-url",
        dest="proxy_public_url",
        metavar="URL",
        default="",
        help="the URL agents reach the proxy at",
    )
    p.add_argument(
        f"--{prefix}unattributed",
        dest="proxy_unattributed",
        choices=("forward", "refuse"),
        default="",
        help="calls that name no attempt: forward them unrecorded, or refuse them "
        "(default: refuse when a token is set, forward otherwise)",
    )
    p.add_argument(
        f"--{prefix}retries",
        dest="proxy_retries",
        metavar="N",
        type=int,
        default=2,
        help="retries towards a backend",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("proxy", help="run the LLM proxy (OpenAI-compatible HTTP, recorded into a store)")
    add_store_option(p, "the store the calls are recorded into")
    p.add_argument(
        "--token",
        default=os.environ.get(environment.TOKEN),
        help=f"bearer token of the store, also required by the proxy's gRPC side (default: ${environment.TOKEN})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC sides")
    p.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="ProxyService port (0: any)")
    _backend_options(p, "")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run_proxy)


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """``serve --proxy-backend URL ...``: host the proxy in the store's process."""
    group = p.add_argument_group("LLM proxy (hosted when --proxy-backend or --proxy is given)")
    group.add_argument("--proxy", action="store_true", help="host the proxy even without backends")
    group.add_argument(
        "--proxy-port",
        type=int,
        metavar="PORT",
        default=DEFAULT_HTTP_PORT,
        help="the proxy's HTTP port (0: any free port)",
    )
    _backend_options(group, "proxy-")  # type: ignore[arg-type]


def wants_proxy(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "proxy", False) or getattr(args, "proxy_backends", None))


def discover_model(api_base: str, timeout: float = 10.0, wait: float = BACKEND_START_WAIT) -> str:
    """The first model a backend lists at /v1/models, waiting up to ``wait`` s for one still starting."""
    from lightning_grpc.proxy.backends import normalize_api_base

    url = normalize_api_base(api_base) + "/models"
    deadline = time.monotonic() + wait
    while True:
        try:
            with urllib.request.urlopen(
                url, timeout=timeout
            ) as resp:  # a configured backend, never the internet
                data = json.loads(resp.read())
            break
        except urllib.error.URLError as exc:
            refused = isinstance(exc.reason, ConnectionRefusedError)
            if not refused or time.monotonic() >= deadline:
                raise
            log.info("event=proxy_backend_waiting url=%s", url)
            time.sleep(1.0)
    models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict) and m.get("id")]
    if not models:
        raise ValueError(f"{url} lists no model")
    return str(models[0])


def proxy_config(args: argparse.Namespace, host: str, port: int, store: Any = "") -> Any:
    from lightning_grpc.proxy import Backend, BackendDialect, ProxyConfig

    urls: list[str] = args.proxy_backends or []
    model_name = args.proxy_model_name
    backend_model = args.proxy_backend_model
    if not model_name and urls:
        try:
            model_name = discover_model(urls[0], wait=getattr(args, "proxy_backend_wait", BACKEND_START_WAIT))
        except (OSError, ValueError) as exc:
            option = f"--{getattr(args, 'proxy_option_prefix', '')}model-name"
            raise SystemExit(
                f"error: cannot ask {urls[0]} for its model ({exc}); pass {option} NAME "
                "(the model name agents ask for)"
            ) from None
        backend_model = backend_model or model_name
    try:
        backends = [
            Backend(
                model_name=model_name,
                api_base=url,
                dialect=BackendDialect.parse(args.proxy_dialect),
                backend_model=backend_model,
                api_key=args.proxy_api_key,
                policy_version=args.proxy_policy_version,
            )
            for url in urls
        ]
        return ProxyConfig(
            host=host,
            port=port,
            store=store or "127.0.0.1:4747",
            backends=backends,
            public_url=args.proxy_public_url,
            retries=args.proxy_retries,
            unattributed=args.proxy_unattributed,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def run_proxy(args: argparse.Namespace) -> int:
    from lightning_grpc.client import ClientConfig
    from lightning_grpc.errors import InvalidArgumentError
    from lightning_grpc.server.proxy_app import serve_proxy

    logs.configure_logging(args.log_level)
    store = ClientConfig(target=args.store, token=args.token or None)
    try:
        config = proxy_config(args, args.host, args.port, store)
        asyncio.run(
            serve_proxy(
                config,
                grpc_host=args.host,
                grpc_port=args.grpc_port,
                token=args.token or None,
                grace=args.grace,
            )
        )
    except InvalidArgumentError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    except OSError as exc:
        log.error("event=proxy_failed error=%s", exc)
        return 1
    return 0


def run_serve_with_proxy(args: argparse.Namespace, server_config: Any) -> int:
    """The end of ``run_serve`` when a proxy is hosted: store and proxy in one process."""
    from lightning_grpc.errors import InvalidArgumentError
    from lightning_grpc.server.proxy_app import serve_with_store

    try:
        config = proxy_config(args, server_config.host, args.proxy_port)
        asyncio.run(serve_with_store(server_config, config))
    except InvalidArgumentError as exc:
        raise SystemExit(f"error: {exc.message}") from None
    except OSError as exc:
        log.error("event=server_failed error=%s", exc)
        return 1
    return 0
