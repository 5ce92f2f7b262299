"""How cost grows with the store: fill it with finished rollouts step by step, measure at each size.

    python bench/scaling.py            # 1k, 10k, 100k finished rollouts of 10 spans each
    python bench/scaling.py --quick    # 1k and 10k
    python bench/scaling.py --smoke    # seconds; 50 and 150, ours only; used by `make test`

Each system is one server process, filled to each size in turn (lightning-grpc with the memory and the
SQLite backend, Agent Lightning 0.3.0's store from bench/.venv-agl), then measured there: the rollout
cycle's throughput, one dequeue's latency on a short queue, one old random rollout's spans, and the first
page (50) of ListRollouts filtered by status, a filter matching every finished rollout (succeeded) and one
matching a few (queuing). The drivers are scaling_grpc.py and scaling_agl.py, each in its own process.
A fill that runs past its time budget (or a server above --max-rss-gib) stops: that size and the larger
ones are reported as not reached. Writes bench/results/scaling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import AGL_PY, BENCH, PY, RESULTS, ROOT, Server, agl, machine, ours, versions


@dataclass(frozen=True)
class Profile:
    sizes: tuple[int, ...] = (1_000, 10_000, 100_000)
    spans_per_rollout: int = 10
    #: Spans-of-a-rollout and dequeue samples; ListRollouts samples (each filter).
    samples: int = 200
    list_samples: int = 50
    page: int = 50
    #: The rollout cycle: rollouts per repetition, workers, spans per rollout, repetitions.
    cycle_rollouts: int = 256
    cycle_workers: int = 8
    cycle_spans: int = 5
    cycle_reps: int = 5
    #: Most seconds of one timed loop (at least 5 samples are taken).
    max_seconds: float = 20.0
    #: Most seconds one system may spend filling, all sizes together.
    fill_budget_s: float = 600.0
    #: A server above this resident memory stops its fill (that size is not reached).
    max_rss_gib: float = 8.0


PROFILES = {
    "full": Profile(),
    "quick": Profile(
        sizes=(1_000, 10_000),
        samples=100,
        list_samples=30,
        cycle_reps=3,
        max_seconds=10.0,
        fill_budget_s=300.0,
    ),
    "smoke": Profile(
        sizes=(50, 150),
        samples=10,
        list_samples=5,
        cycle_rollouts=32,
        cycle_reps=2,
        max_seconds=5.0,
        fill_budget_s=60.0,
    ),
}

SYSTEMS = ("lightning_grpc_memory", "lightning_grpc_sqlite", "agentlightning")
LABELS = {
    "lightning_grpc_memory": "lightning-grpc, memory",
    "lightning_grpc_sqlite": "lightning-grpc, SQLite",
    "agentlightning": "Agent Lightning 0.3.0",
}
#: (key in a measure result, what it is, unit, higher is better).
MEASURES = [
    ("rollout_cycle", "rollout cycle", "rollouts/s", True),
    ("dequeue", "one dequeue (queue of 5-24)", "ms", False),
    ("spans_of_rollout", "one old rollout's 10 spans", "ms", False),
    ("list_succeeded", "ListRollouts first 50, status=succeeded", "ms", False),
    ("list_queuing", "ListRollouts first 50, status=queuing (20 match)", "ms", False),
]
#: A measure that changes more than this between the smallest and the largest size is not flat.
FLAT_LIMIT = 2.0


# ------------------------------------------------------------------ running the drivers


def start(system: str, workdir: Path) -> AbstractContextManager[Server]:
    if system == "agentlightning":
        return agl()  # type: ignore[no-any-return]
    db = workdir / "scaling.db" if system == "lightning_grpc_sqlite" else None
    return ours(system, db)  # type: ignore[no-any-return]


def driver(system: str, srv: Server) -> list[str]:
    if system == "agentlightning":
        return [str(AGL_PY), str(BENCH / "scaling_agl.py"), "--url", f"http://{srv.address}"]
    return [PY, str(BENCH / "scaling_grpc.py"), "--target", srv.address]


def last_json(lines: list[str]) -> dict[str, Any] | None:
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:
                continue
    return None


def fill(
    system: str, srv: Server, count: int, ids: Path, seconds: float, max_rss: int, log: Any
) -> dict[str, Any]:
    """Add ``count`` finished rollouts within ``seconds``; stopped early if the server grows past ``max_rss``."""
    cmd = [*driver(system, srv), "fill", "--count", str(count), "--ids-out", str(ids)]
    cmd += ["--max-seconds", f"{max(seconds, 1.0):.0f}"]
    cmd += ["--concurrency", "4" if system == "agentlightning" else "32"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    errors: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True),  # type: ignore[arg-type]
        threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True),  # type: ignore[arg-type]
    ]
    for r in readers:
        r.start()
    backstop = time.monotonic() + seconds + 120
    stopped = ""
    shown = 0.0
    while proc.poll() is None:
        time.sleep(0.5)
        if srv.rss.now() > max_rss:
            stopped = f"server RSS above {max_rss / 2**30:.1f} GiB"
        elif time.monotonic() > backstop:
            stopped = "fill did not stop at its time budget"
        if stopped:
            proc.kill()
            break
        if time.monotonic() - shown > 30:
            shown = time.monotonic()
            got = last_json(lines)
            if got:
                log(f"  filling: {got.get('filled', 0):,} of {count:,} in {got.get('seconds')} s")
    proc.wait()
    for r in readers:
        r.join(5)
    result = last_json(lines) or {}
    if result.get("progress") or not result:
        result = {"filled": result.get("filled", 0), "complete": False, "seconds": result.get("seconds")}
        result["error"] = stopped or ("".join(errors[-20:])[-2000:] or f"exit status {proc.returncode}")
    elif not result.get("complete"):
        result["error"] = f"fill time budget spent ({seconds:.0f} s of it were left for this step)"
        result["budget_spent"] = True
    return result


def measure(system: str, srv: Server, ids: Path, prof: Profile) -> dict[str, Any]:
    cmd = [*driver(system, srv), "measure", "--ids-file", str(ids)]
    for flag, value in (
        ("--samples", prof.samples),
        ("--list-samples", prof.list_samples),
        ("--page", prof.page),
        ("--cycle-rollouts", prof.cycle_rollouts),
        ("--cycle-workers", prof.cycle_workers),
        ("--cycle-spans", prof.cycle_spans),
        ("--cycle-reps", prof.cycle_reps),
        ("--max-seconds", prof.max_seconds),
    ):
        cmd += [flag, str(value)]
    timeout = prof.max_seconds * 4 + prof.cycle_reps * 120 + 120
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"measure timed out after {timeout:.0f} s"}
    result = last_json(out.stdout.splitlines())
    if out.returncode != 0 or result is None:
        return {"error": (out.stderr or out.stdout)[-2000:]}
    return result


def run_system(system: str, prof: Profile, workdir: Path, log: Any) -> dict[str, Any]:
    if system == "agentlightning" and not AGL_PY.exists():
        return {"error": "bench/.venv-agl is missing (python bench/agl_setup.py builds it)", "points": []}
    ids = workdir / f"{system}.ids"
    ids.write_text("")
    points: list[dict[str, Any]] = []
    log(f"{system}: starting its server")
    with start(system, workdir) as srv:
        finished = 0
        budget = prof.fill_budget_s  # seconds of filling left
        for size in prof.sizes:
            step: dict[str, Any] | None = None
            if size > finished:
                log(f"{system}: filling to {size:,} finished rollouts ({size - finished:,} more)")
                step = fill(system, srv, size - finished, ids, budget, int(prof.max_rss_gib * 2**30), log)
                budget -= float(step.get("seconds") or 0.0)  # the driver's filling, not its start-up
                finished += int(step.get("filled", 0))
                if not step.get("complete"):
                    log(f"{system}: {size:,} not reached: {step.get('error', '')[:200]}")
                    point = {"size": size, "reached": False, "finished": finished, "fill": step}
                    if step.get("budget_spent") and step.get("filled"):  # measured where the fill stopped
                        point["rss_mib"] = round(srv.rss.now() / 2**20, 1)
                        log(f"{system}: measuring at {finished:,} finished rollouts, where the fill stopped")
                        point["measure"] = measure(system, srv, ids, prof)
                    points.append(point)
                    break
            rss = round(srv.rss.now() / 2**20, 1)
            log(f"{system}: measuring at {finished:,} finished rollouts (server RSS {rss:,} MiB)")
            result = measure(system, srv, ids, prof)
            if "error" in result:
                log(f"{system}: measure failed: {result['error'][-300:]}")
            points.append(
                {
                    "size": size,
                    "reached": True,
                    "finished": finished,
                    "fill": step,
                    "rss_mib": rss,
                    "measure": result,
                }
            )
            finished += int(result.get("finished_added", 0))
        peak = round(srv.rss.peak / 2**20, 1)
    return {"points": points, "peak_rss_mib": peak}


# ------------------------------------------------------------------ figures


def value(point: dict[str, Any], key: str, stat: str) -> float | None:
    """A figure of a measured point: stat is p50_ms, p99_ms or rollouts_per_s."""
    if "rss_mib" not in point:
        return None
    if key == "rss":
        return float(point["rss_mib"])
    if key == "fill":
        step = point.get("fill")
        return float(step["rollouts_per_s"]) if step and step.get("rollouts_per_s") else None
    got = point.get("measure", {}).get(key, {}).get(stat)
    return float(got) if isinstance(got, int | float) else None


def flatness(systems: dict[str, Any]) -> list[dict[str, Any]]:
    """For each measure and system: how the median changed from the smallest to the largest size reached."""
    rows = []
    for key, label, _, higher in MEASURES:
        stat = "rollouts_per_s" if higher else "p50_ms"
        for system, res in systems.items():
            pts = [p for p in res.get("points", []) if value(p, key, stat) is not None]
            if len(pts) < 2:
                continue
            first, last = pts[0], pts[-1]
            a, b = value(first, key, stat), value(last, key, stat)
            assert a is not None and b is not None
            # the growth of the cost: a latency's rise, a throughput's fall
            growth = (a / b if b else math.inf) if higher else (b / a if a else math.inf)
            row = {
                "measure": key,
                "label": label,
                "system": system,
                "from_size": first["finished"] if not first.get("reached") else first["size"],
                "to_size": last["finished"] if not last.get("reached") else last["size"],
                "to_size_reached": bool(last.get("reached")),
                "from": a,
                "to": b,
                "cost_growth": round(growth, 2),
                "flat": growth <= FLAT_LIMIT,
            }
            if not higher:
                p99a, p99b = value(first, key, "p99_ms"), value(last, key, "p99_ms")
                row["p99_growth"] = round(p99b / p99a, 2) if p99a and p99b else None
            rows.append(row)
    return rows


def _num(v: float | None, digits: int = 2) -> str:
    if v is None:
        return "—"
    return f"{v:,.{digits}f}" if v < 100 else f"{v:,.0f}"


def markdown(report: dict[str, Any]) -> str:
    systems = report["systems"]
    names = [s for s in SYSTEMS if s in systems]
    prof = report["settings"]
    lines = [
        f"Measured {report['date']} on {report['machine']['cpu']} ({report['machine']['cores']} cores, "
        f"{report['machine']['memory_gib']} GiB), profile `{report['profile']}`. Each system is one server "
        f"process filled step by step with finished rollouts of {prof['spans_per_rollout']} spans each, then "
        "measured at each size: the rollout cycle (median rollouts/s of "
        f"{prof['cycle_reps']} repetitions of {prof['cycle_rollouts']} rollouts, {prof['cycle_workers']} "
        f"workers, {prof['cycle_spans']} spans each), one dequeue on a queue of 5-24 rollouts, one random "
        f"old rollout's spans, the first page ({prof['page']}) of ListRollouts filtered by status: "
        "`succeeded` matches every finished rollout, `queuing` the 20 rollouts queued for the measure "
        "(each side's default order; Agent Lightning: `query_rollouts(status_in=[...], limit=50)`). "
        "Latencies are p50 / p99 ms through each side's own client.",
        "",
        "| measure | size | " + " | ".join(LABELS[s] for s in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    sizes = sorted({p["size"] for s in names for p in systems[s].get("points", [])})
    rows: list[tuple[str, str, str]] = [(k, label, unit) for k, label, unit, _ in MEASURES]
    rows += [("fill", "fill rate up to this size", "rollouts/s"), ("rss", "server RSS after the fill", "MiB")]
    for key, label, unit in rows:
        for size in sizes:
            cells = []
            for s in names:
                pt = next((p for p in systems[s].get("points", []) if p["size"] == size), None)
                if pt is None:
                    cells.append("—")
                    continue
                at = "" if pt.get("reached") else f" at {pt['finished']:,}*"
                if "rss_mib" not in pt:
                    cells.append(f"not reached ({pt['finished']:,})")
                elif "error" in pt.get("measure", {}) and key not in ("fill", "rss"):
                    cells.append("error")
                elif unit == "ms":
                    cells.append(f"{_num(value(pt, key, 'p50_ms'))} / {_num(value(pt, key, 'p99_ms'))}{at}")
                else:
                    cells.append(_num(value(pt, key, "rollouts_per_s"), 1) + at)
            lines.append(f"| {label} ({unit}) | {size:,} | " + " | ".join(cells) + " |")
    unreached = [(s, p) for s in names for p in systems[s].get("points", []) if not p.get("reached")]
    for s, p in unreached:
        step = p.get("fill") or {}
        lines += [
            "",
            f"\\* {LABELS[s]}: {p['size']:,} finished rollouts not reached: {p['finished']:,} after "
            f"{step.get('seconds')} s of filling this step ({step.get('error', '')}); the fill budget is "
            f"{prof['fill_budget_s']:.0f} s per system, all sizes together."
            + (" Measured there instead." if "measure" in p else ""),
        ]
    for s in names:
        if "error" in systems[s]:
            lines += ["", f"{LABELS[s]}: {systems[s]['error']}"]
    lines += [
        "",
        "## Where it is not flat",
        "",
        f"Cost growth from the smallest to the largest size reached: a latency's p50 at the largest ÷ at the "
        f"smallest, a throughput's at the smallest ÷ at the largest. Above {FLAT_LIMIT:g}× is flagged.",
        "",
        "| measure | system | sizes | p50 (or rollouts/s) | growth | p99 growth | flat |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["flatness"]:
        p99 = "—" if row.get("p99_growth") is None else f"{row['p99_growth']:.2f}×"
        lines.append(
            f"| {row['label']} | {LABELS[row['system']]} | {row['from_size']:,} → {row['to_size']:,}"
            f"{'' if row['to_size_reached'] else '*'} "
            f"| {_num(row['from'])} → {_num(row['to'])} | {row['cost_growth']:.2f}× | {p99} "
            f"| {'yes' if row['flat'] else '**no**'} |"
        )
    flagged = [r for r in report["flatness"] if not r["flat"]]
    lines += [
        "",
        "Not flat: "
        + (
            "; ".join(f"{LABELS[r['system']]}, {r['label']} ({r['cost_growth']:.1f}×)" for r in flagged)
            if flagged
            else "nothing"
        )
        + ".",
        "",
        "![cost against store size](scaling.png)",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    systems = report["systems"]
    panels = [
        (k, f"{label} ({unit})", "rollouts_per_s" if higher else "p50_ms")
        for k, label, unit, higher in MEASURES
    ]
    panels.append(("rss", "server RSS after the fill (MiB)", ""))
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    colors = {
        "lightning_grpc_memory": "tab:blue",
        "lightning_grpc_sqlite": "tab:green",
        "agentlightning": "tab:red",
    }
    for ax, (key, title, stat) in zip(axes.flat, panels, strict=True):
        for system in SYSTEMS:
            pts = systems.get(system, {}).get("points", [])
            xs = [p["finished"] for p in pts if value(p, key, stat) is not None]
            ys = [value(p, key, stat) for p in pts if value(p, key, stat) is not None]
            if not xs:
                continue
            ax.plot(xs, ys, marker="o", color=colors[system], label=LABELS[system])
            if stat == "p50_ms":
                p99 = [value(p, key, "p99_ms") for p in pts if value(p, key, stat) is not None]
                ax.plot(xs, p99, marker=".", linestyle=":", color=colors[system], alpha=0.6)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("finished rollouts in the store")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(
        f"Cost against store size ({report['profile']}, {report['date']}); latencies: p50 solid, p99 dotted",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="sizes 1k and 10k, fewer samples")
    mode.add_argument("--smoke", action="store_true", help="seconds: sizes 50 and 150, ours only")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), help="e.g. 1000,10000")
    parser.add_argument("--systems", type=lambda s: tuple(s.split(",")), help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--fill-budget", type=float, help="seconds of filling per system, all sizes together")
    parser.add_argument("--max-rss-gib", type=float)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    prof = PROFILES[profile]
    if args.systems is None:
        args.systems = SYSTEMS[:2] if args.smoke else SYSTEMS
    if args.sizes:
        prof = replace(prof, sizes=args.sizes)
    if args.fill_budget:
        prof = replace(prof, fill_budget_s=args.fill_budget)
    if args.max_rss_gib:
        prof = replace(prof, max_rss_gib=args.max_rss_gib)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    if "agentlightning" in args.systems:
        log("setting up Agent Lightning 0.3.0 in bench/.venv-agl")
        if subprocess.run([PY, str(BENCH / "agl_setup.py")], cwd=ROOT).returncode != 0:
            log("bench/agl_setup.py failed: Agent Lightning's side is left out")
    workdir = Path(tempfile.mkdtemp(prefix="lightning-scaling-"))
    systems: dict[str, Any] = {}
    try:
        for system in args.systems:
            systems[system] = run_system(system, prof, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile,
        "machine": machine(),
        "versions": versions(),
        "settings": asdict(prof),
        "systems": systems,
        "seconds": round(time.monotonic() - started, 1),
    }
    report["flatness"] = flatness(systems)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "scaling.md").write_text(markdown(report))
    plot(report, args.out / "scaling.png")
    log(f"wrote {args.out / 'scaling.json'}, scaling.md and scaling.png")
    print((args.out / "scaling.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
