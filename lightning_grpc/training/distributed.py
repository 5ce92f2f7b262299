"""The learner as N torch.distributed ranks, each a Ray actor in a Ray placement group (``[learner] ranks``).

Each rank is a :class:`RankLearner`: the one-process :class:`~.learner.Learner` (the same update, loss and
mini-batches) with its model sharded by FSDP2 (``fully_shard`` on each decoder layer, then on the model),
its sums and metrics taken over the ranks, and its weights and checkpoints written as shards. The driver,
:class:`DistributedLearner`, is what the training loop talks to: the methods and attributes it uses of a
``Learner`` (``update``, ``export_weights``, ``save_checkpoint``, ``resume``, ``step``, ``model.config``).

- **Placement.** One bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` with NCCL) in a placement group
  (``PACK``); rank 0's node address is ``MASTER_ADDR`` and a port free there ``MASTER_PORT``, so the same
  code spans nodes of a Ray cluster (``[learner] ray_address``). Backend: ``gloo`` on CPU, ``nccl`` when
  the cluster has a GPU per rank (or as ``[learner] dist_backend`` says). With no address, a local Ray is
  started with the ranks' CPUs and stopped by :meth:`DistributedLearner.close`.
- **The batch.** Every rank gets the whole batch (one object in Ray's store) and the rows it trains on:
  whole GRPO groups, balanced by tokens (:func:`split_groups_by_tokens`). Advantages and reward metrics
  are computed over the whole batch on every rank, mini-batches are the whole batch's (as with one
  process), and each rank runs every mini-batch, a stand-in row weighing nothing where it has none.
- **The loss.** Each rank's loss is its rows' share of the whole mini-batch's loss times the number of
  ranks (verl's ``dp_size`` with the global ``batch_num_tokens`` / ``global_batch_size`` /
  ``rollout_num_tokens``, summed over the ranks: ``Learner._batch_info``); FSDP averages the gradients
  over the ranks, so the gradient is exactly the whole mini-batch's, as one process computes it, for
  every ``loss_agg_mode``. The gradient is clipped by its global norm (``clip_grad_norm_`` on DTensors).
- **Weights.** Once per step the full weights are gathered (``get_model_state_dict`` with
  ``full_state_dict`` and ``cpu_offload``) and rank 0 writes the same ``save_pretrained`` directory as
  ``Learner.export_weights``. The directory must be one rank 0 can write and the engine can read (one
  node, or a shared file system).
- **Checkpoints.** The full weights and tokenizer (an engine starts from a checkpoint), the model's and
  optimiser's (and reference's) shards by ``torch.distributed.checkpoint`` in ``sharded/``, and per rank
  the step, random states and the loop's ``extra`` (``rank-N.pt``); every rank writes its own shards, so
  across nodes the directory must be on a shared file system. A checkpoint resumes on any number of ranks
  (the shards are re-cut), on the one-process learner (``Learner.resume`` reads it whole), and a
  one-process checkpoint resumes on ranks (its optimiser state cut into shards).
- **Failures.** The driver waits on the ranks together and raises the first rank's error at once;
  :meth:`DistributedLearner.close` (the end of the run, or at exit) ends the actors, the placement group
  and the Ray it started. A rank whose process dies (killed, out of memory, its node lost) is
  :class:`RankLost`, naming it, as soon as the driver next waits on the ranks: the others, left in a
  collective without it, are killed, not waited for. A rank is not restarted alone: its shards of the
  optimiser state since the last checkpoint died with it, so only the last checkpoint can go on.
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_grpc._extras import extra_imports
from lightning_grpc.processes import start_ray

with extra_imports("train"):
    import numpy as np
    import torch

from . import ppo
from .learner import (
    STATE_FILE,
    Learner,
    OptimConfig,
    UpdateInput,
    write_files,
)
from .sharded import (
    RANK_STATE,
    SHARDED_DIR,
    load_sharded_checkpoint,
    random_states,
    restore_random_states,
    sharded_state,
)

#: How long, after a rank fails, the driver looks for a rank that died: a rank whose peer was killed fails in
#: the collective they were in (gloo: the connection closed), often before Ray reports the death itself.
DEAD_PEER_WAIT_S = 10.0


class RankLost(RuntimeError):
    """A rank of the learner died (its process killed, out of memory, or its node lost): the run cannot go on
    without it, and the same command resumes from the last checkpoint."""

    def __init__(self, rank: int, world: int, where: str) -> None:
        self.rank = rank
        super().__init__(
            f"learner rank {rank} of {world}{where} died (killed, out of memory, or its node lost)"
        )


def split_groups_by_tokens(uid: np.ndarray, row_tokens: np.ndarray, ranks: int) -> list[np.ndarray]:
    """The rows of each rank: whole groups (never split), the ranks' token totals as even as can be.

    Greedy, largest group first, each to the rank with the fewest tokens so far (then the fewest rows,
    then the lowest rank); ties between groups keep the batch's order, so the split is deterministic.
    ``row_tokens`` is what a row costs the forward pass (its prompt and response tokens). Rows come back
    in the batch's order; a rank may get none when there are fewer groups than ranks.
    """
    members: dict[Any, list[int]] = {}
    for row, group in enumerate(np.asarray(uid, dtype=object).tolist()):
        members.setdefault(group, []).append(row)
    tokens = np.asarray(row_tokens, dtype=np.int64)
    sized = [(int(tokens[rows].sum()), position, rows) for position, rows in enumerate(members.values())]
    sized.sort(key=lambda item: (-item[0], item[1]))
    loads = [0] * ranks
    counts = [0] * ranks
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    for size, _, rows in sized:
        rank = min(range(ranks), key=lambda r: (loads[r], counts[r], r))
        loads[rank] += size
        counts[rank] += len(rows)
        assigned[rank].extend(rows)
    return [np.sort(np.asarray(rows, dtype=np.int64)) for rows in assigned]


# ------------------------------------------------------------ one rank
@dataclass
class RankLearner(Learner):
    """One rank of the learner: the one-process update on its rows, the model sharded by FSDP2."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        #: Rank 0's unsharded copy that the gathered weights are written from (``save_pretrained``).
        self._export_model: Any = None
        if self.rank == 0:
            from transformers import AutoModelForCausalLM

            self._export_model = AutoModelForCausalLM.from_pretrained(
                str(self.model_path), dtype=torch.float32
            )

    def _place(self, model: Any) -> Any:
        from torch.distributed.fsdp import fully_shard

        model.to(self.device)
        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module)
        fully_shard(model)
        return model

    @property
    def world_size(self) -> int:
        return self.world

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = values.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def _gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    # ------------------------------------------------------------ weights and checkpoints
    def export_weights(self, path: str | Path) -> Path:
        """Gather the full weights (every rank takes part); rank 0 writes the ``save_pretrained`` directory."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        path = Path(path)
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            self._export_model.load_state_dict(full)
            self._export_model.save_pretrained(path, safe_serialization=True)
        del full
        self._barrier()
        return path

    def save_checkpoint(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """The full weights and tokenizer (rank 0), every rank's shards of the model, optimiser (and
        reference), and each rank's step, random states and ``extra``."""
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        self._barrier()
        self.export_weights(path)
        if self.rank == 0:
            write_files(self.tokenizer_files, path)
            self._write_config(path)
        dcp_save(sharded_state(self), checkpoint_id=str(path / SHARDED_DIR))
        torch.save(
            {"step": self.step, "rng": random_states(), "extra": dict(extra or {}), "ranks": self.world},
            path / RANK_STATE.format(rank=self.rank),
        )
        self._barrier()
        return path

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore this rank from a checkpoint, of ranks (any number: the shards are re-cut) or of the
        one-process learner; returns the loop's ``extra``."""
        path = Path(path)
        if (path / SHARDED_DIR).is_dir():
            return load_sharded_checkpoint(self, path, self.rank)
        if (path / STATE_FILE).exists():
            return self._load_one_process_checkpoint(path)
        raise FileNotFoundError(f"{path} is not a checkpoint (neither {SHARDED_DIR}/ nor {STATE_FILE} in it)")

    def _load_one_process_checkpoint(self, path: Path) -> dict[str, Any]:
        """The one-process learner's optimiser (and reference) state, whole, cut into this rank's shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        # that optimiser numbered the parameters in model.parameters() order; sharding keeps names and order
        names = [name for name, _ in self.model.named_parameters()]
        saved = state["optimizer"]
        by_name: dict[str, Any] = {
            "state": {names[index]: value for index, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[index] for index in group["params"]]}
                for group in saved["param_groups"]
            ],
        }
        whole = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=whole)
        if self.reference is not None and state["reference"] is not None:
            set_model_state_dict(self.reference, state["reference"], options=whole)
        self.step = int(state["step"])
        restore_random_states(state["rng"])
        return dict(state["extra"])

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


@dataclass(frozen=True)
class RankSpec:
    """What a rank is built from (sent to its actor)."""

    model_path: str
    ppo_config: ppo.PPOConfig
    optim: OptimConfig
    seed: int
    world: int
    backend: str
    threads: int
    resume: str | None = None


class RankActor:
    """The body of each rank's Ray actor (methods run one at a time, as the ranks' collectives need)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.learner: RankLearner | None = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it: rank 0's are every rank's ``MASTER_ADDR:PORT``."""
        address = ray_node_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
            port = int(sock.getsockname()[1])
        return address, port

    def setup(self, spec: RankSpec, master: tuple[str, int]) -> dict[str, Any]:
        """Join the process group and build this rank's learner (restored from ``spec.resume`` if set)."""
        import torch.distributed as dist
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no bar per weight export in the run's output
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master[0], str(master[1])
        torch.set_num_threads(max(1, spec.threads))
        device = "cpu"
        if spec.backend == "nccl":
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
            device = "cuda"
        dist.init_process_group(spec.backend, rank=self.rank, world_size=spec.world)
        self.learner = RankLearner(
            model_path=spec.model_path,
            ppo_config=spec.ppo_config,
            optim=spec.optim,
            device=device,
            seed=spec.seed,
            rank=self.rank,
            world=spec.world,
        )
        extra = self.learner.load_checkpoint(spec.resume) if spec.resume else {}
        # where the rank runs: what names it if it dies
        where = {"pid": os.getpid(), "node": ray_node_address()}
        return {"step": self.learner.step, "extra": extra, **where}

    def update(self, batch: UpdateInput, rows: np.ndarray) -> dict[str, float]:
        assert self.learner is not None
        return self.learner.update(batch, rows)

    def export_weights(self, path: str) -> str:
        assert self.learner is not None
        return str(self.learner.export_weights(path))

    def save_checkpoint(self, path: str, extra: Mapping[str, Any]) -> str:
        assert self.learner is not None
        return str(self.learner.save_checkpoint(path, extra))

    def step(self) -> int:
        assert self.learner is not None
        return self.learner.step

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def ray_node_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


