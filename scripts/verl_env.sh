#!/usr/bin/env bash
# Build .venv-verl: a separate environment holding verl 0.9.1 on CPU, used only by the parity test
# (tests/test_verl_parity.py). The package itself never imports verl.
#
# Usage: scripts/verl_env.sh [VENV_DIR]   (default .venv-verl; `make verl-env` calls it from the repo root)
set -euo pipefail

VENV_DIR="${1:-.venv-verl}"
PY="$VENV_DIR/bin/python"

test -x "$PY" || python3 -m venv "$VENV_DIR"
"$PY" -m pip install --quiet --upgrade pip
# CPU torch first: verl does not depend on torch, but its dependencies (peft, accelerate) do, and an
# unpinned torch would pull several GB of CUDA packages.
"$PY" -m pip install --quiet torch==2.13.0
# verl 0.9.1 with its base requirements (tensordict, transformers <5.11, ray, hydra-core, ...); the torch
# installed above satisfies what its dependencies ask for.
"$PY" -m pip install --quiet verl==0.9.1 numpy pytest pytest-timeout pytest-asyncio
# The project's runtime dependencies that importing lightning_grpc.trainer needs, then the project itself:
# all of pyproject.toml's dependencies but torch and transformers (verl's pins stand) and litellm and
# openai (the LLM client side, which nothing here imports; litellm pins filelock, python-dateutil and
# importlib-metadata below what verl's dependencies installed). pytest-asyncio and pytest-timeout above
# only serve pyproject.toml's pytest settings: the parity test runs with --noconftest.
"$PY" - > "$VENV_DIR/project-requirements.txt" <<'PYTHON'
import re
import tomllib

LEFT_OUT = {"torch", "transformers", "litellm", "openai"}
with open("pyproject.toml", "rb") as project:
    dependencies = tomllib.load(project)["project"]["dependencies"]
print("\n".join(d for d in dependencies if re.match(r"[\w.-]+", d).group().lower() not in LEFT_OUT))
PYTHON
"$PY" -m pip install --quiet -r "$VENV_DIR/project-requirements.txt"
"$PY" -m pip install --quiet --no-deps -e .
"$PY" -c 'import verl.trainer.ppo.core_algos, lightning_grpc.trainer.ppo; print("verl", verl.__version__, "imports on CPU")'
