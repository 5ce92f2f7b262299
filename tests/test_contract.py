"""The contract: stubs import from lightning_grpc.v1, wire names stay lightning.v1, every RPC is served."""

from __future__ import annotations

import subprocess
import sys

from lightning_grpc.server.store_servicer import StoreServicer
from lightning_grpc.v1 import store_service_pb2, store_service_pb2_grpc
from tests.conftest import ROOT


def test_stubs_import_under_lightning_grpc_with_wire_names_unchanged() -> None:
    service = store_service_pb2.DESCRIPTOR.services_by_name["StoreService"]
    assert service.full_name == "lightning.v1.StoreService"
    assert store_service_pb2.StartRolloutRequest.DESCRIPTOR.full_name == "lightning.v1.StartRolloutRequest"
    assert store_service_pb2_grpc.StoreServiceStub.__module__ == "lightning_grpc.v1.store_service_pb2_grpc"


def test_every_rpc_of_the_contract_is_implemented_by_the_servicer() -> None:
    service = store_service_pb2.DESCRIPTOR.services_by_name["StoreService"]
    base = store_service_pb2_grpc.StoreServiceServicer
    missing = [m.name for m in service.methods if getattr(StoreServicer, m.name) is getattr(base, m.name)]
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
