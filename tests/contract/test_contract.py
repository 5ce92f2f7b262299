"""The contract: stubs import from lightning_grpc.v1, wire names stay lightning.v1, every RPC is served."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_grpc.server.proxy_servicer import ProxyServicer
from lightning_grpc.server.store_servicer import StoreServicer
from lightning_grpc.server.trainer_servicer import TrainerServicer
from lightning_grpc.v1 import (
    proxy_service_pb2,
    proxy_service_pb2_grpc,
    store_service_pb2,
    store_service_pb2_grpc,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)
from tests.conftest import ROOT


def test_stubs_import_under_lightning_grpc_with_wire_names_unchanged() -> None:
    service = store_service_pb2.DESCRIPTOR.services_by_name["StoreService"]
    assert service.full_name == "lightning.v1.StoreService"
    assert store_service_pb2.StartRolloutRequest.DESCRIPTOR.full_name == "lightning.v1.StartRolloutRequest"
    assert store_service_pb2_grpc.StoreServiceStub.__module__ == "lightning_grpc.v1.store_service_pb2_grpc"


@pytest.mark.parametrize(
    ("module", "grpc_module", "name", "servicer"),
    [
        (store_service_pb2, store_service_pb2_grpc, "StoreService", StoreServicer),
        (trainer_service_pb2, trainer_service_pb2_grpc, "TrainerService", TrainerServicer),
        (proxy_service_pb2, proxy_service_pb2_grpc, "ProxyService", ProxyServicer),
    ],
)
def test_every_rpc_of_the_contract_is_implemented_by_the_servicer(
    module: object, grpc_module: object, name: str, servicer: type
) -> None:
    service = module.DESCRIPTOR.services_by_name[name]  # type: ignore[attr-defined]
    base = getattr(grpc_module, f"{name}Servicer")
    missing = [m.name for m in service.methods if getattr(servicer, m.name) is getattr(base, m.name)]
    assert missing == []


def test_committed_stubs_equal_a_fresh_generation() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_even_when_a_package_named_lightning_shadows_the_name(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "lightning"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('this is not the contract')\n")
    code = "from lightning_grpc.v1 import store_service_pb2; print(store_service_pb2.DESCRIPTOR.package)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lightning.v1"
