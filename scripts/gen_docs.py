"""Generate the reference pages of docs/ from the code they describe, so that they cannot go stale.

docs/configuration.md: every section and key of the experiment file, with its type, default and meaning,
from the dataclasses of lightning_grpc/training/experiment.py (what ``lightning-grpc train --help-config``
prints), beside what the demo's file sets. docs/metrics.md: every metric a training run writes, from
``METRICS`` in lightning_grpc/training/metrics.py. tests/training/test_reference_docs.py fails when a page
differs from what this gives.

    python scripts/gen_docs.py          # regenerate (make docs-reference)
    python scripts/gen_docs.py --check  # exit 1 when a page differs, naming it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: The experiment file whose values the configuration reference shows beside the defaults (`make demo`'s).
DEMO = "examples/combination_lock/config.toml"
#: What regenerates the pages (said by --check and by the test).
COMMAND = "make docs-reference (or: .venv/bin/python scripts/gen_docs.py)"


def pages() -> dict[Path, str]:
    """Each generated page and the text the code gives it now."""
    from lightning_grpc.training.experiment import config_reference_markdown
    from lightning_grpc.training.metrics import metrics_reference_markdown

    return {
        DOCS / "configuration.md": config_reference_markdown(ROOT / DEMO, DEMO),
        DOCS / "metrics.md": metrics_reference_markdown(),
    }


def stale() -> list[Path]:
    """The pages whose file differs from what the code gives."""
    return [path for path, text in pages().items() if not path.is_file() or path.read_text() != text]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare the pages with what the code gives")
    args = parser.parse_args()
    if args.check:
        differ = stale()
        for path in differ:
            print(
                f"{path.relative_to(ROOT)} differs from what the code gives: run {COMMAND}", file=sys.stderr
            )
        return 1 if differ else 0
    for path, text in pages().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
