"""Create bench/.venv-agl/ with Agent Lightning 0.3.0 (the reference store) for the side-by-side bench.

Run with any Python 3.11: ``python bench/agl_setup.py``. Idempotent: a marker file inside the venv records
the pinned set that was installed, and a later run whose pins match (and whose installed versions still
match) does nothing. Only this script reaches the network (pip, PyPI); the bench itself runs offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
VENV_DIR = BENCH_DIR / ".venv-agl"
MARKER = VENV_DIR / ".agl-pins.json"

# Top-level pins. LiteLLM 1.107.0 was compromised and withdrawn: we pin a 1.106.x release (1.106.2 is the
# newest 1.106.x whose requirements resolve on the index this project uses) and the constraints also forbid
# the whole 1.107 line should anything try to pull it in.
PINS: dict[str, str] = {
    "agentlightning": "0.3.0",
    "agentops": "0.4.21",
    "litellm": "1.106.2",
}
# The packages that carry the reference's request path (HTTP server, validation, client, OTLP decoding) are
# pinned too, so that its figures do not drift with whatever pip would pick on a later day.
RUNTIME_PINS: dict[str, str] = {
    "fastapi": "0.165.0",
    "starlette": "1.10.0",
    "uvicorn": "0.54.0",
    "pydantic": "2.14.3",
    "pydantic_core": "2.50.4",
    "aiohttp": "3.14.5",
    "protobuf": "7.36.2",
    "opentelemetry-proto": "1.45.2",
    "opentelemetry-sdk": "1.45.2",
}
REQUIREMENTS = [
    "agentlightning==0.3.0",
    "agentops==0.4.21",
    "litellm[proxy]==1.106.2",
    # The driver's OTLP/HTTP path uses these directly (both are dependencies of the set above anyway).
    "aiohttp",
    "opentelemetry-proto",
]
CONSTRAINTS = [
    "litellm!=1.107.*",
    *(f"{name}=={version}" for name, version in {**PINS, **RUNTIME_PINS}.items()),
]
ALL_PINS: dict[str, str] = {**PINS, **RUNTIME_PINS}

# Run-time environment that keeps the reference offline and quiet. agl_server.py and agl_peer.py apply it
# before importing Agent Lightning (which imports LiteLLM and AgentOps). Endpoints that could be contacted
# point at a closed local port, so a stray call fails fast on this machine instead of leaving it.
CLOSED_LOCAL = "http://127.0.0.1:9"
OFFLINE_ENV: dict[str, str] = {
    "AGENTOPS_AUTO_INIT": "false",
    "AGENTOPS_AUTO_START_SESSION": "false",
    "AGENTOPS_PREFETCH_JWT_TOKEN": "false",
    "AGENTOPS_ENV_DATA_OPT_OUT": "true",
    "AGENTOPS_INSTRUMENT_LLM_CALLS": "false",
    "AGENTOPS_LOG_LEVEL": "CRITICAL",
    "AGENTOPS_API_ENDPOINT": CLOSED_LOCAL,
    "AGENTOPS_APP_URL": CLOSED_LOCAL,
    "AGENTOPS_EXPORTER_ENDPOINT": CLOSED_LOCAL + "/v1/traces",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "OTEL_SDK_DISABLED": "true",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "NO_PROXY": "127.0.0.1,localhost",
}
# Unset so that nothing authenticates against a hosted service.
OFFLINE_UNSET = (
    "AGENTOPS_API_KEY",
    "OPENAI_API_KEY",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
)


def apply_offline_env() -> None:
    """Set the run-time environment above in this process (call before importing Agent Lightning)."""
    for name in OFFLINE_UNSET:
        os.environ.pop(name, None)
    os.environ.update(OFFLINE_ENV)


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def pin_digest() -> str:
    text = json.dumps({"requirements": REQUIREMENTS, "constraints": CONSTRAINTS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def installed_versions() -> dict[str, str | None]:
    """Versions of the pinned distributions as the venv sees them (None if missing)."""
    code = (
        "import json, importlib.metadata as m, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [str(venv_python()), "-c", code, *ALL_PINS], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return dict.fromkeys(ALL_PINS)
    return json.loads(proc.stdout)


def already_installed() -> bool:
    if not venv_python().exists() or not MARKER.exists():
        return False
    try:
        marker = json.loads(MARKER.read_text())
    except (OSError, ValueError):
        return False
    return marker.get("digest") == pin_digest() and installed_versions() == ALL_PINS


def create_venv() -> None:
    if not venv_python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV_DIR)], check=True)
    # Keep the venv out of git whatever the repository's .gitignore says (as newer `venv` does itself).
    (VENV_DIR / ".gitignore").write_text("*\n")


def pip_install() -> None:
    constraints = VENV_DIR / "agl-constraints.txt"
    constraints.write_text("\n".join(CONSTRAINTS) + "\n")
    base = [str(venv_python()), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*base, "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([*base, "install", "--quiet", "-c", str(constraints), *REQUIREMENTS], check=True)


def write_marker(seconds: float) -> None:
    versions = installed_versions()
    if versions != ALL_PINS:
        raise SystemExit(f"agl_setup: installed versions {versions} do not match the pins {ALL_PINS}")
    marker = {"digest": pin_digest(), "versions": versions, "install_seconds": round(seconds, 1)}
    MARKER.write_text(json.dumps(marker, indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="reinstall even if the marker matches")
    args = parser.parse_args()
    if not args.force and already_installed():
        print(f"agl_setup: {VENV_DIR} already has {PINS}; nothing to do")
        return 0
    started = time.monotonic()
    create_venv()
    pip_install()
    elapsed = time.monotonic() - started
    write_marker(elapsed)
    print(f"agl_setup: installed {PINS} into {VENV_DIR} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
