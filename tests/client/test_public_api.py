"""The public client API: its names, its documentation, typed keywords, and the blocking clients' match."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import pytest

import lightning_grpc.client as client_package
from lightning_grpc.client import (
    ProxyClient,
    RunnerSession,
    StoreClient,
    SyncStoreClient,
    SyncTrainerClient,
    TrainerClient,
)
from lightning_grpc.client.config import RETRYABLE_METHODS
from lightning_grpc.client.local import LocalStoreClient
from lightning_grpc.server.app import RunningServer
from lightning_grpc.types import RolloutSpec

PUBLIC_NAMES = {
    "AddSpansResult",
    "AttemptHeartbeat",
    "ClientConfig",
    "ProxyClient",
    "RetryConfig",
    "RolloutTripletReport",
    "RunnerSession",
    "StoreClient",
    "SubmittedGroup",
    "SyncStoreClient",
    "SyncTrainerClient",
    "TlsConfig",
    "TrainerClient",
    "TrainingBatch",
    "WatchEvent",
}

CLIENTS = [
    StoreClient,
    TrainerClient,
    ProxyClient,
    SyncStoreClient,
    SyncTrainerClient,
    LocalStoreClient,
    RunnerSession,
]

#: The RPC behind each public method of the async clients (the helpers built on one included).
RPCS: dict[type, dict[str, str]] = {
    StoreClient: {
        "start_rollout": "StartRollout",
        "enqueue_rollout": "EnqueueRollouts",
        "enqueue_rollouts": "EnqueueRollouts",
        "dequeue_rollouts": "DequeueRollouts",
        "dequeue_rollout": "DequeueRollouts",
        "start_attempt": "StartAttempt",
        "update_rollout": "UpdateRollout",
        "cancel_rollout": "CancelRollout",
        "retry_rollout": "RetryRollout",
        "get_rollout": "GetRollout",
        "get_rollout_by_id": "GetRollout",
        "list_rollouts": "ListRollouts",
        "query_rollouts": "ListRollouts",
        "get_latest_attempt": "GetLatestAttempt",
        "query_attempts": "ListAttempts",
        "list_attempts": "ListAttempts",
        "heartbeat_attempt": "HeartbeatAttempt",
        "complete_attempt": "CompleteAttempt",
        "complete_and_dequeue": "CompleteAttempt",
        "add_spans": "AddSpans",
        "add_span": "AddSpans",
        "query_spans": "ListSpans",
        "list_spans": "ListSpans",
        "tail_spans": "TailSpans",
        "get_next_span_sequence_id": "GetNextSpanSequenceId",
        "add_resources": "AddResources",
        "update_resources": "UpdateResources",
        "get_resources": "GetResources",
        "get_resources_by_id": "GetResources",
        "get_latest_resources": "GetLatestResources",
        "query_resources": "ListResources",
        "list_resources": "ListResources",
        "update_worker": "HeartbeatWorker",
        "get_worker_by_id": "GetWorker",
        "query_workers": "ListWorkers",
        "list_workers": "ListWorkers",
        "wait_for_rollouts": "WaitForRollouts",
        "watch_rollouts": "WatchRollouts",
        "statistics": "GetStatistics",
        "delete_rollouts": "DeleteRollouts",
    },
    TrainerClient: {
        "submit_groups": "SubmitGroups",
        "get_batch": "GetBatch",
        "report_step": "ReportStep",
        "watch_training": "WatchTraining",
        "status": "GetTrainerStatus",
        "triplets": "GetTriplets",
    },
    RunnerSession: {  # each a message of RunnerSession standing for this RPC, sent again on a new stream
        "dequeue_rollouts": "DequeueRollouts",
        "dequeue_rollout": "DequeueRollouts",
        "heartbeat_attempt": "HeartbeatAttempt",
        "complete_attempt": "CompleteAttempt",
        "complete_and_dequeue": "CompleteAttempt",
    },
    ProxyClient: {
        "set_backends": "SetBackends",
        "list_backends": "ListBackends",
        "attempt_endpoint": "GetAttemptEndpoint",
        "pause": "Pause",
        "resume": "Resume",
        "drain": "Drain",
        "status": "GetProxyStatus",
    },
}
SERVICES = {
    StoreClient: "lightning.v1.StoreService",
    RunnerSession: "lightning.v1.StoreService",
    TrainerClient: "lightning.v1.TrainerService",
    ProxyClient: "lightning.v1.ProxyService",
}
BLOCKING = {SyncStoreClient: StoreClient, SyncTrainerClient: TrainerClient}
#: Methods of the async clients with no RPC of their own.
LOCAL_METHODS = {"close", "wait_until_reachable"}


def public_methods(cls: type) -> dict[str, Any]:
    """The public methods and properties a class defines itself or takes from a base class of this project
    (dunders left out)."""
    own = [k for k in reversed(cls.__mro__) if k.__module__.startswith("lightning_grpc.")]
    return {
        name: member
        for klass in own
        for name, member in vars(klass).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


def async_methods(cls: type) -> dict[str, Any]:
    return {
        name: fn
        for name, fn in public_methods(cls).items()
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
    }


def test_all_lists_exactly_the_public_names() -> None:
    assert set(client_package.__all__) == PUBLIC_NAMES
    assert len(client_package.__all__) == len(PUBLIC_NAMES)
    for name in client_package.__all__:
        assert getattr(client_package, name) is not None
    exported = {n for n in vars(client_package) if not n.startswith("_")}
    modules = {n for n in exported if inspect.ismodule(getattr(client_package, n))}
    assert exported - modules - {"annotations"} == PUBLIC_NAMES


@pytest.mark.parametrize("plumbing", ["make_channel", "call_metadata", "from_rpc_error"])
def test_plumbing_is_importable_from_its_module_but_not_public(plumbing: str) -> None:
    from lightning_grpc.client import channel, errors

    assert plumbing not in client_package.__all__
    assert not hasattr(client_package, plumbing)
    assert callable(getattr(channel, plumbing, None) or getattr(errors, plumbing))


def test_the_package_ships_py_typed() -> None:
    from pathlib import Path

    import lightning_grpc

    marker = Path(lightning_grpc.__file__).parent / "py.typed"
    assert marker.is_file() and marker.read_text() == ""


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_every_public_method_is_documented_and_takes_no_var_keywords(cls: type) -> None:
    assert inspect.getdoc(cls)
    members = {**public_methods(cls), "__init__": vars(cls)["__init__"]}
    for name, member in members.items():
        fn = member.fget if isinstance(member, property) else member
        if name != "__init__":
            assert inspect.getdoc(fn), f"{cls.__name__}.{name} has no docstring"
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{cls.__name__}.{name} takes **kwargs"
        assert inspect.Parameter.VAR_POSITIONAL not in kinds, f"{cls.__name__}.{name} takes *args"


@pytest.mark.parametrize("cls", list(RPCS), ids=lambda c: c.__name__)
def test_each_method_says_whether_it_is_retried_as_the_contract_marks_it(cls: type) -> None:
    methods = set(async_methods(cls)) - LOCAL_METHODS
    assert methods == set(RPCS[cls]), "a method was added or removed: name its RPC in RPCS"
    retried = {m for s, m in RETRYABLE_METHODS if s == SERVICES[cls]}
    for name, rpc in RPCS[cls].items():
        doc = (inspect.getdoc(getattr(cls, name)) or "").lower()
        if rpc in retried:
            assert "retried on unavailable" in doc, f"{cls.__name__}.{name} ({rpc}) is retried"
        else:
            assert "not retried" in doc and "retried on unavailable" not in doc, (
                f"{cls.__name__}.{name} ({rpc}) is not retried"
            )
        assert "raises:" in doc or "returns:" in doc or "yields:" in doc


def test_no_method_is_an_alias_of_another() -> None:
    for cls in CLIENTS:
        functions = [m for m in public_methods(cls).values() if inspect.isfunction(m)]
        assert len({id(f) for f in functions}) == len(functions), cls.__name__
        assert all(f.__name__ == name for name, f in public_methods(cls).items() if inspect.isfunction(f))


@pytest.mark.parametrize("blocking", list(BLOCKING), ids=lambda c: c.__name__)
def test_the_blocking_client_has_every_method_with_the_same_signature(blocking: type) -> None:
    async_cls = BLOCKING[blocking]
    expected = {name: fn for name, fn in async_methods(async_cls).items() if name != "close"}
    got = {name: fn for name, fn in public_methods(blocking).items() if inspect.isfunction(fn)}
    assert set(got) == set(expected) | {"close"}
    assert inspect.signature(blocking.__init__) == inspect.signature(async_cls.__init__)
    for name, fn in expected.items():
        mine, theirs = inspect.signature(got[name]), inspect.signature(fn)
        assert list(mine.parameters.values()) == list(theirs.parameters.values()), name
        assert not inspect.iscoroutinefunction(got[name]), name
        if inspect.isasyncgenfunction(fn):
            item = str(theirs.return_annotation).removeprefix(AsyncIterator.__name__ + "[")
            assert mine.return_annotation == f"list[{item}", name
        else:
            assert mine.return_annotation == theirs.return_annotation, name


async def test_local_and_remote_statistics_answer_the_same_keys(store_server: RunningServer) -> None:
    async with StoreClient(store_server.address) as remote:
        await remote.enqueue_rollouts([RolloutSpec(input=i) for i in range(3)])
        claimed = await remote.dequeue_rollout(worker_id="w")
        assert claimed is not None
        over_grpc = await remote.statistics()
    in_process = await LocalStoreClient(store_server.store).statistics()
    assert type(in_process) is type(over_grpc)
    assert vars(in_process).keys() == vars(over_grpc).keys()
    assert in_process.rollouts_by_status == over_grpc.rollouts_by_status
    assert over_grpc.rollouts_by_status["queuing"] == 2 and sum(over_grpc.rollouts_by_status.values()) == 3
    assert all(key == key.lower() for key in over_grpc.rollouts_by_status)
    same = {k: v for k, v in vars(in_process).items() if k != "uptime"}
    assert same == {k: v for k, v in vars(over_grpc).items() if k != "uptime"}
    assert 0 <= over_grpc.uptime <= in_process.uptime


async def test_the_blocking_client_runs_the_async_one(store_server: RunningServer) -> None:
    def script() -> None:
        with SyncStoreClient(store_server.address) as client:
            rollout = client.enqueue_rollout({"x": 1}, group_id="g")
            assert client.get_rollout(rollout.rollout_id).group_id == "g"
            assert client.config.target == store_server.address
            assert client.statistics().rollouts_by_status == {"queuing": 1}
            assert [r.rollout_id for r in client.query_rollouts(group_id="g")] == [rollout.rollout_id]

    await asyncio.to_thread(script)
