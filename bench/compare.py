"""Before and after a change, in the same session: the benchmarks of two revisions, run turn about,
side by side.

    python bench/compare.py c2b4d38              # against HEAD; --quick profile, two rounds
    python bench/compare.py main~5 --after main --rounds 3 --profile full

Both revisions are exported with ``git archive`` into a temporary folder (so edits made meanwhile
change nothing) and run from there with this interpreter (their dependencies are assumed the same);
the Agent Lightning peer's environment (``bench/.venv-agl``) is shared. Rounds alternate before/after, and
which goes first alternates too, so that a slow spell of the machine (or one growing busier) falls on both. Every figure is the median over rounds; ratios are after ÷ before, so above 1 is better
for a rate and worse for a latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def short(revision: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or revision


def export(revision: str, into: Path) -> Path:
    """The tree of ``revision`` in ``into``, with the peer's environment linked in."""
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    agl = BENCH / ".venv-agl"
    if agl.exists():
        (into / "bench" / ".venv-agl").symlink_to(agl)
    return into


def run_benchmarks(tree: Path, profile: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "bench" / "run.py"), "--out", str(out), "--no-readme"]
    if profile != "full":
        command.append(f"--{profile}")
    subprocess.run(command, cwd=tree, env=env, check=True)
    # the quick profile writes quick.json since 95845f8 (latest.* is the full profile's); earlier trees wrote
    # latest.json for every profile
    report = (
        out / "quick.json" if profile == "quick" and (out / "quick.json").exists() else out / "latest.json"
    )
    return dict(json.loads(report.read_text()))


def figures(report: dict[str, Any]) -> dict[str, float]:
    """Every rate and p99 of lightning-grpc's own systems, and every ratio the report computes."""
    out: dict[str, list[float]] = {}
    for run in report["runs"]:
        for system, found in run.items():
            if not system.startswith("lightning_grpc"):
                continue
            for workload, result in found.get("results", {}).items():
                for key, value in result.items():
                    if isinstance(value, int | float) and (key.endswith("_per_s") or key == "p99_ms"):
                        out.setdefault(
                            f"{workload} {system.removeprefix('lightning_grpc_')} {key}", []
                        ).append(float(value))
    for name, value in report.get("ratios", {}).items():
        if isinstance(value, int | float):
            out.setdefault(f"ratio {name}", []).append(float(value))
    return {name: statistics.median(values) for name, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--after", default="HEAD", help="the later revision (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", choices=("quick", "full", "smoke"), default="quick")
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "compare.md")
    args = parser.parse_args()
    before: list[dict[str, float]] = []
    after: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        (Path(tmp) / "before").mkdir()
        (Path(tmp) / "after").mkdir()
        base = export(args.revision, Path(tmp) / "before")
        head = export(args.after, Path(tmp) / "after")
        for i in range(args.rounds):
            # the order changes every round, so that a machine growing busier does not always weigh on one side
            turns = [("before", base, before), ("after", head, after)]
            for label, tree, results in turns if i % 2 == 0 else turns[::-1]:
                results.append(figures(run_benchmarks(tree, args.profile, Path(tmp) / f"{label}-{i}")))
            args.out.with_suffix(".json").write_text(json.dumps({"before": before, "after": after}, indent=1))
    names = sorted(set().union(*before) & set().union(*after))
    revs = [short(args.revision), short(args.after)]
    lines = [
        f"Before: {args.revision} ({revs[0]}); after: {args.after} ({revs[-1]}); profile {args.profile}, "
        f"{args.rounds} round(s) each, turn about (first before, then after first); medians.",
        "",
        "| figure | before | after | after ÷ before |",
        "|---|---|---|---|",
    ]
    for name in names:
        b = statistics.median(r[name] for r in before if name in r)
        a = statistics.median(r[name] for r in after if name in r)
        lines.append(f"| {name} | {b:,.3f} | {a:,.3f} | {a / b if b else float('nan'):.3f} |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
