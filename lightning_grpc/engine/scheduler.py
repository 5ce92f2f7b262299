"""Iteration-level batching of many sequences over one transformers causal LM, in a worker thread.

The design, in short: one thread owns the model and a single batched KV cache (a transformers
``DynamicCache``) holding every running sequence, left-padded to a common length, with a 2-D attention
mask telling real positions from padding. Each iteration of its loop:

1. admits waiting sequences into the free rows (``max_batch_size`` rows in all, ``max_prefill_tokens``
   padded prompt tokens per iteration), in arrival order;
2. prefills the newcomers together in one forward pass (left padding; identical prompts, e.g. the
   ``n`` choices of one request, are computed once and their cache rows copied), samples their first
   token, and merges their cache into the running one (the shorter side padded on the left);
3. runs one decode step for every running sequence at once: the last sampled token of each row, the
   position ids counted from each row's own mask (so padding never shifts the rotary positions), then
   samples one token per row with that row's own parameters (temperature, top-p/top-k, penalties,
   logit bias, a private ``torch.Generator`` when the request has a seed);
4. hands each request its new tokens (ids, text, logprobs) through a thread-safe callback, drops
   finished and cancelled rows from the cache, and trims mask columns no row uses any more.

So a request arriving while 31 others are decoding joins at the next iteration rather than waiting for
them, and 32 concurrent agents cost about one forward pass per token, not 32. Sampling inverts the
cumulative distribution at one uniform number per row and step; a seeded sequence draws its numbers
from its own generator, so the same seed and request give the same tokens whatever else is in the
batch (up to floating-point differences of batched arithmetic).
Logprobs are those of the model's own distribution (before temperature, penalties, filtering and a
grammar's mask), as vLLM reports by default.

A sequence whose parameters carry a ``grammar`` (a forced tool call) gets an llguidance matcher: before
sampling, its row's logits are masked to the tokens the grammar allows (``guided.mask_rows``), after
sampling the matcher takes the token, and once the grammar is complete it allows only the end of turn,
which ends the sequence. Each of its updates says whether the token was forced (the mask allowed only
that one), so the server can report the positions the policy did not choose. Rows without a grammar
skip all of this (their updates' ``forced`` is None).

Weight updates never mix versions within a response: a pending update stops the admission of requests
that have not started, lets every running sequence (and the rest of a request already started) finish
on the old weights, applies the update when the batch is empty, and then admits the waiting requests,
which run on the new weights. Every event carries the policy version that produced it.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import inspect
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_grpc._extras import extra_imports

with extra_imports("engine"):
    import torch
    from transformers import DynamicCache

from lightning_grpc import logs
from lightning_grpc.engine.guided import Grammars, mask_rows
from lightning_grpc.engine.protocol import SamplingParams
from lightning_grpc.engine.text import OutputText

log = logs.get_logger(__name__)

SEED_MIX = 0x9E3779B97F4A7C15


# ---------------------------------------------------------------- what requests get back
@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SequenceUpdate:
    """New output of one choice in one iteration."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Offset in the choice's text where each new token's text begins.
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Per new token, whether a grammar allowed only it (None: the sequence has no grammar).
    forced: list[bool] | None = None


@dataclass
class StepEvent:
    policy_version: int
    updates: list[SequenceUpdate]
    error: str | None = None


Sink = Callable[[StepEvent], None]

