"""An attempt's span ids and their sequence ids, as the store keeps them to answer a resent span with its number.

A span id is 16 lowercase hex characters: 64 bits. Held in a dict of strings, an id and its number cost about
150 bytes; an attempt of a million spans would hold 150 MB for them alone. :class:`SpanIdIndex` keeps the
latest ids in a small dict and moves them, a few thousand at a time, into two sorted NumPy arrays (the ids as
unsigned 64-bit integers, their numbers beside them): 16 bytes an id. An attempt with fewer spans than one
such move (nearly all of them) never leaves the dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import numpy.typing as npt

#: Ids held in the dict before they move into the arrays.
MOVE_AT = 4096


def _as_keys(span_ids: Iterable[str]) -> npt.NDArray[np.uint64]:
    """16-hex-character span ids as unsigned 64-bit integers (big-endian hex, one parse for all)."""
    return np.frombuffer(bytes.fromhex("".join(span_ids)), dtype=">u8").astype(np.uint64)


class SpanIdIndex:
    """span id -> sequence id of an attempt's stored spans (see the module's docstring).

    Ids added go into the dict; :meth:`compact` moves them into the arrays once there are enough, and is
    called between batches, so that a batch's lookups made up front (:meth:`lookup`) stay true while the
    batch is numbered (an id added earlier in the same batch is found with :meth:`added`).
    """

    __slots__ = ("_keys", "_numbers", "_recent")

    def __init__(self, known: Mapping[str, int] | None = None) -> None:
        self._recent: dict[str, int] = {}
        self._keys: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self._numbers: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        if known:
            self._recent.update(known)
            self.compact()

    @property
    def moved(self) -> bool:
        """Whether some ids are in the arrays (else every id is in the dict, and :meth:`added` finds it)."""
        return len(self._keys) > 0

    def __len__(self) -> int:
        return len(self._recent) + len(self._keys)

    def __contains__(self, span_id: object) -> bool:
        return isinstance(span_id, str) and self.get(span_id) is not None

    def get(self, span_id: str) -> int | None:
        """The sequence id of ``span_id`` when it is stored, else None."""
        found = self._recent.get(span_id)
        if found is not None or not len(self._keys):
            return found
        return self.lookup([span_id])[0]

    def lookup(self, span_ids: list[str]) -> list[int | None]:
        """:meth:`get` of many ids at once (one search of the arrays for all of them)."""
        recent = self._recent
        found: list[int | None] = [recent.get(s) for s in span_ids]
        if not len(self._keys):
            return found
        missing = [i for i, number in enumerate(found) if number is None]
        if not missing:
            return found
        keys = _as_keys(span_ids[i] for i in missing)
        at = np.searchsorted(self._keys, keys)
        inside = at < len(self._keys)
        hit = np.zeros(len(keys), dtype=bool)
        hit[inside] = self._keys[at[inside]] == keys[inside]
        for j in np.flatnonzero(hit).tolist():
            found[missing[j]] = int(self._numbers[at[j]])
        return found

    def added(self, span_id: str) -> int | None:
        """The sequence id of ``span_id`` when it was added since the last :meth:`compact`, else None."""
        return self._recent.get(span_id)

    def number(self, span_ids: list[str], first: int) -> tuple[list[int], list[int]]:
        """Numbers for a batch of span ids: an id stored before, or met earlier in the batch, keeps its
        number; each new id takes the next number from ``first`` on, in order, and is added. Returns each
        id's number and the positions of the new ids."""
        known = self.lookup(span_ids)
        n = len(span_ids)
        if known.count(None) == n and len(set(span_ids)) == n:  # all new: the common batch
            self._recent.update(zip(span_ids, range(first, first + n), strict=True))
            return list(range(first, first + n)), list(range(n))
        numbers: list[int] = []
        fresh: list[int] = []
        for span_id, found in zip(span_ids, known, strict=True):
            if found is None:
                found = self._recent.get(span_id)  # earlier in this batch
                if found is None:
                    found = self._recent[span_id] = first + len(fresh)
                    fresh.append(len(numbers))
            numbers.append(found)
        return numbers, fresh

    def __setitem__(self, span_id: str, number: int) -> None:
        self._recent[span_id] = number

    def compact(self) -> None:
        """Move the dict's ids into the arrays once it holds :data:`MOVE_AT` of them."""
        if len(self._recent) >= MOVE_AT:
            self._move()

    def values(self) -> Iterator[int]:
        """Every sequence id in use."""
        yield from self._recent.values()
        yield from self._numbers.tolist()

    def _move(self) -> None:
        """Move the dict's ids into the sorted arrays."""
        keys = np.concatenate([self._keys, _as_keys(self._recent)])
        numbers = np.concatenate(
            [self._numbers, np.fromiter(self._recent.values(), np.int64, len(self._recent))]
        )
        order = np.argsort(keys, kind="stable")
        self._keys, self._numbers = keys[order], numbers[order]
        self._recent = {}
