"""Training rows as numeric arrays: packed compactly for the wire, padded the way verl's PPO step takes them.

A batch travels *ragged*: every row's prompt then response ids in one flat array, with per-row
lengths, and the response mask and recorded log-probs over the concatenated responses. That is
little more than the token ids themselves. :func:`pad` turns it into verl's tensors (prompts
left-padded, responses right-padded, input_ids, attention_mask, position_ids =
clamp(cumsum(mask) - 1, 0), response_mask, token_level_scores with the row's reward at its last
response token, rollout_log_probs) with vectorised numpy: no loop over tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
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
)


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
    rollout_log_probs: np.ndarray | None = None  # [R] float32 (0 where a row has none), or None

    @property
    def rows(self) -> int:
        return int(self.prompt_lengths.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by name (the wire form)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["rollout_log_probs"] is None:
            del out["rollout_log_probs"]
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
        per_row = {name: getattr(self, name)[start:stop] for name in ROW_ARRAYS}
        lp = self.rollout_log_probs
        return Ragged(
            token_ids=self.token_ids[tok[start] : tok[stop]],
            response_mask=self.response_mask[res[start] : res[stop]],
            rollout_log_probs=None if lp is None else lp[res[start] : res[stop]],
            **per_row,
        )


def concat(parts: Sequence[Ragged]) -> Ragged:
    """Chunks of one batch back into one (row order kept)."""
    if not parts:
        raise ValueError("no chunks to join")
    with_lp = [p.rollout_log_probs is not None for p in parts]
    if any(with_lp) and not all(with_lp):
        raise ValueError("chunks of one batch disagree on whether log-probs are present")
    dtype = np.result_type(*(p.token_ids.dtype for p in parts))
    return Ragged(
        token_ids=np.concatenate([p.token_ids.astype(dtype, copy=False) for p in parts]),
        response_mask=np.concatenate([p.response_mask for p in parts]),
        rollout_log_probs=np.concatenate([p.rollout_log_probs for p in parts]) if all(with_lp) else None,  # type: ignore[misc]
        **{name: np.concatenate([getattr(p, name) for p in parts]) for name in ROW_ARRAYS},
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


def pack(rows: Sequence[PackRow], *, include_log_probs: bool = True) -> Ragged:
    """Rows into one ragged batch (rows_per_rollout is counted from rollout_index)."""
    n = len(rows)
    prompt_lengths = np.fromiter((len(r.prompt_ids) for r in rows), np.int32, n)
    response_lengths = np.fromiter((len(r.response_ids) for r in rows), np.int32, n)
    pieces = [ids for r in rows for ids in (r.prompt_ids, r.response_ids)]
    max_id = max((int(p.max()) for p in pieces if len(p)), default=0)
    token_ids = np.concatenate(pieces).astype(token_dtype(max_id)) if pieces else np.zeros(0, np.uint16)
    response_mask = (
        np.concatenate([r.response_mask for r in rows]).astype(np.uint8) if n else np.zeros(0, np.uint8)
    )
    has_lp = np.fromiter((include_log_probs and r.logprobs is not None for r in rows), np.bool_, n)
    log_probs = None
    if has_lp.any():
        log_probs = np.concatenate(
            [
                r.logprobs if r.logprobs is not None and include_log_probs else np.zeros(len(r.response_ids))
                for r in rows
            ]
        ).astype(np.float32)
    rollout_index = np.fromiter((r.rollout_index for r in rows), np.int32, n)
    counts = np.bincount(rollout_index) if n else np.zeros(0, np.int64)
    return Ragged(
        token_ids=token_ids,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        response_mask=response_mask,
        scores=np.fromiter((r.score for r in rows), np.float64, n).astype(np.float32),
        rollout_rewards=np.fromiter((r.rollout_reward for r in rows), np.float64, n).astype(np.float32),
        rollout_index=rollout_index,
        rows_per_rollout=counts[rollout_index].astype(np.int32),
        has_rollout_log_probs=has_lp,
        rollout_log_probs=log_probs,
    )


def _placements(lengths: np.ndarray, width: int, *, left: bool) -> np.ndarray:
    """Boolean [B, width]: where each row's tokens sit when padded on the left or on the right."""
    cols = np.arange(width)[None, :]
    lengths = lengths[:, None]
    return cols >= width - lengths if left else cols < lengths


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
    p_len = batch.prompt_lengths.astype(np.int64)
    r_len = batch.response_lengths.astype(np.int64)
    width_p = int(p_len.max()) if b else 0
    width_r = int(r_len.max()) if b else 0
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
    in_prompt = _placements(p_len, width_p, left=True)
    in_response = _placements(r_len, width_r, left=False)
    attended = np.concatenate([in_prompt, in_response], axis=1)
    # Row-major, the attended places of a row are its prompt's then its response's: exactly the order of
    # the ragged tokens, so one masked assignment fills the ids. prompts and responses are views into it.
    input_ids = np.full((b, width_p + width_r), pad_token_id, dtype=ids_dtype)
    input_ids[attended] = batch.token_ids
    prompts, responses = input_ids[:, :width_p], input_ids[:, width_p:]
    response_mask = np.zeros((b, width_r), dtype=ids_dtype)
    response_mask[in_response] = batch.response_mask
    attention_mask = attended.astype(ids_dtype)
    # clamp(cumsum(attention_mask) - 1, 0), computed directly: a row's positions count from its first token
    position_ids = np.arange(width_p + width_r, dtype=np.int64)[None, :] - (width_p - p_len)[:, None]
    np.clip(position_ids, 0, np.maximum(p_len + r_len - 1, 0)[:, None], out=position_ids)
    scores = np.zeros((b, width_r), dtype=np.float32)
    has_response = r_len > 0
    scores[np.flatnonzero(has_response), r_len[has_response] - 1] = batch.scores[has_response]
    out = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids.astype(ids_dtype, copy=False),
        "response_mask": response_mask,
        "token_level_scores": scores,
    }
    if batch.rollout_log_probs is not None:
        log_probs = np.zeros((b, width_r), dtype=np.float32)
        log_probs[in_response] = batch.rollout_log_probs
        out["rollout_log_probs"] = log_probs
    for name in ROW_ARRAYS:
        out[name] = getattr(batch, name)
    return out


#: The padded arrays holding token ids, masks or positions (int64 in memory, narrower on the wire).
INDEX_ARRAYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def row_bytes(batch: Ragged) -> np.ndarray:
    """Approximate wire bytes of each row (its token data plus a fixed per-row share)."""
    lp_size = 0 if batch.rollout_log_probs is None else 4
    tokens = (batch.prompt_lengths.astype(np.int64) + batch.response_lengths) * batch.token_ids.dtype.itemsize
    return tokens + batch.response_lengths.astype(np.int64) * (1 + lp_size) + 160


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
