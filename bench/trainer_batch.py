"""Training-batch workload: stored LLM-call spans to verl's padded numpy arrays in the client.

    python bench/trainer_batch.py --target 127.0.0.1:PORT --groups 32 --group-size 8 --tokens 512

Fills the store (not timed): ``--groups`` GRPO groups of ``--group-size`` rollouts submitted through
the TrainerClient, each rollout played as a runner would (dequeued, one ``lightning.llm.call`` span
with ~``--tokens`` prompt and ~``--tokens`` response ids (±10 %, seeded), response log-probs and a
policy version, and a reward span; spans written in batches; completed).

Then times, interleaved, a bounded number of repetitions of

* ours: ``TrainerClient.get_batch(min_groups=G, request_id=R)`` with the same ``R`` every time. A
  retry with the same request id rebuilds the same batch from the stored spans (spans read, adapter,
  packing, the stream, padding in the client), so the repetitions are comparable;
* the peer: ``StoreClient.query_spans(rollout_id, "latest")`` for each rollout through the public
  client, then a per-row Python loop (element by element) that builds the same padded arrays.

Both are checked once to give identical arrays. Wire bytes are the received messages' ByteSize;
the int32 token payload is 4 bytes per prompt and response token. Everything is measured twice:
token ids from the embedded engine's tiny model (2,048 ids, uint16 on the wire) and from a
Qwen-sized vocabulary (151,646 ids, int32 on the wire). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_grpc import semconv
from lightning_grpc.batching import GroupSample
from lightning_grpc.client import StoreClient, TrainerClient, TrainingBatch
from lightning_grpc.types import Span

#: The embedded engine's tiny model (``lightning-grpc init-model``) and Qwen2.5's vocabulary.
VOCABULARIES = {"tiny_2048": 2_048, "qwen_151646": 151_646}
#: The padded arrays both sides build and compare.
ARRAYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "token_level_scores",
    "rollout_log_probs",
)
PAD = 0
POLICY_VERSION = 3
SPANS_PER_WRITE = 64


def seconds_summary(values: list[float]) -> dict[str, Any]:
    return {
        "median_ms": round(statistics.median(values) * 1000, 2),
        "best_ms": round(min(values) * 1000, 2),
        "repeats": len(values),
    }


# ------------------------------------------------------------------ filling the store (not timed)


def rollout_play(rng: np.random.Generator, tokens: int, vocab: int) -> dict[str, Any]:
    """One rollout's recorded call: ids, log-probs and reward (lengths within ±10 % of ``tokens``)."""
    low, high = max(1, round(tokens * 0.9)), max(1, round(tokens * 1.1))
    p_len, r_len = (int(n) for n in rng.integers(low, high + 1, size=2))
    return {
        "prompt": rng.integers(0, vocab, p_len).tolist(),
        "response": rng.integers(0, vocab, r_len).tolist(),
        "logprobs": (-rng.exponential(1.0, r_len)).tolist(),
        "reward": float(rng.random()),
    }


def spans_of(play: dict[str, Any], rollout_id: str, attempt_id: str) -> list[Span]:
    """The spans the proxy (the LLM call) and the agent (its reward) write for one rollout."""
    trace = uuid.uuid4().hex
    now = time.time_ns()
    call = Span(
        trace_id=trace,
        span_id=uuid.uuid4().hex[:16],
        name=semconv.SPAN_LLM_CALL,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        start_time_unix_nano=now,
        end_time_unix_nano=now + 1_000_000,
        attributes={
            semconv.LLM_PROMPT_TOKEN_IDS: play["prompt"],
            semconv.LLM_RESPONSE_TOKEN_IDS: play["response"],
            semconv.LLM_RESPONSE_LOGPROBS: play["logprobs"],
            semconv.LLM_POLICY_VERSION: POLICY_VERSION,
            semconv.LLM_MODEL: "policy",
        },
    )
    reward = Span(
        trace_id=trace,
        span_id=uuid.uuid4().hex[:16],
        name=semconv.SPAN_REWARD,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        start_time_unix_nano=now + 2_000_000,
        end_time_unix_nano=now + 2_001_000,
        attributes=semconv.reward_attributes(play["reward"]),
    )
    return [call, reward]