#: Upper bounds of the tokens-a-step histogram (vLLM's ``vllm:iteration_tokens_total`` buckets); one more
#: bucket counts the steps above the last.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineCounters:
    """What the scheduler has done since it started; written by its thread only, read as a :meth:`copy`.

    A step is one iteration of the loop: a prefill pass over the sequences it admitted, then one decode
    pass over the whole batch. Its tokens are the admitted prompts' plus one for each row decoded.
    """

    steps: int = 0
    decode_passes: int = 0
    prefill_passes: int = 0
    #: Prompt tokens prefilled (a prompt shared by ``n`` choices counts once per choice, as it is sent).
    prompt_tokens: int = 0
    #: Tokens sampled, over every choice.
    generation_tokens: int = 0
    step_tokens_sum: int = 0
    #: Steps by their tokens: index i counts the steps with at most ``STEP_TOKEN_BUCKETS[i]`` tokens (and more
    #: than the bound before); the last index counts the steps above every bound.
    step_token_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))

    def count_step(self, prompt_tokens: int, decoded_rows: int) -> None:
        tokens = prompt_tokens + decoded_rows
        self.steps += 1
        self.prompt_tokens += prompt_tokens
        self.step_tokens_sum += tokens
        self.step_token_counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, tokens)] += 1

    def copy(self) -> EngineCounters:
        return replace(self, step_token_counts=list(self.step_token_counts))


class Submission:
    """One request: ``len(prompts) * n`` sequences; choice ``p * n + j`` is prompt ``p``'s ``j``-th."""

    def __init__(
        self,
        request_id: str,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        n: int,
        sink: Sink,
    ) -> None:
        self.request_id = request_id
        self.prompts = [list(p) for p in prompts]
        self.params = list(params)
        self.n = n
        self.sink = sink
        self.cancelled = False
        self.started = False
        self.policy_version = -1

    def cancel(self) -> None:
        """The client went away: its sequences leave the batch at the next iteration."""
        self.cancelled = True


