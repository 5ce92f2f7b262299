"""Small frozen configuration objects of the client."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lightning_grpc.errors import TRANSPARENT_RETRY_CODES

#: Methods safe to retry on UNAVAILABLE: reads, and writes the client makes idempotent
#: (generated rollout/resources ids, dequeue request ids, span ids, fenced attempt reports).
IDEMPOTENT_METHODS = (
    "StartRollout",
    "EnqueueRollouts",
    "DequeueRollouts",
    "UpdateRollout",
    "CancelRollout",
    "GetRollout",
    "ListRollouts",
    "GetLatestAttempt",
    "ListAttempts",
    "HeartbeatAttempt",
    "CompleteAttempt",
    "AddSpans",
    "ListSpans",
    "AddResources",
    "GetResources",
    "GetLatestResources",
    "ListResources",
    "HeartbeatWorker",
    "GetWorker",
    "ListWorkers",
    "WaitForRollouts",
    "GetStatistics",
)

#: TrainerService methods safe to retry: group ids and batch request ids are chosen by the client,
#: and a step reported again with the same content is answered with the stored event.
TRAINER_IDEMPOTENT_METHODS = (
    "SubmitGroups",
    "GetBatch",
    "ReportStep",
    "GetTrainerStatus",
    "GetTriplets",
)


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
                            *(
                                {"service": "lightning.v1.StoreService", "method": m}
                                for m in IDEMPOTENT_METHODS
                            ),
                            *(
                                {"service": "lightning.v1.TrainerService", "method": m}
                                for m in TRAINER_IDEMPOTENT_METHODS
                            ),
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
