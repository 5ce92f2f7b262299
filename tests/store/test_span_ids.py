"""The span-id index of an attempt (lightning_grpc.store.span_ids): the same answers on either side of the move
of its ids from the dict into the sorted arrays."""

from __future__ import annotations

import os

from lightning_grpc.store.span_ids import MOVE_AT, SpanIdIndex


def span_id() -> str:
    return os.urandom(8).hex()


def test_every_id_keeps_its_number_across_moves_into_the_arrays() -> None:
    index = SpanIdIndex()
    numbers = {}
    for n in range(1, 3 * MOVE_AT + 7):
        sid = span_id()
        index[sid] = n
        numbers[sid] = n
        index.compact()
    assert len(index) == len(numbers)
    assert index.added(next(iter(numbers))) is None  # moved: no longer among the ids just added
    ids = list(numbers)
    unknown = [span_id() for _ in range(50)]
    assert index.lookup(ids + unknown) == list(numbers.values()) + [None] * 50
    assert all(index.get(sid) == n for sid, n in numbers.items())
    assert all(sid in index for sid in ids[:: MOVE_AT // 3])
    assert not any(sid in index for sid in unknown)
    assert sorted(index.values()) == sorted(numbers.values())
    # the extreme ids of 64 bits
    index["0000000000000000"] = -1
    index["ffffffffffffffff"] = -2
    for _ in range(MOVE_AT):
        index[span_id()] = 0
    index.compact()
    assert index.lookup(["0000000000000000", "ffffffffffffffff"]) == [-1, -2]


def test_ids_added_stay_in_the_dict_until_compact() -> None:
    index = SpanIdIndex({span_id(): n for n in range(MOVE_AT)})  # a loaded index moves at once
    assert index.added("00000000000000aa") is None
    index["00000000000000aa"] = 9
    assert index.added("00000000000000aa") == 9 and index.get("00000000000000aa") == 9
    for n in range(MOVE_AT):
        index[span_id()] = n
    assert index.added("00000000000000aa") == 9  # no move before compact(): a batch's lookups stay true
    index.compact()
    assert index.added("00000000000000aa") is None and index.get("00000000000000aa") == 9


def test_a_batch_keeps_the_numbers_of_ids_stored_before_it_and_numbers_an_id_sent_twice_once() -> None:
    loaded = {span_id(): n for n in range(1, MOVE_AT + 1)}
    index = SpanIdIndex(loaded)  # these ids are in the arrays
    moved = next(iter(loaded))
    recent = span_id()
    index[recent] = MOVE_AT + 1  # this one in the dict
    fresh = [span_id() for _ in range(4)]

    assert index.number(fresh[:2], 100) == ([100, 101], [0, 1])  # all new
    assert index.get(fresh[0]) == 100 and index.get(fresh[1]) == 101

    numbers, new = index.number([fresh[2], moved, recent, fresh[2], fresh[0], fresh[3]], 102)
    assert numbers == [102, loaded[moved], MOVE_AT + 1, 102, 100, 103]
    assert new == [0, 5]
    assert index.get(fresh[2]) == 102 and index.get(fresh[3]) == 103
