"""The one way every client reaches a lightning-grpc server: a channel and the metadata of each call.

Store, Trainer and Proxy clients and the span shipper all open their channels here, so each honours
the whole :class:`~.config.ClientConfig`: TLS, the bearer token, retries, keepalive, gzip, sizes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from .config import ClientConfig

#: gRPC metadata: (key, value) pairs sent with a call.
Metadata = tuple[tuple[str, str], ...]


def make_channel(config: ClientConfig) -> grpc.aio.Channel:
    """An asyncio channel to ``config.target`` (create it inside the event loop that uses it)."""
    options: list[tuple[str, Any]] = [
        ("grpc.service_config", config.service_config()),
        ("grpc.enable_retries", 1 if config.retry else 0),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    compression = grpc.Compression.Gzip if config.gzip else None
    if config.tls is None:
        return grpc.aio.insecure_channel(config.target, options=options, compression=compression)
    tls = config.tls
    if tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    creds = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.aio.secure_channel(config.target, creds, options=options, compression=compression)


def call_metadata(config: ClientConfig) -> Metadata:
    """The metadata of every call: the bearer token, when there is one."""
    return (("authorization", f"Bearer {config.token}"),) if config.token else ()


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a stopped event loop that channels ran on, after the tasks gRPC left on it (a call's status
    reader, say) have been cancelled and have ended, so none is destroyed while still pending."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