class _Sequence:
    def __init__(self, sub: Submission, index: int, tokenizer: Any, grammars: Grammars | None) -> None:
        self.sub = sub
        self.index = index
        self.prompt = sub.prompts[index // sub.n]
        self.params = sub.params[index // sub.n]
        self.text = OutputText(tokenizer, self.params)
        self.generator: torch.Generator | None = None
        if self.params.seed is not None and not self.params.greedy:
            self.generator = torch.Generator().manual_seed(_mix(self.params.seed, index))
        self.matcher: Any = None
        if self.params.grammar is not None:
            if grammars is None:
                raise RuntimeError("this engine cannot constrain generation (no grammar support loaded)")
            self.matcher = grammars.matcher(self.params.grammar)
        self.done = False

    def grammar_ended(self, token: int) -> bool:
        """Feed the token to the matcher; true once the grammar is complete and the end of turn taken.

        A matcher in error (a token the mask did not allow: cannot happen) ends the sequence too.
        """
        if self.matcher is None:
            return False
        complete = bool(self.matcher.is_stopped())  # then the mask allowed only the end of turn
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            log.warning("event=grammar_rejected_token request_id=%s token=%d", self.sub.request_id, token)
            return True
        return complete

    def advance(
        self, token: int, logprob: TokenLogprob | None, eos_ids: frozenset[int], forced: bool | None = None
    ) -> SequenceUpdate:
        offset = self.text.add(token)
        params = self.params
        finish: str | None = None
        stop_reason: int | str | None = None
        if self.grammar_ended(token):
            finish = "stop"
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif token in eos_ids and not params.ignore_eos:
            finish = "stop"
        elif self.text.stop_string is not None:
            finish, stop_reason = "stop", self.text.stop_string
        elif len(self.text.ids) >= params.max_tokens:
            finish = "length"
        if finish is not None:
            self.text.finish()
            self.done = True
        return SequenceUpdate(
            index=self.index,
            token_ids=[token],
            text=self.text.take(final=finish is not None),
            logprobs=[logprob] if logprob is not None else [],
            offsets=[offset],
            finish_reason=finish,
            stop_reason=stop_reason,
            forced=None if forced is None else [forced],
        )


@dataclass
class _WeightUpdate:
    apply: Callable[[], None]
    policy_version: int | None
    future: concurrent.futures.Future[int]
    queued_at: float = field(default_factory=time.monotonic)


# ---------------------------------------------------------------- the scheduler
#: By model class, the keyword its forward pass takes the KV cache under (see with_cache).
_CACHE_KEYWORDS: dict[type, str] = {}


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands a KV cache to ``model``'s forward pass.

    ``cache`` where the forward takes it (transformers 5 renamed ``past_key_values`` to it, and drops the old
    name in 5.40), else ``past_key_values``. A cache passed under a name the forward no longer takes is not
    an error there: the model would build a cache of its own, and each decode step would see its one new
    token without the tokens before it.
    """
    model_class = type(model)
    name = _CACHE_KEYWORDS.get(model_class)
    if name is None:
        parameters = inspect.signature(model_class.forward).parameters
        name = _CACHE_KEYWORDS[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return {name: cache}


def prefill(
    model: Any, prompts: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """One forward pass over left-padded prompts: (float32 next-token logits [B, V], KV cache, mask [B, W])."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    cache = DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(1) - 1).clamp(min=0),
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :].float(), cache, mask


class Scheduler:
    """Owns the model in one thread; ``submit`` and ``update_weights`` may be called from any thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        eos_ids: Iterable[int],
        max_batch_size: int = 64,
        max_prefill_tokens: int = 16384,
        policy_version: int = 0,
        pad_id: int = 0,
        threads: int | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.threads = threads
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.policy_version = policy_version
        self.pad_id = pad_id
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._counters = EngineCounters()
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._updates: deque[_WeightUpdate] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._unseeded = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        # The running batch.
        self._active: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pending = torch.zeros(0, dtype=torch.long)

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def load(self) -> dict[str, int]:
        with self._cond:
            return {
                "running": len(self._active),
                "waiting": len(self._waiting),
                "updates": len(self._updates),
            }

    def counters(self) -> EngineCounters:
        """A copy of the scheduler's counters (its thread may be adding to them meanwhile)."""
        return self._counters.copy()

    def submit(self, sub: Submission) -> None:
        sequences = [
            _Sequence(sub, i, self.tokenizer, self.grammars) for i in range(len(sub.prompts) * sub.n)
        ]
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._waiting.extend(sequences)
            self._cond.notify_all()

    def update_weights(
        self, apply: Callable[[], None], policy_version: int | None = None
    ) -> concurrent.futures.Future[int]:
        """Run ``apply`` in the scheduler thread once the batch is drained; resolves to the new version."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self._updates.append(_WeightUpdate(apply, policy_version, future))
            self._cond.notify_all()
        return future

    # ------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # with OpenMP, for this thread only
        while True:
            with self._cond:
                while not (self._closing or self._active or self._waiting or self._updates):
                    self._cond.wait()
                if self._closing:
                    break
                self._drop_cancelled_waiting()
                self._apply_updates_if_drained()
                newcomers = self._admit()
            try:
                with torch.inference_mode():
                    if newcomers:
                        self._prefill(newcomers)
                    decoded = len(self._active)
                    if decoded:
                        self._decode()
                if newcomers or decoded:
                    self._counters.count_step(sum(len(seq.prompt) for seq in newcomers), decoded)
            except Exception as exc:
                log.exception("event=engine_step_failed batch=%d error=%s", len(self._active), exc)
                self._fail([*self._active, *newcomers], f"generation failed: {exc}")
                self._reset_batch()
        self._shutdown()

    def _drop_cancelled_waiting(self) -> None:
        if any(s.sub.cancelled for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.sub.cancelled)

    def _apply_updates_if_drained(self) -> None:
        busy = bool(self._active) or any(s.sub.started for s in self._waiting)
        while self._updates and not busy:
            update = self._updates.popleft()
            started = time.monotonic()
            try:
                update.apply()
            except Exception as exc:
                log.exception("event=weights_update_failed error=%s", exc)
                update.future.set_exception(exc)
                continue
            version = self.policy_version + 1 if update.policy_version is None else update.policy_version
            self.policy_version = version
            log.info(
                "event=weights_applied policy_version=%d waited_seconds=%.3f apply_seconds=%.3f",
                version,
                started - update.queued_at,
                time.monotonic() - started,
            )
            update.future.set_result(version)

    def _admit(self) -> list[_Sequence]:
        """Waiting sequences for the free rows, within the prefill budget; none of a new request while
        a weight update waits."""
        free = self.max_batch_size - len(self._active)
        taken: list[_Sequence] = []
        kept: deque[_Sequence] = deque()
        longest = 0
        while self._waiting:
            seq = self._waiting.popleft()
            blocked = bool(self._updates) and not seq.sub.started
            longer = max(longest, len(seq.prompt))
            over_budget = bool(taken) and longer * (len(taken) + 1) > self.max_prefill_tokens
            if blocked or len(taken) >= free or over_budget:
                kept.append(seq)
                continue
            if not seq.sub.started:
                seq.sub.started = True
                seq.sub.policy_version = self.policy_version
            taken.append(seq)
            longest = longer
        self._waiting = kept
        return taken

    def _prefill(self, seqs: list[_Sequence]) -> None:
        unique: dict[tuple[int, ...], int] = {}
        rows = [unique.setdefault(tuple(s.prompt), len(unique)) for s in seqs]
        logits, cache, mask = prefill(self.model, list(unique), self.pad_id)
        self._counters.prefill_passes += 1
        if rows != list(range(len(unique))):
            index = torch.tensor(rows, dtype=torch.long)
            logits, mask = logits[index], mask[index]
            _select_rows(cache, index)
        tokens = self._sample(logits, seqs)
        self._merge(cache, mask, tokens, seqs)
        self._retire()

    def _decode(self) -> None:
        mask = torch.cat([self._mask, torch.ones(len(self._active), 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=self._pending[:, None],
            attention_mask=mask,
            position_ids=self._mask.sum(1, keepdim=True),
            **with_cache(self.model, self._cache),
            use_cache=True,
        )
        self._mask = mask
        self._counters.decode_passes += 1
        self._pending = self._sample(out.logits[:, -1, :].float(), self._active)
        self._retire()

    # ------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> torch.Tensor:
        """One token per row, each with its sequence's parameters; delivers the updates."""
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs for p in params]
        raw = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        adjusted = self._adjust(logits, seqs)
        constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        forced: list[bool | None] = [None] * len(seqs)
        if constrained:
            adjusted, only = mask_rows(adjusted, constrained)
            for (row, _), one in zip(constrained, only, strict=True):
                forced[row] = one
        greedy = adjusted.argmax(dim=-1)
        tokens = greedy
        if not all(p.greedy for p in params):
            sampled = self._draw(adjusted, seqs)
            is_greedy = torch.tensor([p.greedy for p in params])
            tokens = torch.where(is_greedy, greedy, sampled)
        self._deliver(seqs, tokens.tolist(), raw, want_logprobs, forced)
        return tokens

    def _adjust(self, logits: torch.Tensor, seqs: list[_Sequence]) -> torch.Tensor:
        """Logit bias and presence/frequency penalties (over the generated tokens)."""
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.params.logit_bias or s.params.presence_penalty or s.params.frequency_penalty
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p = seqs[i].params
            for token, bias in p.logit_bias:
                if 0 <= token < logits.shape[1]:
                    logits[i, token] += bias
            if seqs[i].text.ids and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(torch.tensor(seqs[i].text.ids), minlength=logits.shape[1])
                counts = counts[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _draw(self, logits: torch.Tensor, seqs: list[_Sequence]) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform number per row, from the row's own generator if seeded."""
        params = [s.params for s in seqs]
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _top_k_top_p(scaled, params)
        cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
        uniform = torch.rand(len(seqs), generator=self._unseeded)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                uniform[i] = torch.rand(1, generator=seq.generator)[0]
        # In (0, total]: the first index whose cumulative mass reaches it has a non-zero probability.
        target = (1.0 - uniform[:, None]) * cdf[:, -1:]
        return torch.searchsorted(cdf, target)[:, 0].clamp(max=cdf.shape[1] - 1)

    def _deliver(
        self,
        seqs: list[_Sequence],
        tokens: list[int],
        raw: torch.Tensor | None,
        want: list[int | None],
        forced: list[bool | None],
    ) -> None:
        chosen: list[float] = []
        top_ids: list[list[int]] = []
        top_values: list[list[float]] = []
        if raw is not None:
            chosen = raw.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            k = max((w or 0) for w in want)
            if k:
                values, ids = raw.topk(k, dim=-1)
                top_ids, top_values = ids.tolist(), values.tolist()
        self._counters.generation_tokens += len(tokens)
        by_request: dict[Submission, list[SequenceUpdate]] = {}
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            logprob = None
            if want[i] is not None:
                k = want[i] or 0
                top = list(zip(top_ids[i][:k], top_values[i][:k], strict=True)) if k else []
                logprob = TokenLogprob(token, chosen[i], top)
            update = seq.advance(token, logprob, self.eos_ids, forced[i])
            by_request.setdefault(seq.sub, []).append(update)
        for sub, updates in by_request.items():
            if not sub.cancelled:
                _safe_sink(sub, StepEvent(sub.policy_version, updates))

    # ------------------------------------------------------------ the batch
    def _merge(
        self, cache: DynamicCache, mask: torch.Tensor, pending: torch.Tensor, seqs: list[_Sequence]
    ) -> None:
        if self._cache is None or not self._active:
            self._cache, self._mask, self._pending, self._active = cache, mask, pending, list(seqs)
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self._cache), _layers(cache), strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)], dim=0)
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)], dim=0)
        self._mask = torch.cat([_pad_mask(self._mask, width), _pad_mask(mask, width)], dim=0)
        self._pending = torch.cat([self._pending, pending])
        self._active.extend(seqs)

    def _retire(self) -> None:
        """Drop finished and cancelled rows; trim the columns only they used."""
        keep = [i for i, s in enumerate(self._active) if not (s.done or s.sub.cancelled)]
        if not keep:
            self._reset_batch()
            return
        if len(keep) < len(self._active):
            index = torch.tensor(keep, dtype=torch.long)
            assert self._cache is not None
            _select_rows(self._cache, index)
            self._mask, self._pending = self._mask[index], self._pending[index]
            self._active = [self._active[i] for i in keep]
        used = self._mask.sum(dim=0).nonzero()
        first = int(used[0, 0]) if len(used) else 0
        if first > 0:
            assert self._cache is not None
            for layer in _layers(self._cache):
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]
            self._mask = self._mask[:, first:]

    def _reset_batch(self) -> None:
        self._active, self._cache = [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._pending = torch.zeros(0, dtype=torch.long)

    def _fail(self, seqs: Iterable[_Sequence], message: str) -> None:
        for sub in {s.sub: None for s in seqs}:
            _safe_sink(sub, StepEvent(sub.policy_version, [], error=message))

    def _shutdown(self) -> None:
        with self._cond:
            waiting, self._waiting = [*self._active, *self._waiting], deque()
            updates, self._updates = list(self._updates), deque()
        self._fail(waiting, "the engine is shutting down")
        for update in updates:
            update.future.set_exception(RuntimeError("the engine is shutting down"))
        self._reset_batch()


# ---------------------------------------------------------------- helpers
def _top_k_top_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = scaled.shape[1]
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    ordered = ordered.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = torch.tensor([p.top_p for p in params])[:, None]
    ordered = ordered.masked_fill(mass_before > top_p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's per-layer key and value tensors, ``[batch, heads, positions, head_dim]`` each."""
    return list(cache.layers)


def _select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    for layer in _layers(cache):
        layer.keys = layer.keys[index]
        layer.values = layer.values[index]


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))


def _pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))


def _mix(seed: int, index: int) -> int:
    """A generator seed per choice: choice 0 uses the request's seed itself."""
    return (seed + index * SEED_MIX) % 2**63


def _safe_sink(sub: Submission, event: StepEvent) -> None:
    try:
        sub.sink(event)
    except Exception as exc:  # a closed event loop: the client is gone
        log.debug("event=engine_sink_failed request_id=%s error=%s", sub.request_id, exc)
        sub.cancel()
