"""Text of generated tokens: incremental detokenization with stop strings, and per-token strings.

``OutputText`` turns a growing list of token ids into text one token at a time. It decodes a short
window of recent tokens rather than the whole output (so a step costs the same at token 10 and at token
10,000), holds back a token whose bytes do not form whole characters yet (byte-level BPE splits UTF-8
sequences), looks for stop strings in the new text only, and, for streaming, holds back the tail that
could still become the start of a stop string, so text handed out is never taken back.

``TokenTexts`` gives the string and the exact bytes of a single token for logprobs: for a byte-level
BPE the bytes come from the byte alphabet (a token can be half a character), otherwise from the
token's decoded text.
"""

from __future__ import annotations

from typing import Any

from lightning_grpc.engine.protocol import SamplingParams

REPLACEMENT = "\ufffd"


class OutputText:
    """The text of one sequence as its tokens arrive."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stop_string: str | None = None
        self._prefix = 0
        self._read = 0
        self._before: str | None = ""

    def add(self, token_id: int) -> int:
        """Append a token; returns the offset in the text where the token's text begins."""
        offset = len(self.text)
        self.ids.append(token_id)
        if self.stop_string is None:
            self._append(self._delta(final=False))
        return offset

    def finish(self) -> None:
        """The sequence ended: decode what was held back for lack of whole characters."""
        if self.stop_string is None:
            self._append(self._delta(final=True))

    def take(self, final: bool) -> str:
        """Text not handed out yet; without ``final``, keeps back what may begin a stop string."""
        end = len(self.text)
        if not final and self._longest_stop:
            end = max(self.sent, end - (self._longest_stop - 1))
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def _delta(self, *, final: bool) -> str:
        """Decode the window from ``_prefix``: what it adds to the text of ``ids[_prefix:_read]``."""
        if self._before is None:
            self._before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(self._before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        delta = after[len(self._before) :]
        self._prefix, self._read, self._before = self._read, len(self.ids), None
        return delta

    def _append(self, delta: str) -> None:
        if not delta:
            return
        search_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += delta
        if self._stops:
            self._find_stop(search_from)

    def _find_stop(self, start: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[: at + (len(stop) if self._include_stop else 0)]
            self.stop_string = stop


class TokenTexts:
    """``(text, bytes)`` of single tokens, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel" or str(decoder).startswith("ByteLevel")
        self._alphabet = byte_alphabet()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if (
            self._byte_level
            and token_id not in self._added
            and isinstance(piece, str)
            and all(ch in self._alphabet for ch in piece)
        ):
            raw = bytes(self._alphabet[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
        return text, list(text.encode("utf-8"))


def byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each of the 256 bytes as a printable character, and back.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few more) are moved,
    in order, to the characters from U+0100 on.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    moved = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(0x100 + moved)] = byte
            moved += 1
    return alphabet
