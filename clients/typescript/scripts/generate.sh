#!/usr/bin/env bash
# Generate the TypeScript client's Protobuf-ES code into src/gen/ from the repository's proto/, plus
# google.rpc.ErrorInfo (the detail of every error the server sends) from the googleapis protos that the
# Python environment ships, and src/gen/lightning/v1/retryable_methods.ts from the rpcs' idempotency_level.
#
#   bash scripts/generate.sh          # regenerate src/gen/
#   bash scripts/generate.sh --check  # exit 1 when the committed src/gen/ differs from a fresh generation
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(cd "$here/../.." && pwd)"
buf="${BUF:-$root/.venv/bin/buf}"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$buf" ] || { echo "generate.sh: no buf at $buf (run 'make setup' at the repository root, or set BUF)" >&2; exit 2; }
# protoc-gen-es from the npm workspace (`npm ci` at the repository root installs it into the root's
# node_modules; a copy in this package's own node_modules wins, as node would resolve it).
plugin=""
for bin in "$here/node_modules/.bin" "$root/node_modules/.bin"; do
  if [ -x "$bin/protoc-gen-es" ]; then plugin="$bin/protoc-gen-es"; break; fi
done
[ -n "$plugin" ] || { echo "generate.sh: no protoc-gen-es: run 'npm ci' at the repository root ($root) first" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
googleapis="$("$python" -c 'import pathlib; from google.rpc import error_details_pb2 as m; print(pathlib.Path(m.__file__).parent.parent.parent)')"
mkdir -p "$work/googleapis/google/rpc" "$work/out"
cp "$googleapis/google/rpc/error_details.proto" "$work/googleapis/google/rpc/"

template="$(sed "s#out: src/gen#out: $work/out#; s#local: node_modules/.bin/protoc-gen-es#local: $plugin#" "$here/buf.gen.yaml")"
(cd "$root" && "$buf" generate --template "$template")
(cd "$work/googleapis" && "$buf" generate --template "$template" --path google/rpc/error_details.proto)
# The methods the contract marks NO_SIDE_EFFECTS or IDEMPOTENT: the only calls the client retries.
(cd "$root" && "$buf" build --exclude-source-info -o "$work/image.binpb")
"$python" "$here/scripts/retryable_methods.py" "$work/image.binpb" > "$work/out/lightning/v1/retryable_methods.ts"

if [ "${1:-}" = "--check" ]; then
  if ! diff -r "$work/out" "$here/src/gen" > "$work/diff"; then
    echo "clients/typescript/src/gen is stale: run 'npm run generate' in clients/typescript (diff below)" >&2
    head -40 "$work/diff" >&2
    exit 1
  fi
  echo "clients/typescript/src/gen is up to date"
else
  rm -rf "$here/src/gen"
  mkdir -p "$here/src"
  cp -r "$work/out" "$here/src/gen"
  echo "generated $(find "$here/src/gen" -name '*.ts' | wc -l) files into clients/typescript/src/gen"
fi
