#!/usr/bin/env bash
# Build .venv-verl: the project with its `verl` extra (verl 0.9.1) and the dev tools, in one environment,
# as a user would install it: `pip install 'lightning-grpc[verl]'`. `make verl-test` runs the verl
# backend's tests and the loss parity test there; the default environment (.venv) never holds verl.
#
# Usage: scripts/verl_env.sh [VENV_DIR]   (default .venv-verl; `make verl-env` calls it from the repo root)
set -euo pipefail

VENV_DIR="${1:-.venv-verl}"
PY="$VENV_DIR/bin/python"

test -x "$PY" || python3 -m venv "$VENV_DIR"
"$PY" -m pip install --quiet --upgrade pip
# CPU torch first: verl's dependencies (peft, accelerate) ask for torch, and an unpinned torch would pull
# several GB of CUDA packages.
"$PY" -m pip install --quiet torch==2.13.0
# The project, its verl extra (verl[verl-core]==0.9.1, transformers <5.11) and its dev tools, resolved
# together so every pin holds at once (LiteLLM's included).
"$PY" -m pip install --quiet -e ".[verl,dev]"
"$PY" -c 'import verl, verl.trainer.ppo.ray_trainer, lightning_grpc.training.verl_backend as b; print("verl", verl.__version__, "with lightning-grpc: the verl backend imports on CPU")'
