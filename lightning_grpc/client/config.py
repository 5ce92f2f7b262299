"""Small frozen configuration objects of the client."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from lightning_grpc.errors import TRANSPARENT_RETRY_CODES
from lightning_grpc.v1 import proxy_service_pb2, store_service_pb2, trainer_service_pb2

#: The contract files whose services the clients call.
SERVICE_FILES: tuple[FileDescriptor, ...] = (
    store_service_pb2.DESCRIPTOR,
    trainer_service_pb2.DESCRIPTOR,
    proxy_service_pb2.DESCRIPTOR,
)

#: The idempotency levels that make a method safe to send again: reads, and writes whose repeat is
#: harmless (caller-chosen ids, request ids, fenced reports).
RETRY_SAFE_LEVELS = frozenset(
    {descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS, descriptor_pb2.MethodOptions.IDEMPOTENT}
)


def retryable_methods(files: tuple[FileDescriptor, ...] = SERVICE_FILES) -> tuple[tuple[str, str], ...]:
    """(service full name, method name) of every method the contract marks safe to retry.

    Read from the ``idempotency_level`` option of each rpc in proto/lightning/v1, the same marks the
    TypeScript client's generated retry list comes from; unmarked methods are never retried.
    """
    return tuple(
        (service.full_name, method.name)
        for file in files
        for service in file.services_by_name.values()
        for method in service.methods
        if method.GetOptions().idempotency_level in RETRY_SAFE_LEVELS
    )


#: Methods retried on UNAVAILABLE by the channel's service config, as the contract marks them.
RETRYABLE_METHODS: tuple[tuple[str, str], ...] = retryable_methods()


@dataclass(frozen=True)
class RetryConfig:
    """gRPC service-config retry policy, applied to idempotent methods on UNAVAILABLE only."""

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    backoff_multiplier: float = 2.0


@dataclass(frozen=True)
class TlsConfig:
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    #: For tests with certificates issued to another name.
    server_name_override: str | None = None


@dataclass(frozen=True)
class ClientConfig:
    """How to reach a lightning-grpc server."""

    target: str = "127.0.0.1:4747"
    token: str | None = field(default=None, repr=False)
    tls: TlsConfig | None = None
    retry: RetryConfig | None = field(default_factory=RetryConfig)
    #: Default deadline of a call, in seconds (long-polls add their wait on top).
    timeout: float = 30.0
    gzip: bool = False
    keepalive_seconds: float = 30.0

    def service_config(self) -> str:
        if self.retry is None:
            return json.dumps({"methodConfig": []})
        r = self.retry
        return json.dumps(
            {
                "methodConfig": [
                    {
                        "name": [
                            {"service": service, "method": method} for service, method in RETRYABLE_METHODS
                        ],
                        "retryPolicy": {
                            "maxAttempts": r.max_attempts,
                            "initialBackoff": f"{r.initial_backoff}s",
                            "maxBackoff": f"{r.max_backoff}s",
                            "backoffMultiplier": r.backoff_multiplier,
                            "retryableStatusCodes": list(TRANSPARENT_RETRY_CODES),
                        },
                    }
                ]
            }
        )