async def fill(
    store: StoreClient, trainer: TrainerClient, args: argparse.Namespace, vocab: int, seed: int
) -> tuple[list[str], list[str], int]:
    """Submit and play the groups; returns (group ids, rollout ids in batch order, prompt+response tokens)."""
    rng = np.random.default_rng(seed)
    groups = await trainer.submit_groups(
        [GroupSample({"task": i}) for i in range(args.groups)], args.group_size, step=1
    )
    rollout_ids = [rid for g in groups for rid in g.rollout_ids]
    plays = {rid: rollout_play(rng, args.tokens, vocab) for rid in rollout_ids}
    claimed: list[tuple[str, str]] = []
    while len(claimed) < len(rollout_ids):
        got = await store.dequeue_rollouts(len(rollout_ids) - len(claimed), worker_id="bench-runner", wait=5)
        for r in got:
            assert r.latest_attempt is not None and r.rollout_id in plays, r.rollout_id
            claimed.append((r.rollout_id, r.latest_attempt.attempt_id))
    pending: list[Span] = []
    for rid, aid in claimed:
        pending += spans_of(plays[rid], rid, aid)
        if len(pending) >= SPANS_PER_WRITE:
            await store.add_spans(pending)
            pending = []
    if pending:
        await store.add_spans(pending)
    for rid, aid in claimed:
        await store.complete_attempt(rid, aid, "succeeded")
    tokens = sum(len(p["prompt"]) + len(p["response"]) for p in plays.values())
    return [g.group_id for g in groups], rollout_ids, tokens


# ------------------------------------------------------------------ the peer: public span query + Python loop


Row = tuple[list[int], list[int], list[float], float]


def peer_row(spans: list[Span]) -> Row:
    """(prompt ids, response ids, log-probs, reward) of one rollout's spans."""
    call = next(s for s in spans if s.name == semconv.SPAN_LLM_CALL)
    reward = next(semconv.read_primary_reward(s.attributes) for s in spans if s.name == semconv.SPAN_REWARD)
    assert reward is not None
    a: dict[str, Any] = call.attributes
    return (
        a[semconv.LLM_PROMPT_TOKEN_IDS],
        a[semconv.LLM_RESPONSE_TOKEN_IDS],
        a[semconv.LLM_RESPONSE_LOGPROBS],
        reward,
    )


def peer_arrays(rows: list[Row]) -> dict[str, np.ndarray]:
    """verl's padded arrays, built row by row and element by element in Python."""
    width_p = max(len(r[0]) for r in rows)
    width_r = max(len(r[1]) for r in rows)
    out: dict[str, list[list[Any]]] = {name: [] for name in ARRAYS}
    for prompt, response, logprobs, reward in rows:
        prompts, attention = [], []
        for _ in range(width_p - len(prompt)):
            prompts.append(PAD)
            attention.append(0)
        for token in prompt:
            prompts.append(token)
            attention.append(1)
        responses, mask, scores, lps = [], [], [], []
        for j in range(width_r):
            if j < len(response):
                responses.append(response[j])
                attention.append(1)
                mask.append(1)
                lps.append(logprobs[j])
                scores.append(reward if j == len(response) - 1 else 0.0)
            else:
                responses.append(PAD)
                attention.append(0)
                mask.append(0)
                lps.append(0.0)
                scores.append(0.0)
        positions, seen = [], 0
        for bit in attention:
            seen += bit
            positions.append(seen - 1 if seen > 0 else 0)
        out["prompts"].append(prompts)
        out["responses"].append(responses)
        out["input_ids"].append(prompts + responses)
        out["attention_mask"].append(attention)
        out["position_ids"].append(positions)
        out["response_mask"].append(mask)
        out["token_level_scores"].append(scores)
        out["rollout_log_probs"].append(lps)
    floats = ("token_level_scores", "rollout_log_probs")
    return {name: np.array(v, dtype=np.float32 if name in floats else np.int64) for name, v in out.items()}


async def peer(store: StoreClient, rollout_ids: list[str]) -> tuple[dict[str, np.ndarray], float, float]:
    """(arrays, seconds querying spans, seconds building arrays)."""
    t0 = time.perf_counter()
    rows = [peer_row(await store.query_spans(rid, "latest")) for rid in rollout_ids]
    t1 = time.perf_counter()
    arrays = peer_arrays(rows)
    return arrays, t1 - t0, time.perf_counter() - t1


# ------------------------------------------------------------------ one vocabulary


