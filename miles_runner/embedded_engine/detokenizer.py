"""Token ids to text, stop-string matching and SGLang's stop trimming."""

from __future__ import annotations

from functools import lru_cache


class Detokenizer:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_text = lru_cache(maxsize=None)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def find_stop_string(text: str, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The stop string that occurs earliest in ``text`` and where; None when none does."""
    hits = [(text.find(stop), stop) for stop in stops if stop and stop in text]
    if not hits:
        return None
    position, stop = min(hits)
    return stop, position
