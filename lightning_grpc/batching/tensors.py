"""Training rows as numeric arrays: packed compactly for the wire, padded the way verl's PPO step takes them.

A batch travels *ragged*: every row's prompt then response ids in one flat array, with per-row
lengths, and the response mask and recorded log-probs over the concatenated responses. That is
little more than the token ids themselves. :func:`pad` turns it into verl's tensors (prompts
left-padded, responses right-padded, input_ids, attention_mask, position_ids =
clamp(cumsum(mask) - 1, 0), response_mask, token_level_scores with the row's reward at its last
response token, rollout_log_probs) with vectorised numpy: no loop over tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import numpy as np

#: Names of the per-row arrays every batch carries (besides the token data).
ROW_ARRAYS = (
    "prompt_lengths",
    "response_lengths",
    "scores",
    "rollout_rewards",
    "rollout_index",
    "rows_per_rollout",
    "has_rollout_log_probs",
    "turn_index",
    "truncated",
    "filled",
    "calls_per_row",
)
#: Per-row arrays a batch carries when its server makes them: a batch from a server before them lacks them
#: (``Ragged`` then holds None, and the learner keeps its configured value). ``temperatures``: float32, the
#: temperature each row's calls were sampled at, as the proxy recorded it (1.0, the engine default, when a
#: call's span does not say).
OPTIONAL_ROW_ARRAYS = ("temperatures",)


def token_dtype(max_id: int) -> np.dtype:
    """The narrowest dtype that holds every token id: uint16 for vocabularies under 65,536, else int32."""
    if max_id < 1 << 16:
        return np.dtype(np.uint16)
    if max_id < 1 << 31:
        return np.dtype(np.int32)
    return np.dtype(np.int64)


@dataclass
class Ragged:
    """A batch's rows, packed."""

    token_ids: np.ndarray  # [N] each row's prompt then response
    prompt_lengths: np.ndarray  # [B] int32
    response_lengths: np.ndarray  # [B] int32
    response_mask: np.ndarray  # [R] uint8, R = sum(response_lengths)
    scores: np.ndarray  # [B] float32: the row's reward, placed at its last response token when padded
    rollout_rewards: np.ndarray  # [B] float32: the reward of the row's rollout
    rollout_index: np.ndarray  # [B] int32: index of the row's rollout in the batch
    rows_per_rollout: np.ndarray  # [B] int32
    has_rollout_log_probs: np.ndarray  # [B] bool
    turn_index: np.ndarray  # [B] int32: call index of the row's first call in its rollout
    truncated: np.ndarray  # [B] bool: cut to the length limits
    filled: np.ndarray  # [B] bool: its rollout failed and the failure policy filled its reward
    calls_per_row: np.ndarray  # [B] int32: calls merged into the row
    rollout_log_probs: np.ndarray | None = None  # [R] float32 (0 where a row has none), or None
    temperatures: np.ndarray | None = None  # [B] float32: the sampling temperature of the row's calls

    def row_arrays(self) -> dict[str, np.ndarray]:
        """The per-row arrays by name (the optional ones when present)."""
        out = {name: getattr(self, name) for name in ROW_ARRAYS}
        for name in OPTIONAL_ROW_ARRAYS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def rows(self) -> int:
        return int(self.prompt_lengths.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by name (the wire form)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("rollout_log_probs", *OPTIONAL_ROW_ARRAYS):
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Ragged:
        missing = [name for name in ("token_ids", "response_mask", *ROW_ARRAYS) if name not in arrays]
        if missing:
            raise ValueError(f"a ragged batch needs the arrays {', '.join(missing)}")
        return cls(**{f.name: arrays.get(f.name) for f in fields(cls)})  # type: ignore[arg-type]

    def row_slice(self, start: int, stop: int) -> Ragged:
        """Rows [start, stop) as a batch of their own (rollout_index keeps pointing into the whole batch)."""
        lengths = self.prompt_lengths.astype(np.int64) + self.response_lengths
        tok = np.concatenate(([0], np.cumsum(lengths)))
        res = np.concatenate(([0], np.cumsum(self.response_lengths, dtype=np.int64)))
        per_row = {name: array[start:stop] for name, array in self.row_arrays().items()}
        lp = self.rollout_log_probs
        return Ragged(
            token_ids=self.token_ids[tok[start] : tok[stop]],
            response_mask=self.response_mask[res[start] : res[stop]],
            rollout_log_probs=None if lp is None else lp[res[start] : res[stop]],
            **per_row,
        )


def take(batch: Ragged, rows: np.ndarray) -> Ragged:
    """The rows where the boolean mask ``rows`` is set, in their order, as a batch of their own
    (rollout_index keeps pointing into the whole batch; rows_per_rollout holds when whole rollouts are taken)."""
    keep = np.asarray(rows, dtype=np.bool_)
    if keep.shape != (batch.rows,):
        raise ValueError(f"the row mask has shape {keep.shape}, the batch {batch.rows} rows")
    response_lengths = batch.response_lengths.astype(np.int64)
    tokens = np.repeat(keep, batch.prompt_lengths.astype(np.int64) + response_lengths)
    responses = np.repeat(keep, response_lengths)
    lp = batch.rollout_log_probs
    return Ragged(
        token_ids=batch.token_ids[tokens],
        response_mask=batch.response_mask[responses],
        rollout_log_probs=None if lp is None else lp[responses],
        **{name: array[keep] for name, array in batch.row_arrays().items()},
    )


def concat(parts: Sequence[Ragged]) -> Ragged:
    """Chunks of one batch back into one (row order kept)."""
    if not parts:
        raise ValueError("no chunks to join")
    with_lp = [p.rollout_log_probs is not None for p in parts]
    if any(with_lp) and not all(with_lp):
        raise ValueError("chunks of one batch disagree on whether log-probs are present")
    optional = {}
    for name in OPTIONAL_ROW_ARRAYS:
        present = [getattr(p, name) is not None for p in parts]
        if any(present) and not all(present):
            raise ValueError(f"chunks of one batch disagree on whether {name} are present")
        if all(present):
            optional[name] = np.concatenate([getattr(p, name) for p in parts])
    dtype = np.result_type(*(p.token_ids.dtype for p in parts))
    return Ragged(
        token_ids=np.concatenate([p.token_ids.astype(dtype, copy=False) for p in parts]),
        response_mask=np.concatenate([p.response_mask for p in parts]),
        rollout_log_probs=np.concatenate([p.rollout_log_probs for p in parts]) if all(with_lp) else None,
        **{name: np.concatenate([getattr(p, name) for p in parts]) for name in ROW_ARRAYS},
        **optional,
    )


@dataclass
class PackRow:
    """What packing needs of one row."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray | None
    score: float
    rollout_reward: float
    rollout_index: int
    turn_index: int = 0
    truncated: bool = False
    filled: bool = False
    calls: int = 1
    temperature: float = 1.0


class RaggedBuilder:
    """Collects rows one by one (column by column, no per-row objects) and packs them at once."""

    def __init__(self, *, include_log_probs: bool = True) -> None:
        self.include_log_probs = include_log_probs
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._log_probs: list[np.ndarray | None] = []
        self._columns: dict[str, list[float | int | bool]] = {
            name: []
            for name in (
                "prompt_lengths",
                "response_lengths",
                "scores",
                "rollout_rewards",
                "rollout_index",
                "turn_index",
                "truncated",
                "filled",
                "calls_per_row",
                "temperatures",
            )
        }

    def __len__(self) -> int:
        return len(self._masks)

    def add(
        self,
        prompt_ids: np.ndarray,
        response_ids: np.ndarray,
        response_mask: np.ndarray,
        logprobs: np.ndarray | None,
        *,
        score: float,
        rollout_reward: float,
        rollout_index: int,
        turn_index: int = 0,
        truncated: bool = False,
        filled: bool = False,
        calls: int = 1,
        temperature: float = 1.0,
    ) -> None:
        self._tokens += (prompt_ids, response_ids)
        self._masks.append(response_mask)
        self._log_probs.append(logprobs if self.include_log_probs else None)
        c = self._columns
        c["prompt_lengths"].append(len(prompt_ids))
        c["response_lengths"].append(len(response_ids))
        c["scores"].append(score)
        c["rollout_rewards"].append(rollout_reward)
        c["rollout_index"].append(rollout_index)
        c["turn_index"].append(turn_index)
        c["truncated"].append(truncated)
        c["filled"].append(filled)
        c["calls_per_row"].append(calls)
        c["temperatures"].append(temperature)

    def build(self) -> Ragged:
        c = self._columns
        token_ids = np.concatenate(self._tokens) if self._tokens else np.zeros(0, np.int32)
        max_id = int(token_ids.max()) if len(token_ids) else 0
        has_lp = np.array([lp is not None for lp in self._log_probs], dtype=np.bool_)
        log_probs = None
        if has_lp.any():
            log_probs = np.concatenate(
                [
                    lp if lp is not None else np.zeros(len(m))
                    for lp, m in zip(self._log_probs, self._masks, strict=True)
                ]
            ).astype(np.float32, copy=False)
        rollout_index = np.array(c["rollout_index"], dtype=np.int32)
        counts = np.bincount(rollout_index) if len(rollout_index) else np.zeros(0, np.int64)
        return Ragged(
            token_ids=token_ids.astype(token_dtype(max_id), copy=False),
            prompt_lengths=np.array(c["prompt_lengths"], dtype=np.int32),
            response_lengths=np.array(c["response_lengths"], dtype=np.int32),
            response_mask=np.concatenate(self._masks).astype(np.uint8, copy=False)
            if self._masks
            else np.zeros(0, np.uint8),
            # the stored float64 rewards, rounded once to float32
            scores=np.array(c["scores"], dtype=np.float64).astype(np.float32),
            rollout_rewards=np.array(c["rollout_rewards"], dtype=np.float64).astype(np.float32),
            rollout_index=rollout_index,
            rows_per_rollout=counts[rollout_index].astype(np.int32),
            has_rollout_log_probs=has_lp,
            turn_index=np.array(c["turn_index"], dtype=np.int32),
            truncated=np.array(c["truncated"], dtype=np.bool_),
            filled=np.array(c["filled"], dtype=np.bool_),
            calls_per_row=np.array(c["calls_per_row"], dtype=np.int32),
            rollout_log_probs=log_probs,
            temperatures=np.array(c["temperatures"], dtype=np.float32),
        )


def pack(rows: Sequence[PackRow], *, include_log_probs: bool = True) -> Ragged:
    """Rows into one ragged batch (rows_per_rollout is counted from rollout_index)."""
    builder = RaggedBuilder(include_log_probs=include_log_probs)
    for r in rows:
        builder.add(
            r.prompt_ids,
            r.response_ids,
            r.response_mask,
            r.logprobs,
            score=r.score,
            rollout_reward=r.rollout_reward,
            rollout_index=r.rollout_index,
            turn_index=r.turn_index,
            truncated=r.truncated,
            filled=r.filled,
            calls=r.calls,
            temperature=r.temperature,
        )
    return builder.build()


def _placements(lengths: np.ndarray, width: int, *, left: bool) -> np.ndarray:
    """Boolean [B, width]: where each row's tokens sit when padded on the left or on the right."""
    cols = np.arange(width)[None, :]
    lengths = lengths[:, None]
    return cols >= width - lengths if left else cols < lengths


#: Batches of at least this many padded positions are padded by two threads (half the rows each): most
#: of the time goes to the first writes into fresh memory, which the kernel serves faster in parallel.
PARALLEL_PAD_POSITIONS = 1 << 17
_pad_pool: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _pad_pool
    if _pad_pool is None:
        _pad_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lightning-pad")
    return _pad_pool


def _fill_rows(
    batch: Ragged, out: dict[str, np.ndarray], width_p: int, width_r: int, pad_token_id: int
) -> None:
    """Write every element of the padded arrays ``out`` (views of these rows) from the ragged rows."""
    p_len = batch.prompt_lengths.astype(np.int64)
    r_len = batch.response_lengths.astype(np.int64)
    in_prompt = _placements(p_len, width_p, left=True)
    in_response = _placements(r_len, width_r, left=False)
    attended = np.concatenate([in_prompt, in_response], axis=1)
    # Row-major, the attended places of a row are its prompt's then its response's: exactly the order of
    # the ragged tokens, so one masked assignment fills the ids.
    input_ids = out["input_ids"]
    input_ids.fill(pad_token_id)
    input_ids[attended] = batch.token_ids
    np.copyto(out["attention_mask"], attended)
    response_mask = out["response_mask"]
    response_mask.fill(0)
    response_mask[in_response] = batch.response_mask
    # clamp(cumsum(attention_mask) - 1, 0), computed directly: a row's positions count from its first token
    position_ids = out["position_ids"]
    np.subtract(
        np.arange(width_p + width_r, dtype=np.int64)[None, :], (width_p - p_len)[:, None], out=position_ids
    )
    np.clip(position_ids, 0, np.maximum(p_len + r_len - 1, 0)[:, None], out=position_ids)
    scores = out["token_level_scores"]
    scores.fill(0.0)
    has_response = r_len > 0
    scores[np.flatnonzero(has_response), r_len[has_response] - 1] = batch.scores[has_response]
    if batch.rollout_log_probs is not None:
        log_probs = out["rollout_log_probs"]
        log_probs.fill(0.0)
        log_probs[in_response] = batch.rollout_log_probs


def padded_outputs(
    rows: int, width_p: int, width_r: int, *, log_probs: bool, ids_dtype: np.dtype | type = np.int64
) -> dict[str, np.ndarray]:
    """Uninitialised padded arrays for ``rows`` rows (``prompts`` and ``responses`` are views into
    ``input_ids``); :func:`fill_padded` writes every element."""
    input_ids = np.empty((rows, width_p + width_r), dtype=ids_dtype)
    out = {
        "prompts": input_ids[:, :width_p],
        "responses": input_ids[:, width_p:],
        "input_ids": input_ids,
        "attention_mask": np.empty((rows, width_p + width_r), dtype=ids_dtype),
        "position_ids": np.empty((rows, width_p + width_r), dtype=np.int64),
        "response_mask": np.empty((rows, width_r), dtype=ids_dtype),
        "token_level_scores": np.empty((rows, width_r), dtype=np.float32),
    }
    if log_probs:
        out["rollout_log_probs"] = np.empty((rows, width_r), dtype=np.float32)
    return out


def fill_padded(
    batch: Ragged,
    out: Mapping[str, np.ndarray],
    width_p: int,
    width_r: int,
    pad_token_id: int,
    start: int = 0,
) -> None:
    """Pad ``batch``'s rows into rows ``[start, start + batch.rows)`` of ``out`` (two threads when large)."""
    b = batch.rows
    views = {name: array[start : start + b] for name, array in out.items()}
    if b > 1 and b * (width_p + width_r) >= PARALLEL_PAD_POSITIONS:
        half = b // 2
        jobs = [
            _pool().submit(
                _fill_rows,
                batch.row_slice(lo, hi),
                {name: array[lo:hi] for name, array in views.items()},
                width_p,
                width_r,
                pad_token_id,
            )
            for lo, hi in ((0, half), (half, b))
        ]
        for job in jobs:
            job.result()
    else:
        _fill_rows(batch, views, width_p, width_r, pad_token_id)


def pad(
    batch: Ragged,
    *,
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    ids_dtype: np.dtype | type = np.int64,
) -> dict[str, np.ndarray]:
    """verl's padded tensors of a ragged batch, plus its per-row arrays.

    ``prompt_length`` / ``response_length`` fix the padded widths (at least the longest row); by
    default they are the longest prompt and response of the batch.
    """
    b = batch.rows
    width_p = int(batch.prompt_lengths.max()) if b else 0
    width_r = int(batch.response_lengths.max()) if b else 0
    if prompt_length is not None:
        if prompt_length < width_p:
            raise ValueError(f"prompt_length {prompt_length} is shorter than the longest prompt ({width_p})")
        width_p = prompt_length
    if response_length is not None:
        if response_length < width_r:
            raise ValueError(
                f"response_length {response_length} is shorter than the longest response ({width_r})"
            )
        width_r = response_length
    out = padded_outputs(
        b, width_p, width_r, log_probs=batch.rollout_log_probs is not None, ids_dtype=ids_dtype
    )
    fill_padded(batch, out, width_p, width_r, pad_token_id)
    if ids_dtype != np.int64:
        out["position_ids"] = out["position_ids"].astype(ids_dtype)
    out.update(batch.row_arrays())
    return out


#: The padded arrays holding token ids, masks or positions (int64 in memory, narrower on the wire).
INDEX_ARRAYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def row_bytes(batch: Ragged) -> np.ndarray:
    """Approximate wire bytes of each row (its token data plus a fixed per-row share)."""
    lp_size = 0 if batch.rollout_log_probs is None else 4
    tokens = (batch.prompt_lengths.astype(np.int64) + batch.response_lengths) * batch.token_ids.dtype.itemsize
    sizes: np.ndarray = tokens + batch.response_lengths.astype(np.int64) * (1 + lp_size) + 160
    return sizes


def chunk_bounds(sizes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Row ranges whose summed sizes stay within ``limit`` (a single larger row gets a range of its own)."""
    bounds: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes.tolist()):
        if i > start and total + size > limit:
            bounds.append((start, i))
            start, total = i, 0
        total += size
    bounds.append((start, len(sizes)))
    return bounds
