"""The multi-node recipe on one machine: a PostgreSQL store with a standby, and a two-node Ray cluster on
loopback whose runners keep going while the store's writer is killed.

    .venv/bin/python examples/multi_node/two_nodes_on_loopback.py [--postgres URL] [--rollouts 60]

1. PostgreSQL: a throwaway server (tests/store/postgres_server.py: ``initdb``, then ``pg_ctl`` on a free
   loopback port; removed at the end), or the database given with ``--postgres`` (one of this run's own).
2. The store: a writer and a standby, both ``lightning-grpc serve --postgres URL``, on two ports. The standby
   waits for the writer lease without listening.
3. Ray: two nodes, each a ``ray start --block --num-cpus 1`` with ports of its own and this run's own
   ``--temp-dir``, the second joining the head at 127.0.0.1 (Ray names both by the machine's own IP address:
   it never registers a node as 127.0.0.1), with token authentication on this run's own token. They are
   stopped with SIGTERM to those two commands: no other Ray session of the machine is touched (``ray stop``
   would stop them all).
4. A runner fleet of 4 Ray actors (:class:`~lightning_grpc.runner.RayFleet` with ``scheduling_strategy=
   "SPREAD"``: two on each node), given both store addresses.
5. Two thirds of the rollouts are enqueued; once a third of all has succeeded, the writer is killed with
   SIGKILL, the standby takes over, the last third is enqueued, and every rollout must succeed.
6. The report: which node ran how many rollouts (the worker id the store recorded on each rollout's
   attempt, matched to the node its actor runs on), the seconds without a writer, the totals.

Exit status: 0 when every rollout succeeded, once, on the two nodes; 1 when a step failed; 2 when Ray,
psycopg or PostgreSQL is missing (one line saying which). ``--json PATH`` writes the report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file from a source checkout: its lightning_grpc and tests/
    sys.path.insert(0, str(ROOT))

from lightning_grpc import semconv  # noqa: E402
from lightning_grpc.client import SyncStoreClient  # noqa: E402
from lightning_grpc.errors import LightningError  # noqa: E402
from lightning_grpc.processes import CLI, Background, child_env, start_ray  # noqa: E402
from lightning_grpc.runner import RayFleet, RunnerSpec, rollout  # noqa: E402
from lightning_grpc.types import Rollout, RolloutStatus  # noqa: E402

#: The agent the runners run, as they import it.
AGENT = "examples.multi_node.two_nodes_on_loopback:agent"
ACTORS = 4  # 0.5 CPU each: two on each 1-CPU node
CONCURRENCY = 2  # rollouts at once in each actor
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # each node's; Ray's default is 30% of the machine's memory


@rollout
async def agent(task: Any) -> float:
    """Stands for a real agent: works ``task["seconds"]`` and returns a reward."""
    await asyncio.sleep(float(task["seconds"]))
    return 1.0


class Failed(Exception):
    """A step of the run failed: the message is the one line printed."""


@dataclass
class NodeReport:
    node_id: str
    ip: str
    head: bool
    runners: list[str] = field(default_factory=list)
    rollouts: int = 0


@dataclass
class Report:
    nodes: list[NodeReport]
    rollouts: int
    succeeded: int
    attempts: int
    #: Rollouts whose final attempt has exactly one reward span.
    rewarded: int
    #: Rollouts that had succeeded when the writer was killed, and were found the same afterwards.
    succeeded_before_kill: int
    running_at_kill: int
    kept_across_take_over: int
    #: Seconds from the kill until the standby served, and until a write through it was acknowledged.
    without_writer_s: float
    first_write_s: float
    seconds: float
    #: This run's directory (Ray's --temp-dir is under it); removed at the end.
    temp_dir: str


#: How many times a Ray node is started before the run gives up (see :meth:`Run.ray_node`).
NODE_STARTS = 3
#: The ports a Ray node listens on, given to each node of its own (the two nodes share one IP address).
NODE_PORT_OPTIONS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


def kill_group(process: Background) -> None:
    """SIGKILL a child and whatever it started in its process group (a Ray node's raylet and agents)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.proc.pid, signal.SIGKILL)
    process.stop(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing(postgres: str | None) -> str:
    """What this script needs and does not find here ('' when nothing); ``postgres``: the --postgres URL."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed (pip install 'lightning-grpc[ray]')"
    if ray_command() is None:
        return "the `ray` command is not found next to this Python or on PATH"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'lightning-grpc[postgres]')"
    if postgres:
        return ""
    try:
        from tests.store import postgres_server
    except ImportError:
        return (
            "no --postgres URL given, and tests/store/postgres_server.py (which starts a throwaway server) is"
            " not here: run from a source checkout, or pass --postgres"
        )
    reason = postgres_server.why_unavailable()
    return f"cannot start a throwaway PostgreSQL: {reason}; or pass --postgres URL" if reason else ""


def ray_command() -> str | None:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else shutil.which("ray")


def throwaway_postgres() -> Any:
    """A PostgreSQL server of this run (tests/store/postgres_server.py), started."""
    from tests.store import postgres_server

    server = None
    try:
        server = postgres_server.PostgresServer()  # initdb
        server.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        if server is not None:
            server.destroy()
        raise Failed(f"the throwaway PostgreSQL did not start: {exc}") from None
    return server


def started(process: Background, marker: str, timeout: float) -> None:
    """Wait for ``marker`` in a child's output; a :class:`Failed` with its output's tail when it does not come."""
    try:
        process.wait_for(marker, timeout=timeout)
    except RuntimeError as exc:
        raise Failed(f"{exc}\n{process.tail()}") from None


class Run:
    """Every process of the run, stopped in reverse order by :meth:`close`."""

    def __init__(self, out: Any = sys.stdout) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.stack = contextlib.ExitStack()
        self.tmp = Path(tempfile.mkdtemp(prefix="lgmn-"))  # short: Ray's socket paths live under it
        self.stack.callback(shutil.rmtree, self.tmp, True)
        self.env = {
            **child_env(),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        }

    def say(self, text: str) -> None:
        print(f"{time.monotonic() - self.t0:6.1f} s  {text}", file=self.out, flush=True)

    def close(self) -> None:
        self.stack.close()

    def background(
        self, name: str, args: list[str], *, python: bool = True, env: dict[str, str] | None = None
    ) -> Background:
        process = Background(name, args, env or self.env, cwd=ROOT, python=python)
        self.stack.callback(process.stop, 30)
        return process

    # ------------------------------------------------------------------ the pieces
    def postgres(self, url: str | None) -> str:
        if url:
            self.say("PostgreSQL: the database given with --postgres")
            return url
        server = throwaway_postgres()
        self.stack.callback(server.destroy)
        url = str(server.create_database("multi_node"))
        self.say(f"PostgreSQL: a throwaway server on 127.0.0.1:{server.port}, database multi_node")
        return url

    def store(self, url: str) -> tuple[Background, Background, list[int]]:
        ports = [free_port(), free_port()]

        def serve(name: str, port: int) -> Background:
            args = [*CLI, "serve", "--host", "127.0.0.1", "--port", str(port), "--postgres", url]
            return self.background(name, [*args, "--no-dashboard", "--grace", "2"])

        writer = serve("writer", ports[0])
        started(writer, "event=server_started", 60)
        standby = serve("standby", ports[1])
        started(standby, "event=postgres_standby", 60)
        self.say(
            f"store: writer on 127.0.0.1:{ports[0]}, standby on 127.0.0.1:{ports[1]} (waiting for the writer lease)"
        )
        return writer, standby, ports

    def ray_cluster(self) -> tuple[Any, str]:
        """Two Ray nodes on 127.0.0.1 and this process connected as the driver; returns (ray, head address).

        The cluster takes only callers that hold its token (Ray's token authentication): every node and the
        driver get this run's own, in ``RAY_AUTH_TOKEN``; a token of the user's (~/.ray/auth_token) is not
        used, nor is one written there."""
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        os.environ.update(auth)  # before Ray is imported: it reads them once
        import ray

        command = ray_command()
        assert command is not None
        head_port = free_port()
        env = {
            **self.env,
            **auth,
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # stop at once on SIGTERM
            "RAY_gcs_server_port_wait_time_s": "120",  # a loaded two-core machine starts slowly
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        ours: set[int] = set()  # each node's --node-manager-port, to tell its entry in ray.nodes()
        for head in (True, False):
            ours.add(self.ray_node(command, head, head_port, env))
        address = f"127.0.0.1:{head_port}"
        start_ray(
            ray,
            address=address,
            runtime_env={"env_vars": {"PYTHONPATH": self.env["PYTHONPATH"]}},
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        self.stack.callback(ray.shutdown)
        deadline = time.monotonic() + 90
        # exactly our two: a node of a start given up (below) that reached the GCS is alive there until its
        # health checks fail, and a runner spread onto it would be lost with it
        while (alive := {n["NodeManagerPort"] for n in ray.nodes() if n["Alive"]}) != ours:
            if time.monotonic() > deadline:
                raise Failed(
                    f"the Ray cluster at {address} has nodes {sorted(alive)} alive, not {sorted(ours)}"
                )
            time.sleep(0.2)
        return ray, address

    def ray_node(self, command: str, head: bool, head_port: int, env: dict[str, str]) -> int:
        """Start one Ray node (``ray start --block``); returns its node manager's port.

        ``ray start`` gives a node 30 seconds to register with the cluster (Ray's own constant), and a loaded
        two-core machine has taken longer: that start is given up, its processes killed, and the node started
        again on fresh ports, three times at most."""
        attempt = 0
        while True:
            attempt += 1
            ports = {option: free_port() for option in NODE_PORT_OPTIONS}
            args = [command, "start", "--block", "--log-style", "record"]
            args += ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", str(OBJECT_STORE_BYTES)]
            args += ["--temp-dir", str(self.tmp / "ray"), "--disable-usage-stats"]
            for option, port in ports.items():  # each node its own ports (the two nodes share one IP address)
                args += [option, str(port)]
            if head:
                args += ["--head", "--port", str(head_port), "--include-dashboard", "false"]
                args += ["--ray-client-server-port", str(free_port())]
            else:
                args += ["--address", f"127.0.0.1:{head_port}"]
            name = "ray head" if head else "ray node"
            node = self.background(name, args, python=False, env=env)
            try:
                started(node, "Ray runtime started", 180)
                return ports["--node-manager-port"]
            except Failed as failure:
                kill_group(node)
                if attempt == NODE_STARTS or "timed out during startup" not in str(failure):
                    raise
                self.say(f"{name}: did not register within Ray's 30 s (start {attempt}); starting it again")

    def fleet(self, address: str, store: str) -> RayFleet:
        spec = RunnerSpec(agent=AGENT, store=store, concurrency=CONCURRENCY, options={"poll_wait": 0.5})
        fleet = RayFleet(spec, ACTORS, address=address, scheduling_strategy="SPREAD")
        self.stack.callback(fleet.shutdown)
        return fleet


def node_reports(ray: Any, fleet: RayFleet) -> tuple[list[NodeReport], dict[str, NodeReport]]:
    """The cluster's nodes, and each runner's worker id -> its node."""
    nodes = {
        n["NodeID"]: NodeReport(
            n["NodeID"], n["NodeManagerAddress"], "node:__internal_head__" in n["Resources"]
        )
        for n in ray.nodes()
        if n["Alive"]
    }
    by_worker: dict[str, NodeReport] = {}
    for where in fleet.placements(timeout=120):
        node = nodes[where.node_id]
        node.runners.append(where.worker_id)
        by_worker[where.worker_id] = node
    ordered = sorted(nodes.values(), key=lambda n: (not n.head, n.node_id))
    return ordered, by_worker


def statuses(client: SyncStoreClient, ids: list[str]) -> tuple[dict[str, str], int]:
    """Rollout id -> the attempt that succeeded, for those of ``ids`` that have; and how many a runner has."""
    found = client.query_rollouts(rollout_ids=ids)
    done = {
        r.rollout_id: r.latest_attempt.attempt_id
        for r in found
        if r.status == RolloutStatus.SUCCEEDED and r.latest_attempt is not None
    }
    return done, sum(1 for r in found if r.status in (RolloutStatus.PREPARING, RolloutStatus.RUNNING))


def reward_spans(client: SyncStoreClient, done: Rollout) -> int:
    assert done.latest_attempt is not None
    spans = client.query_spans(done.rollout_id, attempt_id=done.latest_attempt.attempt_id)
    return sum(1 for s in spans if s.name == semconv.SPAN_REWARD)


def run(postgres: str | None, rollouts: int, seconds: float, out: Any = sys.stdout) -> Report:
    """The whole run (see the module's docstring); everything it started is stopped when it returns."""
    steps = Run(out)
    try:
        url = steps.postgres(postgres)
        writer, standby, ports = steps.store(url)
        store = ",".join(f"127.0.0.1:{p}" for p in ports)
        ray, address = steps.ray_cluster()
        fleet = steps.fleet(address, store)
        nodes, by_worker = node_reports(ray, fleet)
        steps.say(
            f"Ray: {len(nodes)} nodes on this machine ({', '.join(sorted({n.ip for n in nodes}))}), 1 CPU each; "
            f"{ACTORS} runner actors spread {' + '.join(str(len(n.runners)) for n in nodes)} over them"
        )
        steps.say(f"the runners' store: {store} (whichever answers)")
        with SyncStoreClient(store) as client:
            first = rollouts * 2 // 3
            tasks = [{"input": {"i": i, "seconds": seconds}} for i in range(rollouts)]
            ids = [r.rollout_id for r in client.enqueue_rollouts(tasks[:first])]
            steps.say(f"enqueued {first} rollouts")
            deadline = time.monotonic() + 120
            while len((before := statuses(client, ids))[0]) < rollouts // 3:
                if time.monotonic() > deadline:
                    raise Failed(
                        f"only {len(before[0])} rollouts succeeded in 120 s: the runners are not running"
                    )
                time.sleep(0.05)
            killed_at = time.monotonic()
            writer.proc.kill()
            steps.say(
                f"{len(before[0])} succeeded, {before[1]} being run: kill -9 the writer (pid {writer.proc.pid})"
            )
            started(standby, "event=server_started", 60)
            without_writer = round(time.monotonic() - killed_at, 3)
            ids += [r.rollout_id for r in client.enqueue_rollouts(tasks[first:])]
            first_write = round(time.monotonic() - killed_at, 3)
            steps.say(
                f"the standby took the lease and serves {without_writer:.2f} s after the kill; "
                f"{rollouts - first} more enqueued through it {first_write:.2f} s after"
            )
            done = client.wait_for_rollouts(ids, timeout=180)
            if len(done) < len(ids):
                raise Failed(f"{len(ids) - len(done)} of {len(ids)} rollouts did not finish in 180 s")
            ok = [r for r in done if r.status == RolloutStatus.SUCCEEDED]
            steps.say(f"{len(ok)} of {len(ids)} rollouts succeeded")
            after = statuses(client, ids)[0]
            kept = sum(1 for rid, attempt in before[0].items() if after.get(rid) == attempt)
            for r in ok:
                assert r.latest_attempt is not None
                node = by_worker.get(r.latest_attempt.worker_id)
                if node is not None:
                    node.rollouts += 1
            rewarded = sum(1 for r in ok if reward_spans(client, r) == 1)
        fleet.stop()
        fleet.wait(60)
        report = Report(
            nodes=nodes,
            rollouts=len(ids),
            succeeded=len(ok),
            attempts=sum(r.attempt_count for r in done),
            rewarded=rewarded,
            succeeded_before_kill=len(before[0]),
            running_at_kill=before[1],
            kept_across_take_over=kept,
            without_writer_s=without_writer,
            first_write_s=first_write,
            seconds=0.0,
            temp_dir=str(steps.tmp),
        )
    finally:
        steps.close()
    report.seconds = round(time.monotonic() - steps.t0, 1)  # stopping everything included
    steps.say(f"stopped: the fleet, both Ray nodes, the store servers{'' if postgres else ', PostgreSQL'}")
    return report


def print_report(report: Report, out: Any = sys.stdout) -> None:
    retried = report.attempts - report.rollouts
    lines = [
        f"rollouts {report.rollouts}: {report.succeeded} succeeded, {report.attempts} attempts "
        f"({'none' if retried == 0 else retried} tried again), {report.rewarded} with their one reward span",
        "by Ray node (the worker id the store recorded on each rollout's attempt, and where that runner runs):",
        *(
            f"  {n.node_id[:12]} {'(head)' if n.head else '(second)':<8}  {n.rollouts:3d} rollouts"
            f"  runners {', '.join(n.runners)}"
            for n in report.nodes
        ),
        f"take-over: {report.without_writer_s:.2f} s without a writer, a write acknowledged "
        f"{report.first_write_s:.2f} s after the kill;",
        f"  {report.running_at_kill} rollouts were being run at the kill; the {report.succeeded_before_kill} that "
        f"had succeeded before it: {report.kept_across_take_over} found unchanged",
    ]
    print("\n".join(lines), file=out)


def sound(report: Report) -> str:
    """What is wrong with the report ('' when every rollout succeeded once, on both nodes, nothing lost)."""
    if report.succeeded != report.rollouts:
        return f"{report.rollouts - report.succeeded} of {report.rollouts} rollouts did not succeed"
    if report.rewarded != report.rollouts:
        return f"{report.rollouts - report.rewarded} rollouts lack their one reward span"
    if report.kept_across_take_over != report.succeeded_before_kill:
        return "a rollout that had succeeded before the kill was changed or lost by the take-over"
    idle = [n.node_id[:12] for n in report.nodes if n.rollouts == 0]
    if len(report.nodes) != 2 or idle:
        return f"not both Ray nodes ran rollouts (nodes {len(report.nodes)}, idle {idle})"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", help="a database of this run's own (default: a throwaway server)")
    parser.add_argument("--rollouts", type=int, default=60, help="rollouts in all")
    parser.add_argument("--seconds", type=float, default=0.5, help="each rollout's work, seconds")
    parser.add_argument("--json", type=Path, help="also write the report here, as JSON")
    args = parser.parse_args(argv)
    if args.rollouts < 3:
        parser.error("--rollouts must be at least 3")
    problem = missing(args.postgres)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda _s, _f: sys.exit(143))  # stop what was started, as on Ctrl-C
    try:
        report = run(args.postgres, args.rollouts, args.seconds)
    except (Failed, LightningError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    problem = sound(report)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
