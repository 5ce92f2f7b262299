#!/usr/bin/env bash
# The bare install, as a user gets it: `pip install lightning-grpc` (no extras) into a fresh virtual
# environment, from this checkout (its dependencies from PyPI). Checks that no heavy package came with it
# (torch, transformers, matplotlib, ...), that `lightning-grpc serve` without its dashboard runs on it and
# that `serve` with the dashboard names the extra to install, then runs the README's Quickstart client
# code and a runner with a trivial agent (`lightning-grpc runner`) against that server.
#
#   bash scripts/check_bare_install.sh            # a temporary environment, removed afterwards
#   KEEP=1 bash scripts/check_bare_install.sh     # keep it (its path is printed)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/lightning-grpc-bare.XXXXXX")"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ -n "${KEEP:-}" ]; then echo "kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
started=$SECONDS
step() { echo "[bare install, $((SECONDS - started)) s] $*"; }

step "fresh venv in $WORK/venv"
"$PYTHON" -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
# pip, without the notes of find-links folders that this machine's pip configuration names but lacks
pip() { "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }
pip install --quiet --upgrade pip
# A copy of the tracked files (and the generated stubs): the checkout's own build folders stay untouched.
mkdir "$WORK/src"
git -C "$ROOT" ls-files -z --cached --others --exclude-standard \
  | tar -C "$ROOT" --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$WORK/src"
step "pip install lightning-grpc (no extras)"
pip install --quiet "$WORK/src"
pip list --format=freeze > "$WORK/installed.txt"
step "installed: $(wc -l < "$WORK/installed.txt") distributions, $(du -sm "$WORK/venv" | cut -f1) MB"

step "no heavy package"
heavy="torch transformers matplotlib tokenizers litellm openai aiohttp ray tensorboard pandas scipy"
found=""
for name in $heavy; do
  if grep -qi "^${name}==" "$WORK/installed.txt"; then found="$found $name"; fi
done
if [ -n "$found" ]; then
  echo "FAIL: the bare install brought:$found" >&2
  exit 1
fi

step "an optional module names its extra"
"$PY" - <<'EOF'
import importlib

for module, extra in [
    ("lightning_grpc.engine.server", "engine"),
    ("lightning_grpc.training.loop", "train"),
    ("lightning_grpc.proxy", "proxy"),
    ("lightning_grpc.dashboard", "dashboard"),
]:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        assert f"pip install 'lightning-grpc[{extra}]'" in str(exc), (module, str(exc))
        print(f"  {module}: {exc}")
    else:
        raise SystemExit(f"FAIL: {module} imported without its extra [{extra}]")
EOF

cd "$WORK"
step "lightning-grpc serve (with its dashboard) names the extra"
if out=$(timeout 60 "$WORK/venv/bin/lightning-grpc" serve --host 127.0.0.1 --port 0 --memory 2>&1); then
  echo "FAIL: serve with its dashboard ran without the [dashboard] extra" >&2
  exit 1
fi
grep -q "pip install 'lightning-grpc\[dashboard\]'" <<< "$out" || { echo "FAIL: $out" >&2; exit 1; }

step "lightning-grpc serve --no-dashboard"
"$WORK/venv/bin/lightning-grpc" serve --host 127.0.0.1 --port 0 --db "$WORK/lightning.db" --no-dashboard \
  > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 200); do
  grep -q "event=server_started" "$WORK/server.log" && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 0.1
done
ADDRESS=$(grep -o "event=server_started.*" "$WORK/server.log" | grep -o "address=[^ ]*" | head -1 | cut -d= -f2)
[ -n "$ADDRESS" ] || { echo "FAIL: the server did not start" >&2; cat "$WORK/server.log" >&2; exit 1; }
step "server on $ADDRESS"

step "the Quickstart's client code"
# README.md's Quickstart block, on this server's address
"$PY" - "$ROOT/README.md" "$ADDRESS" <<'EOF'
import re
import sys

readme, address = sys.argv[1], sys.argv[2]
text = open(readme, encoding="utf-8").read()
quickstart = text[text.index("## Quickstart") :]
code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
assert '"127.0.0.1:4747"' in code, "the Quickstart's client no longer dials 127.0.0.1:4747"
code = code.replace('"127.0.0.1:4747"', repr(address))
exec(compile(code, "README.md (Quickstart)", "exec"), {"__name__": "__main__"})
EOF

step "a runner with a trivial agent"
cat > "$WORK/bare_agent.py" <<'EOF'
from lightning_grpc.runner import rollout


@rollout
def agent(task: dict) -> float:
    return 1.0 if task["question"] == "2+2" else 0.0
EOF
"$PY" - "$ADDRESS" <<'EOF'
import sys

from lightning_grpc.client import SyncStoreClient

with SyncStoreClient(sys.argv[1]) as store:
    store.enqueue_rollout({"question": "2+2"}, mode="train")
EOF
PYTHONPATH="$WORK" timeout 120 "$WORK/venv/bin/lightning-grpc" runner bare_agent:agent --store "$ADDRESS" \
  --max-rollouts 1 --poll-wait 1 --log-level WARNING
"$PY" - "$ADDRESS" <<'EOF'
import asyncio
import sys

from lightning_grpc.algorithm import Algorithm
from lightning_grpc.client import StoreClient
from lightning_grpc.types import RolloutStatus


async def main() -> None:
    async with StoreClient(sys.argv[1]) as store:
        rollouts = [r for r in (await store.query_rollouts()) if r.input == {"question": "2+2"}]
        done = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
        assert len(done) == len(rollouts) == 2, [(r.rollout_id, r.status) for r in rollouts]
        results = await Algorithm(store).results(done)
        assert all(r.reward == 1.0 for r in results), results
        print("  rollouts:", ", ".join(f"{r.rollout_id} {r.status}" for r in done))


asyncio.run(main())
EOF
step "OK: the bare install serves, its client and runner work, nothing heavy installed"