def check_identical(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    for name in ARRAYS:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
        assert np.array_equal(a, b), f"{name} differs between get_batch and the per-row loop"


def wire_figures(batch: TrainingBatch, tokens: int) -> dict[str, Any]:
    payload = 4 * tokens
    assert batch.ragged is not None
    parts = {name: int(array.nbytes) for name, array in batch.ragged.arrays().items()}
    return {
        "wire_bytes": batch.wire_bytes,
        "int32_token_payload_bytes": payload,
        "wire_ratio": round(batch.wire_bytes / payload, 3),
        "token_dtype": str(batch.ragged.token_ids.dtype),
        "array_bytes": parts,
        "overhead_bytes": batch.wire_bytes - sum(parts.values()),
    }


async def measure(
    store: StoreClient, trainer: TrainerClient, args: argparse.Namespace, vocab_name: str, seed: int
) -> dict[str, Any]:
    vocab = VOCABULARIES[vocab_name]
    group_ids, rollout_ids, tokens = await fill(store, trainer, args, vocab, seed)
    request_id = f"bench-{vocab_name.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    t0 = time.perf_counter()
    first = await trainer.get_batch(min_groups=args.groups, wait=30, request_id=request_id)
    first_s = time.perf_counter() - t0  # the original request: takes the groups, then builds
    assert first.group_ids == group_ids, "the batch took other groups than the ones just filled"
    assert list(first.rollout_ids) == rollout_ids and len(first) == len(rollout_ids)
    theirs, _, _ = await peer(store, rollout_ids)
    check_identical(first.arrays, theirs)  # once: the comparison is honest

    ours_s: list[float] = []
    peer_s: list[float] = []
    peer_query_s: list[float] = []
    peer_build_s: list[float] = []
    deadline = time.perf_counter() + args.max_seconds
    while len(ours_s) < args.repeats and (len(ours_s) < args.min_repeats or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        batch = await trainer.get_batch(min_groups=args.groups, request_id=request_id)
        ours_s.append(time.perf_counter() - t0)
        assert batch.group_ids == group_ids
        t0 = time.perf_counter()
        _, query, build = await peer(store, rollout_ids)
        peer_s.append(time.perf_counter() - t0)
        peer_query_s.append(query)
        peer_build_s.append(build)

    no_lp = await trainer.get_batch(min_groups=args.groups, request_id=request_id, exclude_log_probs=True)
    assert "rollout_log_probs" not in no_lp.arrays and no_lp.group_ids == group_ids
    ours_sum, peer_sum = seconds_summary(ours_s), seconds_summary(peer_s)
    return {
        "vocabulary": vocab,
        "rows": len(first),
        "prompt_plus_response_tokens": tokens,
        "padded_shape": [int(n) for n in first.arrays["input_ids"].shape],
        "ours": {**ours_sum, "first_ms": round(first_s * 1000, 2)},
        "peer": {
            **peer_sum,
            "query_median_ms": round(statistics.median(peer_query_s) * 1000, 2),
            "build_median_ms": round(statistics.median(peer_build_s) * 1000, 2),
        },
        "speedup_median": round(peer_sum["median_ms"] / ours_sum["median_ms"], 2),
        "speedup_best": round(peer_sum["best_ms"] / ours_sum["best_ms"], 2),
        "identical_arrays": True,
        "with_log_probs": wire_figures(first, tokens),
        "without_log_probs": wire_figures(no_lp, tokens),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with StoreClient(args.target) as store, TrainerClient(args.target) as trainer:
        regimes = {}
        for i, name in enumerate(VOCABULARIES):
            regimes[name] = await measure(store, trainer, args, name, args.seed + i)
    head = regimes["tiny_2048"]
    return {
        "workload": "trainer_batch",
        "groups": args.groups,
        "group_size": args.group_size,
        "tokens": args.tokens,
        "speedup": head["speedup_median"],
        "wire_ratio": head["with_log_probs"]["wire_ratio"],
        "ours_median_ms": head["ours"]["median_ms"],
        "peer_median_ms": head["peer"]["median_ms"],
        "headline": "tiny_2048, with log-probs",
        "repetition": "get_batch retried with the same request_id: the same groups, rebuilt from the stored spans",
        "regimes": regimes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="about this many prompt and response ids")
    parser.add_argument("--repeats", type=int, default=7, help="at most this many timed repetitions")
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="no new repetition after this")
    parser.add_argument("--seed", type=int, default=20_261_122)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
