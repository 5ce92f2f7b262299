"""Generate the Python stubs of the lightning.v1 contract into lightning_grpc/v1/.

The PyPI package ``lightning`` owns the top-level import name ``lightning``, so the generated
imports are rewritten from ``lightning.v1`` to ``lightning_grpc.v1``; the wire names stay
``lightning.v1.*``.

    python scripts/gen_protos.py          # regenerate
    python scripts/gen_protos.py --check  # exit 1 when the committed stubs differ
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "lightning_grpc" / "v1"
INIT = '"""Generated stubs of the lightning.v1 contract (scripts/gen_protos.py; do not edit)."""\n'

REWRITES = [
    (re.compile(r"^from lightning\.(v\d+)", re.M), r"from lightning_grpc.\1"),
    (re.compile(r"^import lightning\.(v\d+)", re.M), r"import lightning_grpc.\1"),
    (re.compile(r"'lightning\.(v\d+)\.(\w+_pb2)'"), r"'lightning_grpc.\1.\2'"),
]


def generate(dest: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
                f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
                f"--python_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"--mypy_out={tmp}",
                f"--mypy_grpc_out={tmp}",
                *protos,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        noise = "Writing mypy to "
        errors = [line for line in result.stderr.splitlines() if not line.startswith(noise)]
        if result.returncode != 0 or errors:
            sys.stderr.write("\n".join(errors) + "\n")
            raise SystemExit(result.returncode or 1)
        src = Path(tmp) / "lightning" / "v1"
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.iterdir()):
            # Message-only files get an empty *_pb2_grpc module; keep only service ones.
            if f.name.endswith(("_pb2_grpc.py", "_pb2_grpc.pyi")) and "service" not in f.name:
                continue
            text = f.read_text()
            for pattern, repl in REWRITES:
                text = pattern.sub(repl, text)
            (dest / f.name).write_text(text)
        (dest / "__init__.py").write_text(INIT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed stubs")
    args = parser.parse_args()
    if not args.check:
        if OUT.exists():
            shutil.rmtree(OUT)
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "v1"
        generate(fresh)
        cmp = filecmp.dircmp(fresh, OUT)
        stale = cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files
        if stale:
            print("generated stubs are stale; run `make proto`:", ", ".join(sorted(stale)))
            return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
