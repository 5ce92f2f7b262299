"""GRPO groups: which rollouts belong together, which groups have ended, which a batch took.

Everything the book knows is also in the Store, in the rollouts' metadata (the keys below), so a
restarted server rebuilds the same book from its rollouts and nothing submitted is lost.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_grpc.types import Rollout, RolloutMode, RolloutStatus

#: Rollout metadata the trainer writes (and reads back after a restart).
GROUP_SIZE_KEY = "lightning.trainer.group_size"
SAMPLE_INDEX_KEY = "lightning.trainer.sample_index"
STEP_KEY = "lightning.trainer.step"
BATCH_KEY = "lightning.trainer.batch_id"

_GROUP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,119}")


def new_group_id() -> str:
    return f"g-{uuid.uuid4().hex[:16]}"


def is_group_id(text: str) -> bool:
    return _GROUP_ID.fullmatch(text) is not None


def rollout_ids_of(group_id: str, size: int) -> list[str]:
    """The ids of a group's rollouts: derived from the group id, so a resent submission is idempotent."""
    return [f"{group_id}-r{i}" for i in range(size)]


@dataclass
class Group:
    group_id: str
    rollout_ids: list[str]
    mode: RolloutMode
    step: int
    #: The batch that took the group ("" while not taken).
    batch_id: str = ""
    #: Still running when a batch closed without it.
    carried_over: bool = False


class GroupBook:
    """Groups in submission order, by id; the groups no batch took yet, by mode, and each batch's groups.

    The open groups and the batches are indexes, so that looking for ended groups costs what is open,
    not every group of the run. A group's ``batch_id`` changes through :meth:`take` and :meth:`release`.
    """

    def __init__(self) -> None:
        self._groups: dict[str, Group] = {}
        self._open: dict[RolloutMode, dict[str, Group]] = {}
        self._batches: dict[str, list[Group]] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, group_id: str) -> Group | None:
        return self._groups.get(group_id)

    def add(self, group: Group) -> Group:
        """Register a group; a group already known is kept as it is."""
        known = self._groups.setdefault(group.group_id, group)
        if known is group:
            if group.batch_id:
                self._batches.setdefault(group.batch_id, []).append(group)
            else:
                self._open.setdefault(group.mode, {})[group.group_id] = group
        return known

    def rebuild(self, rollouts: Iterable[Rollout]) -> None:
        """Recreate the book from the Store's trainer rollouts (after a restart)."""
        members: dict[str, list[tuple[int, Rollout]]] = {}
        for r in sorted(rollouts, key=lambda r: r.create_time):
            members.setdefault(r.group_id, []).append((int(r.metadata.get(SAMPLE_INDEX_KEY, 0)), r))
        for group_id, found in members.items():
            found.sort(key=lambda pair: pair[0])
            first = found[0][1]
            self.add(
                Group(
                    group_id=group_id,
                    rollout_ids=[r.rollout_id for _, r in found],
                    mode=first.mode,
                    step=int(first.metadata.get(STEP_KEY, 0)),
                    batch_id=str(first.metadata.get(BATCH_KEY, "")),
                )
            )

    def all(self) -> list[Group]:
        return list(self._groups.values())

    def open_of_mode(self, mode: RolloutMode) -> list[Group]:
        """The groups of ``mode`` no batch took, in submission order."""
        return list(self._open.get(mode, {}).values())

    def taken_by(self, batch_id: str) -> list[Group]:
        return list(self._batches.get(batch_id, ()))

    def take(self, groups: Iterable[Group], batch_id: str) -> None:
        """``groups`` (open ones) now belong to the batch ``batch_id``."""
        modes = set()
        for group in groups:
            self._open.get(group.mode, {}).pop(group.group_id, None)
            modes.add(group.mode)
            group.batch_id = batch_id
            self._batches.setdefault(batch_id, []).append(group)
        for mode in modes & self._open.keys():
            self._open[mode] = dict(self._open[mode])  # compact: a dict's removed slots are still walked

    def release(self, groups: Iterable[Group]) -> None:
        """``groups`` were taken by a batch that was not made: open again, in submission order."""
        for group in groups:
            taken = self._batches.get(group.batch_id, [])
            if group in taken:
                taken.remove(group)
                if not taken:
                    del self._batches[group.batch_id]
            group.batch_id = ""
        self._open = {}
        for group in self._groups.values():
            if not group.batch_id:
                self._open.setdefault(group.mode, {})[group.group_id] = group


def has_ended(group: Group, status_of: dict[str, RolloutStatus | None]) -> bool:
    """Every sibling is finished (a sibling the Store no longer has counts as finished)."""
    for rid in group.rollout_ids:
        status = status_of.get(rid)
        if status is not None and not status.is_terminal:
            return False
    return True
