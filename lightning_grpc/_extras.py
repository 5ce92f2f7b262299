"""Optional dependencies: an import that needs an extra says which one to install.

``pip install lightning-grpc`` brings the contract, the clients, the runner, tracing and the Store
server; the rest comes with extras (``[proxy]``, ``[engine]``, ``[train]``, ``[dashboard]``, ...,
``[all]``). A module that needs one wraps its imports of it::

    from lightning_grpc._extras import extra_imports

    with extra_imports("engine"):
        import torch
        from transformers import DynamicCache

so that, without torch, importing the module raises :class:`MissingExtraError` (an ``ImportError``)
that reads "lightning_grpc.engine.scheduler needs torch, which is not installed: pip install
'lightning-grpc[engine]'". The imports stay ordinary imports, typed as such. A function that imports
one module on first use calls :func:`import_extra` instead.
"""

from __future__ import annotations

import importlib
import sys
from types import TracebackType
from typing import Any


class MissingExtraError(ModuleNotFoundError):
    """A module of an optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, extra: str, missing: str, needed_by: str) -> None:
        super().__init__(
            f"{needed_by} needs {missing}, which is not installed: pip install 'lightning-grpc[{extra}]'",
            name=missing,
        )
        self.extra = extra
        self.missing = missing
        self.needed_by = needed_by


class extra_imports:
    """Context manager around the imports of an extra: a missing module raises :class:`MissingExtraError`.

    Only a module that is not installed at all is translated; an installed package that fails to import
    (a broken build, a missing shared library) raises its own error, unchanged.
    """

    def __init__(self, extra: str, *, needed_by: str | None = None) -> None:
        self.extra = extra
        self.needed_by = needed_by or sys._getframe(1).f_globals.get("__name__", "lightning_grpc")

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, ModuleNotFoundError) and not isinstance(exc, MissingExtraError):
            missing = (exc.name or "").partition(".")[0]
            if missing and missing != "lightning_grpc":
                raise MissingExtraError(self.extra, missing, self.needed_by) from exc


def import_extra(module: str, extra: str, *, needed_by: str | None = None) -> Any:
    """Import ``module`` (a dotted name), or raise :class:`MissingExtraError` naming ``extra``.

    The module comes back untyped (its attributes are ``Any``): for typed names, import them under
    :class:`extra_imports` instead.
    """
    with extra_imports(extra, needed_by=needed_by or sys._getframe(1).f_globals.get("__name__", "")):
        return importlib.import_module(module)
