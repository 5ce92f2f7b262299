"""Environment variables: named once, in lightning_grpc/environment.py, each with what it does and its default."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lightning_grpc
from lightning_grpc import environment

ROOT = Path(lightning_grpc.__file__).parent
DECLARATIONS = ROOT / "environment.py"
#: Where the TypeScript client reads the variables a training run gives an agent command.
TYPESCRIPT = ROOT.parent / "clients" / "typescript" / "src"


def sources() -> list[Path]:
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if path != DECLARATIONS and "node_modules" not in path.parts and path.parent.name != "v1"
    ]


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def declared() -> dict[str, tuple[str, str | None]]:
    """Each constant of environment.py: its value and the docstring under it (None when it has none)."""
    body = ast.parse(DECLARATIONS.read_text(encoding="utf-8")).body
    found: dict[str, tuple[str, str | None]] = {}
    for statement, following in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)
        ):
            doc = None
            if (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                doc = following.value.value
            found[statement.targets[0].id] = (statement.value.value, doc)
    return found


def test_no_module_spells_a_variable_of_its_own() -> None:
    """Code names a LIGHTNING_GRPC_* variable through lightning_grpc.environment only (docstrings may
    mention one)."""
    spelled = []
    for path in sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and environment.PREFIX in node.value
                and id(node) not in skip
            ):
                spelled.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    assert spelled == []


def test_every_variable_is_documented_with_its_default() -> None:
    variables = {name: value for name, value in declared().items() if name != "PREFIX"}
    assert variables, "environment.py declares no variable"
    undocumented = [name for name, (_, doc) in variables.items() if not doc or "Default" not in doc]
    assert undocumented == []
    values = [value for value, _ in variables.values()]
    assert len(values) == len(set(values))  # no variable declared twice
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", value) for value in values)
    ours = [value for value in values if value.startswith(environment.PREFIX)]
    assert all(getattr(environment, name) == value for name, (value, _) in variables.items())
    assert len(ours) >= 10


def test_the_variables_the_typescript_client_reads_are_declared() -> None:
    if not TYPESCRIPT.is_dir():
        pytest.skip("no TypeScript client in this tree")
    read = set()
    for path in TYPESCRIPT.rglob("*.ts"):
        read |= set(
            re.findall(r"process\.env\.(LIGHTNING_GRPC_[A-Z0-9_]+)", path.read_text(encoding="utf-8"))
        )
    assert read <= {value for value, _ in declared().values()}


def test_read_takes_an_empty_variable_for_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.STORE, "")
    assert environment.read(environment.STORE) is None
    monkeypatch.setenv(environment.STORE, "store:4747")
    assert environment.read(environment.STORE) == "store:4747"
    monkeypatch.delenv(environment.STORE)
    assert environment.read(environment.STORE) is None
