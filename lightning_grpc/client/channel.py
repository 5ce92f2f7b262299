"""The one way every client reaches a lightning-grpc server: a channel and the metadata of each call.

Store, Trainer and Proxy clients and the span shipper all open their channels here, so each honours
the whole :class:`~.config.ClientConfig`: TLS, the bearer token, retries, keepalive, gzip, sizes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import grpc

from lightning_grpc.errors import InvalidArgumentError

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
        # After a lost connection, look again within 0.1 s (gRPC's default: 1 s), backing off to 5 s: a
        # standby serves a few tens of ms after its writer dies, and a restarted server about as soon.
        # (grpc.min_reconnect_backoff_ms stays at its 20 s: it is how long one connection attempt may take.)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]
    compression = grpc.Compression.Gzip if config.gzip else None
    target = channel_target(config.target)
    if config.tls is None:
        return grpc.aio.insecure_channel(target, options=options, compression=compression)
    tls = config.tls
    if tls.server_name_override:
        options.append(("grpc.ssl_target_name_override", tls.server_name_override))
    creds = grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)
    return grpc.aio.secure_channel(target, creds, options=options, compression=compression)


#: Target schemes gRPC resolves itself: a target starting with one is passed on as written.
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def channel_target(target: str) -> str:
    """The gRPC target for ``target``: one ``host:port`` (or a gRPC target URI) as written, or several
    comma-separated (a store's writer and its standbys) as one ``ipv4:``/``ipv6:`` address list.

    The channel connects to the first address that answers and, when that connection is lost, tries them
    again in order, so a client follows a standby that took over. Host names in a list are resolved here,
    once; a single DNS name with several addresses is left to gRPC, which resolves it again on failure.
    """
    if "," not in target or target.startswith(_SCHEMES):
        return target
    v4: list[str] = []
    v6: list[str] = []
    for item in (part.strip() for part in target.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgumentError("target", f"{item!r} of {target!r} is not host:port")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise InvalidArgumentError(
                "target", f"cannot resolve {host!r} of {target!r} ({exc.strerror})"
            ) from None
        for family, _, _, _, sockaddr in infos:
            ip = str(ipaddress.ip_address(sockaddr[0]))
            if family == socket.AF_INET and f"{ip}:{port}" not in v4:
                v4.append(f"{ip}:{port}")
            elif family == socket.AF_INET6 and f"[{ip}]:{port}" not in v6:
                v6.append(f"[{ip}]:{port}")
    # gRPC takes one family per list: IPv4 when any address has one (loopback and most clusters)
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


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