# ------------------------------------------------------------ the driver
@dataclass(frozen=True)
class ModelView:
    """What the loop reads of the model in the driver: its config (the weights live in the ranks)."""

    config: Any


@dataclass
class DistributedLearner:
    """The loop's learner when ``[learner] ranks > 1``: N FSDP ranks as Ray actors, one update at a time."""

    model_path: str | Path
    ppo_config: ppo.PPOConfig = field(default_factory=ppo.PPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    ranks: int = 2
    #: "gloo" | "nccl" | "": nccl when the cluster has a GPU per rank, else gloo.
    dist_backend: str = ""
    #: A Ray cluster to place the ranks on ("": a local Ray started here, stopped by :meth:`close`).
    ray_address: str = ""
    #: torch threads per rank.
    threads: int = 1
    #: A checkpoint every rank restores (see :meth:`resume`).
    resume_from: str | Path | None = None
    step: int = 0

    def __post_init__(self) -> None:
        from transformers import AutoConfig

        if self.ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {self.ranks}")
        self.model = ModelView(AutoConfig.from_pretrained(str(self.model_path)))
        self.extra: dict[str, Any] = {}
        self._ray: Any = None
        self._actors: list[Any] = []
        self._group: Any = None
        self._owns_ray = False
        #: Where each rank runs ("pid N on ADDRESS"), once it has set up.
        self._where: list[str] = []
        #: Whether a call to the ranks failed: the others may be stuck in a collective (not waited for).
        self._failed = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            root = str(Path.cwd())
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
            options: dict[str, Any] = {
                "runtime_env": {"env_vars": {"PYTHONPATH": path}},
                "include_dashboard": False,
                "log_to_driver": True,
            }
            if self.ray_address:
                start_ray(ray, address=self.ray_address, **options)
            else:  # one node: loopback only, as many CPUs as ranks (at least 2), a small object store
                start_ray(
                    ray,
                    num_cpus=max(2, self.ranks),
                    object_store_memory=256 * 1024**2,
                    _node_ip_address="127.0.0.1",
                    **options,
                )
        backend = self.dist_backend or (
            "nccl" if ray.cluster_resources().get("GPU", 0) >= self.ranks else "gloo"
        )
        gpus = 1 if backend == "nccl" else 0
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
        self._group = placement_group([bundle] * self.ranks, strategy="PACK")
        ray.get(self._group.ready(), timeout=600)
        actor_class: Any = ray.remote(RankActor)
        self._actors = [
            actor_class.options(
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=rank
                ),
            ).remote(rank)
            for rank in range(self.ranks)
        ]
        master = ray.get(self._actors[0].rendezvous.remote())
        spec = RankSpec(
            model_path=str(self.model_path),
            ppo_config=self.ppo_config,
            optim=self.optim,
            seed=self.seed,
            world=self.ranks,
            backend=backend,
            threads=self.threads,
            resume=None if self.resume_from is None else str(Path(self.resume_from).resolve()),
        )
        started = self._all([actor.setup.remote(spec, master) for actor in self._actors])
        self._where = [f" (pid {s['pid']} on {s['node']})" for s in started]
        steps = {int(s["step"]) for s in started}
        if len(steps) != 1:
            raise RuntimeError(f"the ranks restored different steps: {sorted(steps)}")
        self.step = steps.pop()
        self.extra = dict(started[0]["extra"])
        self.backend = backend

    # ------------------------------------------------------------ what the loop calls
    def update(self, batch: UpdateInput) -> dict[str, float]:
        """One update of the whole batch, each rank on its groups; the metrics are the whole batch's,
        with each rank's update time and tokens (``update_rank{N}_seconds``, ``rank{N}_tokens``)."""
        started = time.perf_counter()
        arrays = {name: np.asarray(value) for name, value in batch.arrays.items()}
        whole = UpdateInput(arrays, np.asarray(batch.uid, dtype=object), batch.rewards_solved_at)
        row_tokens = np.asarray(arrays["attention_mask"]).sum(axis=1)
        split = split_groups_by_tokens(whole.uid, row_tokens, self.ranks)
        shared = self._ray.put(whole)
        results = self._all(
            [actor.update.remote(shared, rows) for actor, rows in zip(self._actors, split, strict=True)]
        )
        metrics = dict(results[0])
        for rank, (result, rows) in enumerate(zip(results, split, strict=True)):
            metrics[f"update_rank{rank}_seconds"] = float(result["update_seconds"])
            metrics[f"rank{rank}_tokens"] = float(row_tokens[rows].sum())
        self.step += 1
        metrics["update_seconds"] = time.perf_counter() - started
        return metrics

    def export_weights(self, path: str | Path) -> Path:
        """The current weights as a ``save_pretrained`` directory (gathered from the shards, rank 0 writes)."""
        self._all([actor.export_weights.remote(str(path)) for actor in self._actors])
        return Path(path)

    def save_checkpoint(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """A sharded checkpoint of every rank (see the module's notes), enough to resume the same run."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._all([actor.save_checkpoint.remote(str(path), dict(extra or {})) for actor in self._actors])
        return path

    @classmethod
    def resume(cls, path: str | Path, **options: Any) -> tuple[DistributedLearner, dict[str, Any]]:
        """Ranks continuing from a checkpoint of :meth:`save_checkpoint`, and its ``extra`` values."""
        learner = cls(model_path=path, resume_from=path, **options)
        return learner, dict(learner.extra)

    def rank_steps(self) -> list[int]:
        """Each rank's step (they move together)."""
        return [int(s) for s in self._all([actor.step.remote() for actor in self._actors])]

    def _all(self, calls: list[Any]) -> list[Any]:
        """The ranks' answers (``calls``: one per rank, in rank order); the first rank that fails raises at
        once, :class:`RankLost` for one that died (the others may be waiting in a collective for it:
        :meth:`close` ends them)."""
        pending = list(calls)
        while pending:
            done, pending = self._ray.wait(pending, num_returns=1)
            try:
                self._ray.get(done)
            except Exception as error:
                self._failed = True
                raise self._failure(calls, done[0], error, pending) from None
        return list(self._ray.get(calls))

    def _failure(self, calls: list[Any], failed: Any, error: Exception, pending: list[Any]) -> Exception:
        """What to raise for a failed call: :class:`RankLost` naming the rank that died, if one did (looked
        for among the calls still pending for :data:`DEAD_PEER_WAIT_S`), else the rank's own error."""
        died = self._ray.exceptions.RayActorError
        deadline = time.monotonic() + DEAD_PEER_WAIT_S
        while pending and not isinstance(error, died):
            left = deadline - time.monotonic()
            done, pending = self._ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not done:
                break
            try:
                self._ray.get(done)
            except died as dead:
                failed, error = done[0], dead
            except Exception:  # another rank's own failure: the first one stays the error
                pass
        if not isinstance(error, died):
            return error
        rank = next(index for index, call in enumerate(calls) if call == failed)
        where = self._where[rank] if rank < len(self._where) else ""
        return RankLost(rank, self.ranks, where)

    def close(self) -> None:
        """Leave the process group, end the actors and the placement group, and the Ray started here."""
        atexit.unregister(self.close)
        ray, self._ray = self._ray, None
        if ray is None:
            return
        actors, self._actors = self._actors, []
        if actors and not self._failed:  # after a failure the others may wait in a collective: not asked
            try:
                ray.get([actor.close.remote() for actor in actors], timeout=60)
            except Exception:  # a rank that died or hangs: killed below all the same
                pass
            for actor in actors:
                ray.kill(actor)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None
        if self._owns_ray:
            ray.shutdown()


__all__: Sequence[str] = ("DistributedLearner", "RankLearner", "RankLost", "split_groups_by_tokens")
