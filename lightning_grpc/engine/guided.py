"""Constrained decoding with llguidance (vLLM's ``guidance`` backend): grammars, matchers, logit masks.

``Grammars`` wraps one loaded tokenizer for llguidance (built once: it reads the whole vocabulary),
checks a request's grammar before it is queued (so a bad schema is a 400, not a failed step), and hands
each constrained sequence its own matcher. The scheduler asks ``mask_rows`` for the tokens each
constrained row may take next and sets the others to -inf before sampling; only rows with a matcher pay
for it. Log-probs are taken before the mask, so they stay the model's own (as vLLM reports by default).
``mask_rows`` also says which rows the grammar allowed exactly one token: that token is forced, not the
policy's choice, and the engine reports its position so that training leaves it out of the loss.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lightning_grpc._extras import extra_imports

with extra_imports("engine"):
    import llguidance
    import llguidance.hf
    import torch

#: Compiled grammars kept (least recently used go first); a matcher for a request is a copy of one.
CACHED_GRAMMARS = 128
BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """The grammar (a tool's JSON schema, in practice) does not compile."""


class Grammars:
    """llguidance's view of one tokenizer; ``matcher(grammar)`` is thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        """Raise ``GrammarError`` with llguidance's message if the grammar does not compile."""
        self._pristine(grammar)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start."""
        return self._pristine(grammar).deep_copy()

    def _pristine(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            found = self._compiled.get(grammar)
            if found is not None:
                self._compiled.move_to_end(grammar)
                return found
        matcher = llguidance.LLMatcher(
            self.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
        )
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher


def mask_rows(
    logits: torch.Tensor, rows: Sequence[tuple[int, llguidance.LLMatcher]]
) -> tuple[torch.Tensor, list[bool]]:
    """A copy of ``logits`` where each listed row allows only its matcher's next tokens, and per listed row
    whether exactly one token was allowed (sampling had no choice: a forced token, not to be trained)."""
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for slot, (_, matcher) in enumerate(rows):
        words = bitmask[
            slot
        ]  # what llguidance.torch.fill_next_token_bitmask does, without its torch.compile import
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
    allowed = ((bitmask[:, :, None] >> BITS) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor([row for row, _ in rows], dtype=torch.long)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    forced = (allowed.sum(dim=1) == 1).tolist()
    return masked, forced
