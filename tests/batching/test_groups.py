"""The book of GRPO groups (lightning_grpc.batching.groups): the open groups and each batch's groups."""

from __future__ import annotations

from lightning_grpc.batching.groups import Group, GroupBook, rollout_ids_of
from lightning_grpc.types import RolloutMode


def group(name: str, mode: RolloutMode = RolloutMode.TRAIN, batch_id: str = "") -> Group:
    return Group(name, rollout_ids_of(name, 2), mode, step=0, batch_id=batch_id)


def test_open_groups_are_those_no_batch_took_in_submission_order() -> None:
    book = GroupBook()
    groups = [book.add(group(f"g{i}")) for i in range(6)]
    book.add(group("v0", RolloutMode.VAL))
    book.add(group("old", batch_id="b-old"))  # as rebuilt after a restart
    book.take(groups[1:3], "b-1")
    assert [g.group_id for g in book.open_of_mode(RolloutMode.TRAIN)] == ["g0", "g3", "g4", "g5"]
    assert [g.group_id for g in book.open_of_mode(RolloutMode.VAL)] == ["v0"]
    assert [g.group_id for g in book.taken_by("b-1")] == ["g1", "g2"]
    assert [g.group_id for g in book.taken_by("b-old")] == ["old"]
    assert groups[1].batch_id == "b-1" and book.taken_by("b-none") == []
    assert len(book) == 8 and len(book.all()) == 8


def test_a_batch_that_was_not_made_gives_its_groups_back_in_their_order() -> None:
    book = GroupBook()
    groups = [book.add(group(f"g{i}")) for i in range(4)]
    book.take(groups[:2], "b-1")
    book.take(groups[2:3], "b-2")
    book.release(groups[:2])
    assert [g.group_id for g in book.open_of_mode(RolloutMode.TRAIN)] == ["g0", "g1", "g3"]
    assert book.taken_by("b-1") == [] and groups[0].batch_id == ""
    assert [g.group_id for g in book.taken_by("b-2")] == ["g2"]


def test_a_group_added_again_keeps_its_place_and_is_not_counted_twice() -> None:
    book = GroupBook()
    first = book.add(group("g0"))
    assert book.add(group("g0")) is first
    book.take([first], "b-1")
    assert book.add(group("g0")) is first
    assert book.open_of_mode(RolloutMode.TRAIN) == [] and book.taken_by("b-1") == [first]
