"""The order training tasks are drawn in: seeded epochs, each a permutation of every task, drawn in turn.

Within an epoch every task is drawn once before any is drawn again; the order depends only on the seed, so a
run resumed from a checkpoint (which keeps :attr:`TaskPlan.drawn`) draws exactly what the run it continues
would have drawn. Each group carries its place in the plan (:meth:`TaskPlan.metadata`), so the store shows
which task every group played and in which epoch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Group metadata keys: the draw's position in the plan, its epoch, and the task's index in the task file.
PLAN_POSITION_KEY = "plan.position"
PLAN_EPOCH_KEY = "plan.epoch"
PLAN_TASK_KEY = "plan.task"


@dataclass
class TaskPlan:
    """Draws task indexes ``0 .. tasks - 1`` epoch after epoch."""

    tasks: int
    seed: int
    #: Draws made so far (the position of the next one).
    drawn: int = 0

    def __post_init__(self) -> None:
        if self.tasks < 1:
            raise ValueError("a task plan needs at least one task")
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """The task indexes of ``epoch``, in the order they are drawn."""
        if epoch not in self._orders:
            order = list(range(self.tasks))
            random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run needs
        return self._orders[epoch]

    def at(self, position: int) -> int:
        """The task index drawn at ``position``."""
        epoch, offset = divmod(position, self.tasks)
        return self.order(epoch)[offset]

    def draw(self, count: int) -> list[int]:
        """The next ``count`` positions of the plan (the plan moves on by that many)."""
        positions = list(range(self.drawn, self.drawn + count))
        self.drawn += count
        return positions

    def metadata(self, position: int) -> dict[str, int]:
        return {
            PLAN_POSITION_KEY: position,
            PLAN_EPOCH_KEY: position // self.tasks,
            PLAN_TASK_KEY: self.at(position),
        }
