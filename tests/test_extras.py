"""Optional dependencies: a module whose extra is missing says which extra installs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_grpc._extras import MissingExtraError, extra_imports, import_extra

# module imported -> (a package it needs, the extra that installs it)
NEEDS = {
    "lightning_grpc.engine.server": ("torch", "engine"),
    "lightning_grpc.engine.scheduler": ("transformers", "engine"),
    "lightning_grpc.training.loop": ("torch", "train"),
    "lightning_grpc.proxy": ("aiohttp", "proxy"),
    "lightning_grpc.proxy.http1": ("httptools", "proxy"),
    "lightning_grpc.dashboard": ("aiohttp", "dashboard"),
}


@pytest.mark.parametrize("module", sorted(NEEDS))
def test_a_missing_extra_is_named(module: str) -> None:
    missing, extra = NEEDS[module]
    # None in sys.modules makes `import missing` fail as an uninstalled package does
    code = f"import sys; sys.modules[{missing!r}] = None; import {module}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"needs {missing}, which is not installed: pip install 'lightning-grpc[{extra}]'" in out.stderr


# a command -> (a package it needs, the extra that installs it)
COMMANDS = {
    "init-model": ("transformers", "engine"),
    "engine": ("torch", "engine"),
    "proxy": ("aiohttp", "proxy"),
    "train": ("torch", "train"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_without_its_extra_says_which_to_install(command: str, tmp_path: Path) -> None:
    missing, extra = COMMANDS[command]
    argv = {
        "init-model": ["init-model", str(tmp_path / "model")],
        "engine": ["engine", "--model", str(tmp_path / "model")],
        "proxy": ["proxy", "--backend", "http://127.0.0.1:9/v1"],
        "train": ["train", str(tmp_path / "experiment.toml")],
    }[command]
    code = (
        f"import sys; sys.modules[{missing!r}] = None; from lightning_grpc.cli.main import main;"
        f" sys.exit(main({argv!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert f"needs {missing}, which is not installed: pip install 'lightning-grpc[{extra}]'" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")


def test_the_bare_modules_import_without_any_extra() -> None:
    blocked = ["torch", "transformers", "matplotlib", "aiohttp", "httptools", "litellm", "openai", "ray"]
    blocked += ["yaml", "tqdm"]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}));"
        "import lightning_grpc.client, lightning_grpc.runner, lightning_grpc.tracing, lightning_grpc.algorithm,"
        " lightning_grpc.server.app, lightning_grpc.cli.main, lightning_grpc.engine"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_import_extra() -> None:
    assert import_extra("json", "never").dumps([1]) == "[1]"
    with pytest.raises(MissingExtraError) as caught:
        import_extra("lightning_grpc_no_such_package.sub", "proxy")
    assert isinstance(caught.value, ImportError)
    assert caught.value.extra == "proxy" and caught.value.missing == "lightning_grpc_no_such_package"
    assert str(caught.value) == (
        f"{__name__} needs lightning_grpc_no_such_package, which is not installed: "
        "pip install 'lightning-grpc[proxy]'"
    )


def test_other_errors_pass_through() -> None:
    with pytest.raises(ZeroDivisionError), extra_imports("engine"):
        1 / 0  # noqa: B018
    # a missing module of the project itself is a bug, not a missing extra
    with pytest.raises(ModuleNotFoundError) as caught, extra_imports("engine"):
        import lightning_grpc.no_such_module  # noqa: F401
    assert not isinstance(caught.value, MissingExtraError)
