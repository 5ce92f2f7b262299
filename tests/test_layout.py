"""The package's shape: no import circle between its modules, type-only imports (``TYPE_CHECKING``) and
imports inside functions included. The layers themselves are import-linter's contracts (`make lint`)."""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest


def import_circles(package: str) -> list[list[str]]:
    """Every group of modules that import one another in a circle (strongly connected, more than one)."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = {m for m in graph.modules if not m.startswith(f"{package}.v1")}  # generated stubs
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in sorted(modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group: list[str] = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for module in edges:
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others() -> None:
    assert import_circles("lightning_grpc") == []


def test_a_circle_is_found_when_there_is_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circled import a\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_circles("circled") == [["circled.a", "circled.b"]]
